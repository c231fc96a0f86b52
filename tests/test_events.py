"""Traces: events serialise to JSON and load back equal; untrusted traces are checked, never trusted."""

import json

import pytest

from specgui.core import decode
from specgui.core.events import MAX_TRACE_BYTES, dumps_trace, load_trace, loads_trace, save_trace
from specgui.errors import SpecGUIError

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4]


def test_trace_round_trip(tiny_lm, tmp_path):
    events = list(decode.generate(tiny_lm, PROMPT, "pld", max_new_tokens=20, prompt_text="abc"))
    path = tmp_path / "run.json"
    save_trace(events, path)
    loaded = load_trace(path)
    assert loaded == events
    assert loaded[-1].tau == events[-1].tau and loaded[2].rejected == events[2].rejected


def _trace(events):
    return json.loads(dumps_trace(events))


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.update(format="other"), "not a SpecGUI trace"),
    (lambda t: t.update(version=99), "unsupported trace version"),
    (lambda t: t["events"].pop(0), "begin with exactly one start"),
    (lambda t: t["events"][1].update(token="x"), "wrong type"),
    (lambda t: t["events"][1].pop("token"), "missing field"),
    (lambda t: t["events"][2].update(type="exec"), "not a SpecGUI event"),
    (lambda t: t["events"][2].update(draft_tokens=[1, [2]]), "wrong type"),
])
def test_malformed_traces_are_refused(tiny_lm, mutate, message):
    trace = _trace(list(decode.generate(tiny_lm, PROMPT, "pld", max_new_tokens=8)))
    mutate(trace)
    with pytest.raises(SpecGUIError, match=message):
        loads_trace(json.dumps(trace))


def test_a_trace_cannot_size_the_page_by_its_header_or_its_nesting(tiny_lm):
    """A 1.3 KB trace claiming 10^6 layers once took 18 s and 1.6 GB to draw; JSON nested 500 deep broke the replay
    outside its checks."""
    trace = _trace(list(decode.generate(tiny_lm, PROMPT, "pld", max_new_tokens=8)))
    trace["events"][0]["num_layers"] = 10**6
    with pytest.raises(SpecGUIError, match=r"num_layers must lie in 1..1024, got 1000000"):
        loads_trace(json.dumps(trace))
    trace["events"][0]["num_layers"] = 2
    nested: list = []
    trace["events"][1]["payload"] = {"deep": nested}
    for _ in range(600):
        nested.append([])
        nested = nested[0]
    with pytest.raises(SpecGUIError, match="nested deeper than 32 levels"):
        loads_trace(json.dumps(trace))
    with pytest.raises(SpecGUIError, match="nested deeper than 32 levels"):
        loads_trace('{"format": "specgui-trace", "events": ' + "[" * 100_000 + "]" * 100_000 + "}")


def test_garbage_and_huge_traces_are_refused(tmp_path):
    with pytest.raises(SpecGUIError, match="not valid JSON"):
        loads_trace("{nope")
    with pytest.raises(SpecGUIError, match="larger than"):
        loads_trace(" " * (MAX_TRACE_BYTES + 1))
    with pytest.raises(SpecGUIError, match="cannot read"):
        load_trace(tmp_path / "missing.json")
    with pytest.raises(SpecGUIError, match="cannot read"):
        load_trace(tmp_path)  # a directory

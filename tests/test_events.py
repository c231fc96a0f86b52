"""Traces: events serialise to JSON and load back equal; untrusted traces are checked, never trusted."""

import json

import pytest

from specgui import decode
from specgui.errors import SpecGUIError
from specgui.events import MAX_TRACE_BYTES, dumps_trace, load_trace, loads_trace, save_trace

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


def test_garbage_and_huge_traces_are_refused(tmp_path):
    with pytest.raises(SpecGUIError, match="not valid JSON"):
        loads_trace("{nope")
    with pytest.raises(SpecGUIError, match="larger than"):
        loads_trace(" " * (MAX_TRACE_BYTES + 1))
    with pytest.raises(SpecGUIError, match="cannot read"):
        load_trace(tmp_path / "missing.json")

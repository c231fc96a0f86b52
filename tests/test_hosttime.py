"""A step's host time (`specgui.hosttime`): the step's wall less its programs' time, and the part of it between the
verdict's read and the next launch. Held with sleeps put where the host works and where a program runs, so the
verdicts rest on the sleeps' lengths, never on the machine's speed."""

import time

import pytest

from specgui import bench, decode, fastpath, hosttime
from specgui.methods.pld import PromptLookup
from specgui.sampling import GREEDY

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4]
SLEEP_S = 0.05


def run(lm, method="pld", tokens=12):
    return hosttime.measured_run(lm, PROMPT, method, max_new_tokens=tokens, fast_path="on")


def test_every_step_is_timed_and_the_tokens_are_the_runs(tiny_lm):
    result, steps = run(tiny_lm)
    assert len(steps) == len(result.steps) > 1
    assert result.token_ids == decode.run(tiny_lm, PROMPT, "pld", max_new_tokens=12, fast_path="on").token_ids
    for step in steps:
        assert step.wall_ms >= step.program_ms > 0 and 0 <= step.critical_ms <= step.host_ms


def test_host_work_after_the_read_is_host_time_the_device_waits_for(tiny_lm, monkeypatch):
    observe = PromptLookup.observe

    def slow(self, state, outcome):
        if not outcome.prefill:
            time.sleep(SLEEP_S)
        return observe(self, state, outcome)

    monkeypatch.setattr(PromptLookup, "observe", slow)
    _, steps = run(tiny_lm)
    for step in steps[1:]:  # the first step's launch follows the prefill's observe, not slowed
        assert step.host_ms >= SLEEP_S * 1000 and step.critical_ms >= SLEEP_S * 1000  # on the next step's account
    assert steps[0].critical_ms < SLEEP_S * 1000


def test_time_inside_a_program_is_not_host_time(tiny_lm, monkeypatch):
    call = fastpath.Program.__call__

    def slow(program):
        time.sleep(SLEEP_S)
        return call(program)

    monkeypatch.setattr(fastpath.Program, "__call__", slow)
    _, steps = run(tiny_lm, "baseline", 6)
    for step in steps:
        assert step.program_ms >= SLEEP_S * 1000 > step.host_ms


@pytest.mark.parametrize("fast_path, timed", [("on", True), ("off", False)])
def test_bench_reports_medians_a_step_on_the_fast_path(tiny_lm, fast_path, timed):
    from specgui.prompts import PromptRow

    row = PromptRow(id="p", category="c", prompt="")
    runs = [bench.run_method(tiny_lm, row, PROMPT, "pld", 12, GREEDY, None, fast_path)]
    figures = bench._profile(runs)
    assert ("host_ms_per_step" in figures and "host_critical_ms_per_step" in figures) is timed
    if timed:
        assert figures["host_ms_per_step"] == pytest.approx(hosttime.medians(runs[0].host)["host_ms"])

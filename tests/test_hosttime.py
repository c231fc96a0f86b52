"""A step's host time (`specgui.tools.hosttime`): the step's wall less its programs' time, and the part of it between
the verdict's read and the next launch. Held with sleeps put where the host works and where a program runs, so the
verdicts rest on the sleeps' lengths, never on the machine's speed."""

import time

import pytest

from helpers import drafting
from specgui import fastpath
from specgui.core import decode, verify
from specgui.core.sampling import GREEDY
from specgui.methods.fractal.fractal import Fractal
from specgui.methods.layerskip.admg import Admg
from specgui.methods.ngram.lookahead import Lookahead
from specgui.methods.ngram.pld import PromptLookup
from specgui.methods.policy import DraftPolicy
from specgui.tools import bench, hosttime

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4]
SLEEP_S = 0.05


def run(lm, method="lookahead", tokens=12, pipeline=True):
    """At the paper's fixed draft sizes: Lookahead never pauses, and its drafts need the verdict before them, so its
    steps launch after every read."""
    return hosttime.measured_run(lm, PROMPT, method, max_new_tokens=tokens, fast_path="on", pipeline=pipeline,
                                 params=drafting(method, None))


def launched(steps, pipeline, method="lookahead"):
    """The steps whose stretch before their event launched a forward: pipelined, all but the last (the next step's
    forward goes out before a step's event; none after the last step), and for plain steps chained on the device
    (baseline's) all but the last two (the step after next goes out before a step's event); serially all."""
    return steps if not pipeline else steps[:-2] if method == "baseline" else steps[:-1]


@pytest.mark.parametrize("pipeline", [True, False])
def test_every_step_is_timed_and_the_tokens_are_the_runs(tiny_lm, pipeline):
    result, steps = run(tiny_lm, pipeline=pipeline)
    assert len(steps) == len(result.steps) > 1
    assert result.token_ids == decode.run(tiny_lm, PROMPT, "baseline", max_new_tokens=12, fast_path="on").token_ids
    for step in steps:
        assert step.wall_ms >= step.program_ms >= 0 and step.critical_ms >= 0
    # the waited-for gap is host time: pipelined within its step's stretch (the read, then the next launch before the
    # event); serially it runs from the read before the step's event to the next step's launch, across the two steps'
    # stretches (a stall in the first then outweighed the second's host time on the busy 2-core machine, 1 run in 5)
    assert all(step.critical_ms <= step.host_ms for step in steps) if pipeline else (
        sum(step.critical_ms for step in steps) <= sum(step.host_ms for step in steps))
    assert all(step.program_ms > 0 for step in launched(steps, pipeline))
    assert not pipeline or steps[-1].program_ms == steps[-1].critical_ms == 0


@pytest.mark.parametrize("pipeline", [True, False])
def test_host_work_after_the_read_is_host_time_the_device_waits_for(tiny_lm, monkeypatch, pipeline):
    slow_observe(monkeypatch, Lookahead)
    _, steps = run(tiny_lm, pipeline=pipeline)
    assert all(step.host_ms >= SLEEP_S * 1000 for step in steps)  # every step's observe sleeps
    # before the next draft: the device waits for it either way, serially on the next step's account (the first
    # step's launch follows the prefill's observe, not slowed), pipelined on its own (which launches the next step)
    waited = steps[:-1] if pipeline else steps[1:]
    assert all(step.critical_ms >= SLEEP_S * 1000 for step in waited)
    assert (steps[-1] if pipeline else steps[0]).critical_ms < SLEEP_S * 1000


@pytest.mark.parametrize("pipeline", [True, False])
def test_the_verifiers_walk_after_the_read_is_waited_for(tiny_lm, monkeypatch, pipeline):
    """The waited-for gap opens when the verdict's values are read, not when the verifier returns: its walk down the
    draft (here slowed) is host work between the read and the next launch, on a GPU with the device idle."""
    walk = verify._greedy

    def slow(*args, **kwargs):
        time.sleep(SLEEP_S)
        return walk(*args, **kwargs)

    monkeypatch.setattr(verify, "_greedy", slow)
    _, steps = run(tiny_lm, pipeline=pipeline)
    waited = steps[:-1] if pipeline else steps[1:]  # (as a slow observe's: the read before the next launch)
    assert all(step.critical_ms >= SLEEP_S * 1000 for step in waited)


@pytest.mark.parametrize(("method", "drafter"), [("pld", PromptLookup), ("admg", Admg), ("fractal", Fractal)])
def test_host_work_after_the_read_of_a_step_chained_on_the_device_is_not_waited_for(tiny_lm, monkeypatch, method,
                                                                                      drafter):
    """Prompt lookup's, layer-skip and carried steps chained on the device (`fastpath.LookupSteps`, `SkipSteps`,
    `SlotSteps`): each is launched before the step before it is read, so the host's work after that read (here a slow
    observe) is host time no forward waits for; only the first steps (ADMG's first draft adopts its skip set,
    Fractal's first chain restarts after the prompt) and the last, launched after a read where the budget had no room
    for a step ahead, wait."""
    slow_observe(monkeypatch, drafter)
    result, steps = run(tiny_lm, method, 24)
    assert all(step.host_ms >= SLEEP_S * 1000 for step in steps[1:])
    chained = [step for step in steps if step.critical_ms < SLEEP_S * 1000]
    assert len(chained) >= len(steps) // 2 and result.summary.drafted > 0


@pytest.mark.parametrize("method", ["clasp", "fractal", "pld"])
def test_a_drafts_sizing_is_priced_beside_the_forward_not_waited_for(tiny_lm, monkeypatch, method):
    """On the device's path the next step's plan is chosen beside this step's forward (`DraftPolicy.plan_ahead`):
    pricing every draft size (here slowed) is host time no forward waits for. (The first step's plan is priced at its
    turn, after the prompt's read: it is left out.)"""
    priced = DraftPolicy._priced

    def slow(self, *args, **kwargs):
        time.sleep(SLEEP_S)
        return priced(self, *args, **kwargs)

    monkeypatch.setattr(DraftPolicy, "_priced", slow)
    result, steps = run(tiny_lm, method, 16)
    priced_steps = [step for step in steps if step.host_ms >= SLEEP_S * 1000]  # (none near the budget's end)
    assert result.summary.drafted > 0 and len(priced_steps) >= len(steps) // 2
    assert not any(step.critical_ms >= SLEEP_S * 1000 for step in steps[1:])


def slow_observe(monkeypatch, drafter):
    """`drafter`'s observe after every step sleeps `SLEEP_S` first (host work after the read)."""
    observe = drafter.observe

    def slow(self, state, outcome):
        if not outcome.prefill:
            time.sleep(SLEEP_S)
        return observe(self, state, outcome)

    monkeypatch.setattr(drafter, "observe", slow)


@pytest.mark.parametrize("pipeline", [True, False])
def test_time_inside_a_program_is_not_host_time(tiny_lm, monkeypatch, pipeline):
    call = fastpath.Program.__call__

    def slow(program):
        time.sleep(SLEEP_S)
        return call(program)

    monkeypatch.setattr(fastpath.Program, "__call__", slow)
    _, steps = run(tiny_lm, "baseline", 6, pipeline)
    for step in launched(steps, pipeline, "baseline"):
        assert step.program_ms >= SLEEP_S * 1000 > step.host_ms
    assert not pipeline or steps[-1].program_ms == 0 < steps[-1].host_ms < SLEEP_S * 1000


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_program_between_the_read_and_the_next_launch_is_not_waited_for(tiny_lm, monkeypatch, pipeline):
    """A program run after the read that launches no pass (a tree's keeper, moving the accepted keys) is the device's
    work: on a GPU it runs while the host goes on to the next launch. On a CPU its call is not in the gap."""
    call, keep = fastpath.Program.__call__, fastpath.StaticKVCache.keep

    class Moves:  # stands for such a program: its run sleeps
        pass

    def run_or_sleep(program):
        if isinstance(program, Moves):
            time.sleep(SLEEP_S)
            return None
        return call(program)

    def slow_keep(self, start, offsets):
        fastpath.Program.__call__(Moves())
        return keep(self, start, offsets)

    monkeypatch.setattr(fastpath.Program, "__call__", run_or_sleep)
    monkeypatch.setattr(fastpath.StaticKVCache, "keep", slow_keep)
    _, steps = run(tiny_lm, pipeline=pipeline)
    assert sum(step.program_ms for step in steps) >= (len(steps) - 1) * SLEEP_S * 1000  # every step's read keeps
    assert all(step.critical_ms < SLEEP_S * 1000 for step in steps)


@pytest.mark.parametrize("fast_path, timed", [("on", True), ("off", False)])
def test_bench_reports_medians_a_step_on_the_fast_path(tiny_lm, fast_path, timed):
    from specgui.tools.prompts import PromptRow

    row = PromptRow(id="p", category="c", prompt="")
    runs = [bench.run_method(tiny_lm, row, PROMPT, "pld", 12, GREEDY, None, fast_path)]
    figures = bench._profile(runs)
    assert ("host_ms_per_step" in figures and "host_critical_ms_per_step" in figures) is timed
    if timed:
        assert figures["host_ms_per_step"] == pytest.approx(hosttime.medians(runs[0].host)["host_ms"])

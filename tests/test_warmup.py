"""The start's calibration in the background (`specgui.ui.warmup`) and the phases said aloud (`specgui.core.progress`),
on the tiny model: a held calibration is seen running, with its progress, while a Run waits behind it and says so;
released, it finishes, and the waiting Run is priced by what it learnt; a failed or skipped one says what prices the
predictions instead."""

import html
import threading

import pytest

from helpers import tiny_model
from specgui import costs, fastpath
from specgui.core import progress
from specgui.core.events import Start, Summary
from specgui.core.sampling import Sampling
from specgui.ui import runs, warmup
from specgui.ui.runs import BaselineCache, ModelStore, RunRequest

PROMPT = list(range(3, 20))


@pytest.fixture
def lm(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path))  # a profile of its own, measured afresh
    return tiny_model(seed=5)


def test_a_phase_is_on_the_board_and_in_the_terminal_while_it_runs(capsys):
    board = progress.Board()
    board.to_terminal()
    with board.phase("doing a slow thing", total=3) as phase:
        board.advance(phase, "first")
        assert board.now() == [phase] and phase.line().startswith("doing a slow thing: 1 of 3 (first), ")
    assert board.now() == []
    err = capsys.readouterr().err
    assert "doing a slow thing …" in err and "doing a slow thing: done in" in err


def test_a_run_pressed_while_the_start_calibrates_waits_and_is_priced_by_the_finished_calibration(lm):
    gate = threading.Event()
    start = warmup.Warmup(hold=gate.wait)
    assert start.line() == "" and list(start.ticks(threading.Event())) == []  # nothing to wait for yet
    job = start.start(lm, [(PROMPT, "pld", {}), (PROMPT, "selfdraft", {})])
    stop = threading.Event()
    waiting = start.ticks(stop)
    first = next(waiting)
    assert first.status.startswith("waiting for the start's calibration") and not first.note
    # held after its first preset: running, 1 of 2, with a bar on the page's start line and a time left
    while start.left_s() is None:
        next(waiting)
    assert start.running and "calibrating the demo presets: 1 of 2 (pld)" in start.line()
    assert '<progress class="sg-progress" value="1" max="2">' in start.line() and "s left" in start.line()
    assert not job.done()
    store = ModelStore(loader=lambda spec: lm, check=lambda spec: None)
    request = RunRequest(method="pld", prompt="abcdeabcdeabcd", max_new_tokens=12, sampling=Sampling(), model="t")
    gate.set()
    *_, last = waiting
    assert last.note.startswith("waited ") and job.done() and start.state == warmup.DONE
    assert "calibrated at start: 2 presets in" in start.line()
    profile = costs.profile_for(lm, fastpath.resolve("auto", lm.runner))
    assert any(rows > 1 for rows in profile.calibration.verify)  # pld's verifies of several rows were learnt
    ticks = list(runs.live(store, BaselineCache(), request, threading.Event()))
    assert isinstance(ticks[-1].events[-1], Summary)
    method_start = next(e for t in ticks if t.pane == runs.METHOD for e in t.events)
    assert isinstance(method_start, Start)
    assert method_start.costs["uncalibrated"] is False


def test_a_stop_while_waiting_ends_the_wait(lm):
    gate = threading.Event()
    start = warmup.Warmup(hold=gate.wait)
    start.start(lm, [(PROMPT, "pld", {}), (PROMPT, "pld", {})])
    stop = threading.Event()
    stop.set()
    assert list(start.ticks(stop)) == []
    gate.set()
    assert start.wait(timeout=600) and start.state == warmup.DONE


def test_a_failed_calibration_says_its_predictions_are_not_priced_by_a_finished_one(lm):
    start = warmup.Warmup()
    start.start(lm, [(PROMPT, "no-such-method", {})])
    assert start.wait(timeout=600) and start.state == warmup.FAILED
    line = html.unescape(start.line())
    assert "the start's calibration failed (unknown method 'no-such-method'" in line
    assert "not by a finished calibration" in line
    assert runs.DEVICE.submit(lambda: True).result(timeout=60)  # the device thread serves on


def test_no_calibrate_says_predictions_come_from_the_raw_profile(monkeypatch):
    for value, skipped in (("", False), ("0", False), ("false", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(warmup.NO_CALIBRATE_ENV, value)
        assert warmup.skipped_by_environment() is skipped
    start = warmup.Warmup()
    start.skip("--no-calibrate")
    assert "not calibrated at start (--no-calibrate): predictions come from the raw cost profile" in html.unescape(
        start.line())
    assert list(start.ticks(threading.Event())) == []  # a Run never waits for a calibration that is not coming

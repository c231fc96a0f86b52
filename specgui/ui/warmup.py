"""The start's calibration of the demo presets, in the background, after the page is up.

Why: the calibration (`runs.calibrate`: a few tokens of plain decoding and of each preset's method, so that the first
run is priced as a bench's) takes 14 s or more on two cores, and a first start adds the cost profile's measuring to
it; run before `launch`, the page could not be reached for all of that, on every start. So `app.py` launches first and
`Warmup.start` then decodes the same runs as one job on the device thread (`runs.DEVICE`), where every run decodes:
anything submitted meanwhile (a Run, the API, Compare) queues behind the whole job, never between two of its presets,
and so is priced by the finished calibration. A Run pressed meanwhile waits in `ticks`, which say on the page how far
the calibration is and about how long it has left; the page's start line (`line`) shows the same while it runs.

`--no-calibrate` (or SPECGUI_NO_CALIBRATE=1) skips it for quick restarts (`skip`): the start line then says that
predictions come from the raw profile. SPECGUI_CALIBRATION_HOLD names a file the calibration waits for after its
first preset: a test's way to catch it running, whatever the machine's speed (`held_by_file`).
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from specgui.core import progress
from specgui.core.progress import Phase
from specgui.errors import SpecGUIError
from specgui.model import hosting
from specgui.model.loading import LoadedModel
from specgui.ui import render, runs

WAIT_TICK_S = 1.0  # a waiting Run's status is redrawn this often
HOLD_POLL_S = 0.1
NO_CALIBRATE_ENV = "SPECGUI_NO_CALIBRATE"
HOLD_ENV = "SPECGUI_CALIBRATION_HOLD"
LOG = logging.getLogger("specgui.app")
IDLE, RUNNING, DONE, FAILED, SKIPPED = "idle", "running", "done", "failed", "skipped"


def skipped_by_environment() -> bool:
    """SPECGUI_NO_CALIBRATE set to anything but "", "0" or "false" (a Space's way to say --no-calibrate)."""
    return os.environ.get(NO_CALIBRATE_ENV, "").strip().lower() not in ("", "0", "false")


def held_by_file(path: str) -> Callable[[], None]:
    """A hold that returns once `path` exists (another process's event: a test releases the calibration with it)."""
    def hold() -> None:
        while not os.path.exists(path):
            time.sleep(HOLD_POLL_S)
    return hold


class Warmup:
    """The calibration at start: idle, running, done, failed or skipped, with its phase for the page to show."""

    def __init__(self, hold: Callable[[], None] | None = None) -> None:
        if hold is None and os.environ.get(HOLD_ENV):
            hold = held_by_file(os.environ[HOLD_ENV])
        self._hold = hold
        self.state = IDLE
        self.detail = ""  # done: how long it took; failed: why; skipped: by what
        self._phase: Phase | None = None
        self._finished = threading.Event()
        self._finished.set()  # nothing to wait for until started
        self.job: Future | None = None

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def start(self, lm: LoadedModel, presets: list[tuple[list[int], str, dict[str, Any]]], room: int = 0) -> Future:
        """Submit the calibration of `presets` (prompt ids, method, parameters) to the device thread, the fast path's
        cache made for `room` positions (`runs.calibrate`); return at once."""
        self.state = RUNNING
        self._finished.clear()
        self.job = runs.DEVICE.submit(contextvars.copy_context().run, self._run, lm, presets, room)
        return self.job

    def skip(self, why: str) -> None:
        self.state, self.detail = SKIPPED, why

    def _run(self, lm: LoadedModel, presets: list[tuple[list[int], str, dict[str, Any]]], room: int) -> None:
        began = time.monotonic()
        try:
            runs.calibrate_here(lm, presets, hold=self._hold, room=room, on_phase=self._started)
            self.state, self.detail = DONE, f"{len(presets)} presets in {time.monotonic() - began:.0f} s"
        except Exception as exc:  # the page still serves, priced by the raw profile, and says why
            self.state = FAILED
            self.detail = str(exc) if isinstance(exc, SpecGUIError) else f"{type(exc).__name__}: {exc}"
            LOG.error("the start's calibration failed: %s", self.detail,
                      exc_info=None if isinstance(exc, SpecGUIError) else exc)  # not a SpecGUIError: a bug
        finally:
            self._phase = None
            self._finished.set()

    def _started(self, phase: Phase) -> None:
        self._phase = phase

    def left_s(self) -> float | None:
        """About how long the calibration has left: its presets so far at their mean pace (None: none done yet)."""
        phase = self._phase
        if phase is None or not phase.done or not phase.total:
            return None
        return max(0.0, phase.elapsed_s / phase.done * phase.total - phase.elapsed_s)

    def doing(self) -> str:
        """What the calibration is doing now: its phase and any inside it (the cost profile's measuring)."""
        phases = progress.BOARD.now()
        text = " · ".join(p.line() for p in phases) or "calibrating the demo presets"
        if hosting.on_zero_gpu():
            text += " (inside a ZeroGPU call at start)"
        left = self.left_s()
        return text + (f" · about {left:.0f} s left" if left is not None else "")

    def line(self) -> str:
        """The page's start line: progress with a bar while it runs, else how the presets' predictions are priced."""
        if self.state == RUNNING:
            phase = self._phase
            return render.progress_line(self.doing(), phase.done if phase else 0, phase.total if phase else None)
        if self.state == DONE:
            return render.status(f"calibrated at start: {self.detail}; predictions are priced by what it learnt")
        if self.state == FAILED:
            return render.status(f"the start's calibration failed ({self.detail}): predictions are priced by the "
                                 "cost profile as far as it had learnt, not by a finished calibration", "error")
        if self.state == SKIPPED:
            return render.status(f"not calibrated at start ({self.detail}): predictions come from the raw cost "
                                 "profile until runs have taught it")
        return ""

    def ticks(self, stop: threading.Event) -> Iterator[runs.Tick]:
        """While the calibration runs: a status tick every `WAIT_TICK_S` saying that a Run waits for it and about how
        long, then one whose note says how long it waited (nothing when it is not running)."""
        if self._finished.is_set():
            return
        began = time.monotonic()
        while not self._finished.is_set():
            if stop.is_set():
                return
            left = self.left_s()
            wait = f"about {left:.0f} s" if left is not None else "its time is known after its first preset"
            yield runs.Tick(status=f"waiting for the start's calibration ({wait}): {self.doing()}")
            self._finished.wait(WAIT_TICK_S)
        note = f"waited {time.monotonic() - began:.0f} s for the start's calibration"
        yield runs.Tick(status=note, note=note)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the calibration is over (or `timeout`); whether it is."""
        return self._finished.wait(timeout)

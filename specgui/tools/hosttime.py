"""A step's host time, measured on any device: the step's wall time less the time its programs run.

Why: on a GPU a forward of the embedded model takes about 1.7 ms, and what the host does in a step while the device
waits (drafting, building the inputs, the launch, the read, accepting, the drafter's `observe`, the event and its
text) cost as much again. Counting launches and reads (`specgui.tools.dispatch`) shows the path, not the Python around
each program, which is what the device waits for. So it is timed, on whatever device runs, CI's CPU included:

- `host_ms`: the decode generator's own time for a step, from resuming after the event before to handing out this
  step's (the consumer's time between events is not the loop's), less the time inside its programs
  (`fastpath.Program.__call__`: on a CPU the call, on a GPU the replay's time on the device, from CUDA events).
- `critical_ms`: the part of it a GPU waits for: from the moment the verdict before was readable on the host (the
  verifier's read of the device returned: its walk down the draft, accepting, is host work the device waits for) to
  the launch of the next forward pass's first program, less the programs run between
  (on a CPU their calls: a tree's keeper, which moves the accepted keys, is device work a GPU runs while the host goes
  on; on a GPU only their launches are in the gap). A loop that launches step t+1
  before it finishes step t's host work leaves less of it; a step chained on the device (`fastpath.PlainSteps`,
  `fastpath.LookupSteps`: what it needs left there by the step before, launched before that step's read) waits for no
  read, and leaves none.

Pipelined (`decode.generate`'s default) a step's event goes out after the next step's forward is launched: the
stretch before it holds that next step's draft and launch (and its critical gap), the first step's two forwards, the
last step's none (nothing is launched after it). The same work a step, counted one launch later.

Only the fast path runs its forwards as programs: an eager forward's time would all count as host time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specgui import costs, fastpath
from specgui.core import decode
from specgui.core import launch as launching
from specgui.core import verify as verifier
from specgui.core.events import Step
from specgui.core.runner import Runner
from specgui.model.loading import LoadedModel


@dataclass(frozen=True)
class StepHost:
    """One step's times, ms."""

    wall_ms: float
    program_ms: float
    critical_ms: float

    @property
    def host_ms(self) -> float:
        return self.wall_ms - self.program_ms


@dataclass
class _Recorder:
    """The timeline of one run: program calls, verdict reads, launches, the generator's own stretches."""

    clock: costs.DeviceClock  # program marks: on CUDA events on the stream of the model's device
    programs: list[Any] = field(default_factory=list)  # this event's: (start, end) seconds, or CUDA event pairs
    depth: int = 0  # program calls in progress (one inside another is timed with its caller)
    running: float | None = None  # when the generator last resumed; None while the consumer has the event
    read_at: float | None = None  # when the last verdict became readable, until the next launch
    gap_s: float = 0.0  # generator time from that read to now, while no launch followed it
    gap_programs_s: float = 0.0  # of which inside programs that launched no pass (a CPU's calls: device time)
    critical_s: float = 0.0  # this step's: the gap its first launch closed
    pass_open: bool = False  # a forward pass has started and not yet launched a program
    pending: list[tuple[float, list[Any], float]] = field(default_factory=list)  # steps whose CUDA times are unread

    def _waited(self, now: float) -> float:
        """Generator time since the verdict's read, within the stretch running now."""
        return now - max(self.read_at, self.running) if self.read_at is not None and self.running is not None else 0.0

    def resume(self) -> None:
        self.running = time.perf_counter()

    def pause(self, event: Any) -> None:
        """The generator handed out `event`: a step's record closes (the generator yields once per event)."""
        now = time.perf_counter()
        self.gap_s += self._waited(now)
        if isinstance(event, Step):
            self.pending.append(((now - self.running) * 1000, self.programs, self.critical_s * 1000))
        self.programs, self.critical_s, self.running = [], 0.0, None

    def read(self) -> None:
        self.read_at, self.gap_s, self.gap_programs_s = time.perf_counter(), 0.0, 0.0

    def launch(self, now: float) -> None:
        if self.read_at is not None:
            self.critical_s = self.gap_s + self._waited(now) - self.gap_programs_s
            self.read_at = None

    def finish(self) -> list[StepHost]:
        """Every step's times (on CUDA once the device has run them all)."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.clock.device)
        steps = [StepHost(wall_ms=wall_ms, critical_ms=critical_ms,
                          program_ms=sum(self.clock.ms(a, b) for a, b in spans))
                 for wall_ms, spans, critical_ms in self.pending]
        self.pending = []
        return steps


@contextmanager
def _recording(device: torch.device) -> Iterator[_Recorder]:
    rec = _Recorder(costs.DeviceClock(device))
    cuda = rec.clock.cuda
    call, new_pass, read_together = fastpath.Program.__call__, Runner.new_pass, verifier.read_together

    def timed_call(program: fastpath.Program) -> torch.Tensor:
        if rec.depth:
            return call(program)
        now = time.perf_counter()
        if rec.pass_open:
            rec.pass_open = False
            rec.launch(now)
        start = rec.clock.mark() if cuda else now
        rec.depth += 1
        try:
            return call(program)
        finally:
            rec.depth -= 1
            end = rec.clock.mark()
            if not cuda and rec.read_at is not None:  # a program before the next pass's launch (a tree's keeper):
                rec.gap_programs_s += end - start  # its run is the device's, which on a GPU runs while the host goes on
            rec.programs.append((start, end))

    def opened(runner: Runner, *args: Any, **kwargs: Any) -> Any:
        rec.pass_open = True
        return new_pass(runner, *args, **kwargs)

    def read(parts: list[torch.Tensor]) -> list[float]:
        values = read_together(parts)
        rec.read()
        return values

    def launched(*args: Any, ahead: bool = False, **kwargs: Any) -> Any:
        if ahead:  # what it needs is on the device: this launch waits for no read
            rec.read_at = None
        return launch(*args, ahead=ahead, **kwargs)

    launch = launching.launch
    fastpath.Program.__call__, Runner.new_pass, verifier.read_together, launching.launch = (timed_call, opened, read,
                                                                                             launched)
    try:
        yield rec
    finally:
        fastpath.Program.__call__, Runner.new_pass, verifier.read_together, launching.launch = (call, new_pass,
                                                                                                 read_together, launch)


def measured_run(lm: LoadedModel, prompt_ids: list[int], method: str, **kwargs: Any
                 ) -> tuple[decode.Result, list[StepHost]]:
    """`decode.run` with every step's host times (`decode.generate`'s keyword arguments)."""
    events = []
    with _recording(lm.runner.device) as rec:
        generator = decode.generate(lm, prompt_ids, method, **kwargs)
        while True:
            rec.resume()
            try:
                event = next(generator)
            except StopIteration:
                break
            rec.pause(event)
            events.append(event)
        return decode.Result(events), rec.finish()


def medians(steps: list[StepHost]) -> dict[str, float]:
    """Medians a step: `host_ms` and `host_critical_ms` (and the wall and program times they come from)."""
    if not steps:
        return {}
    return {"host_ms": statistics.median(s.host_ms for s in steps),
            "host_critical_ms": statistics.median(s.critical_ms for s in steps),
            "step_wall_ms": statistics.median(s.wall_ms for s in steps),
            "program_ms": statistics.median(s.program_ms for s in steps)}

"""The decode loop's clock: the time spent inside the generator, phase by phase, and the captures it leaves out.

Only the generator's own time counts: what a consumer does between events (rendering, printing) never counts
against a method, nor does building an event (presentation). On CUDA no phase boundary synchronises: the marks are
events the device records, read once the step's verdict has been read (which they precede on the device's stream).
Host-only work (a drafter's `observe`, the cost model's `learn`) is timed on the host (`Clock.host`).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from specgui import costs, fastpath


class Clock:
    """Time spent inside the generator, phase by phase.

    `resume()` starts a step's first phase, `mark()` ends a phase on the device's clock, `read()` returns the ms of
    the phases marked since (a step's: `take()` its marks after its verdict's read, `spans()` them with its event,
    behind the next launch, where the host's work does not delay a GPU). Pipelined, a step's time runs from the mark
    behind the forward before to the mark behind its own (`resume(since=...)`, `since`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = costs.DeviceClock(device)
        self.total = 0.0
        self.marks = [self.device.mark()]
        self.gaps: list[tuple[float, float]] = []  # (from, to) host seconds the generator was away, off CUDA

    def mark(self, wait: bool = False) -> None:
        """End a phase; with `wait`, on a GPU, wait until the device has reached the mark (the read that follows reads
        host memory a copy of the device's fills, behind it)."""
        self.marks.append(self.device.mark())
        if wait and self.device.cuda:
            self.marks[-1].synchronize()

    def read(self, synced: bool = False) -> list[float]:
        if self.device.cuda and not synced:
            self.marks[-1].synchronize()
        return self.spans(self.take())

    def take(self) -> list[Any]:
        """The phases' marks so far, to be read later (`spans`); counting goes on from the last."""
        marks, self.marks = self.marks, self.marks[-1:]
        return marks

    def spans(self, marks: list[Any]) -> list[float]:
        """The ms of the phases between `marks` (`take`n, the last of them reached on the device), counted in the
        total. Read in the order they were taken: the stretches the generator was away are let go as read past."""
        ms = [self._ms(a, b) for a, b in itertools.pairwise(marks)]
        self.total += sum(ms) / 1000
        return ms

    def since(self, start: Any, end: Any) -> list[float]:
        """A step launched ahead, chained: no draft phase, and the span from the mark behind the forward before it to
        the mark behind its own, counted in the total."""
        return [0.0, *self.spans([start, end])]

    def host(self, started: float, counted: bool = True) -> float:
        """The ms since `started` (`time.perf_counter`), counted in the total unless `counted` is false: host work a
        pipelined run does while the next step's forward runs, which that step's span already holds."""
        ms = (time.perf_counter() - started) * 1000
        self.total += ms / 1000 if counted else 0.0
        return ms

    def discount(self, ms: list[float], capture_ms: float) -> list[float]:
        """Phases' `ms` less `capture_ms` of programs captured within them (taken from the first phases first), and
        the total less it: a capture inside a step (a plan adopted) is a one-time cost no step is priced by."""
        left, out = capture_ms, []
        for phase in ms:
            cut = min(phase, left)
            out.append(phase - cut)
            left -= cut
        self.total -= (capture_ms - left) / 1000
        return out

    def resume(self, since: Any = None) -> None:
        """Start counting again after a pause (the gap was the consumer's time, or what the clock leaves out); or,
        pipelined, `since` a mark behind the forward before (`since`'s span: the host's whole work between them)."""
        if since is None:
            self.marks, self.gaps = [self.device.mark()], []
        else:
            self.marks = [since]

    def away(self, started: float) -> None:
        """The generator was away since `started` (building an event's text, and the consumer's time with it)."""
        if not self.device.cuda:
            self.gaps.append((started, time.perf_counter()))

    def _ms(self, start: Any, end: Any) -> float:
        """The ms between two marks: on a GPU the device's, whatever the host did meanwhile; elsewhere, where the
        marks are the host's own, less the stretches the generator was away (`away`) between them."""
        ms = self.device.ms(start, end)
        if not self.device.cuda:
            ms -= sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.gaps) * 1000
            self.gaps = [(a, b) for a, b in self.gaps if b > end]
        return ms


class Captures:
    """The programs a run captures while its steps are timed (a plan adopted inside a step: SWIFT's search, CLaSp's
    re-optimisation; a program first used): the ms since the last `take`, which the step they fell in leaves out of
    its time (`Clock.discount`), and the cost model out of what it learns."""

    def __init__(self, cache: Any) -> None:
        self.table = cache.programs if isinstance(cache, fastpath.StaticKVCache) else None
        self.at = self.table.capture_s if self.table is not None else 0.0

    def pending(self) -> float:
        """The ms captured since the last `take`, left to be taken."""
        return (self.table.capture_s - self.at) * 1000 if self.table is not None else 0.0

    def take(self) -> float:
        """The ms captured since the last `take`; counting goes on from now."""
        ms = self.pending()
        if self.table is not None:
            self.at = self.table.capture_s
        return ms

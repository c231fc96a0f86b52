"""The readout: what a greedy step reads of the device, in one float32 buffer, so that it reads one span.

Every program owns its output buffer (`program`), but the verify forwards' Tops are the exception: each bucket's
verify `Top` (the plain forward ending in the verify's head) ends where a draft chain's Tops begin (`ring`), so that
a step reading both reads one span of this buffer, no join on the device. Past the verify Tops lies the `tail`, where
a program leaves what the step's verdict read brings along (a draft chain's Tops, Fractal's slot guesses).
"""

from __future__ import annotations

import numpy as np
import torch

from specgui.core.runner import VERIFY_TOP
from specgui.errors import SpecGUIError
from specgui.fastpath.device import Event, Host

CHAIN = 32  # the longest draft chain a chained program keeps (`LayerSkipParams.max_draft`'s bound)
CHAIN_NODES = 16  # the most ids a chained draft keeps a position (SWIFT's widest candidate width)


def width(top: int) -> int:
    """A packed `Top`'s floats a row (`runner.Top`)."""
    return 3 * top + 1


class Readout:
    """The buffer: verify Tops for up to `rows` rows (the largest bucket), then the tail (a draft chain's widest)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.start = rows * width(VERIFY_TOP)  # where the verify Tops end and the tail begins
        self.buffer = torch.zeros(self.start + CHAIN * width(CHAIN_NODES), device=device)
        self.rings: dict[int, torch.Tensor] = {}  # `ring`'s views, by width: a chain the host starts asks each draft

    def verify_top(self, rows: int) -> torch.Tensor:
        """Where a verify forward's `Top` over a bucket of `rows` goes: the rows just before the ring."""
        return self.buffer[self.start - rows * width(VERIFY_TOP) : self.start].view(rows, width(VERIFY_TOP))

    def ring(self, top: int) -> torch.Tensor:
        """A draft chain's Tops of width `top`, a row per chain position [CHAIN, 3 top + 1], at the `tail` (one chain
        is read at a time: a chain of any width starts there)."""
        if top not in self.rings:
            if top > CHAIN_NODES:
                raise SpecGUIError(f"a chained draft keeps at most {CHAIN_NODES} ids a position, got {top}")
            self.rings[top] = self.tail(CHAIN * width(top)).view(CHAIN, width(top))
        return self.rings[top]

    def tail(self, count: int) -> torch.Tensor | None:
        """The first `count` floats after the verify Tops, where a program leaves what the step's verdict read brings
        along (a draft chain's Tops, Fractal's slot guesses; one user a step); None where they do not fit."""
        end = self.start + count
        return self.buffer[self.start : end] if end <= self.buffer.numel() else None


class HostRows:
    """Host rows a chained step's values are copied to right behind its replay, an event recorded behind the copy
    (`passes.PlainSteps`, `lookup.LookupSteps`): reading step t waits for that event, not for the steps launched
    since, which the device runs meanwhile. Pinned on CUDA (`device.Host.host_buffer`); reused in turn: at most two
    steps are in flight."""

    SLOTS = 4

    def __init__(self, floats: int, device: Host) -> None:
        self.device = device
        self.rows = device.host_buffer(np.zeros((self.SLOTS, floats), dtype=np.float32))
        self.slot = 0

    def copy(self, values: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """`values` (float32, at most a row's floats) copied into the next row, as their shape; and the event to wait
        for before reading it (None where the copy has landed)."""
        host = self.rows[self.slot, : values.numel()].view(values.shape)
        self.slot = (self.slot + 1) % self.SLOTS
        return host, self.device.to_host(host, values)

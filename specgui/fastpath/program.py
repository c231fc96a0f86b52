"""What a program is: a function of one static input buffer at one bucket size, returning its own output buffer, and
the table of those made over one cache (`Programs`), which says how they run.

On CUDA a program is captured as a CUDA graph and replayed; elsewhere it is the same function called on the same
buffers. How is the table's `device`'s business (`fastpath.device`): the emulation's device (`fastpath.emulation`)
captures and replays as CUDA does, on a CPU, so that a test there checks the capture too. Which programs a pass runs,
and what is inside them, is `forwards`' business; this module only makes any function a program.

Every program owns its output buffer, allocated before capture outside the graphs' shared memory pool: a replay of a
program captured earlier can reuse the pool's memory of one captured later, never its output (the verify forwards'
Tops are the exception: they go to the cache's `readout`).

The contract that keeps held outputs right: a program's output is valid only until the next program runs.
Whatever a caller keeps across another program call it makes lasting (`Pass.lasting`): observers get
copies, Fractal's splice keeps the exact rows it returns, CLaSp's search keeps its states.
`overwrite_check()` enforces that contract for tests on any device: inside it, every program call fills
every other program's output with NaN, so a held output poisons the tokens instead of passing silently.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from specgui.core.runner import Runner, SkipPlan
from specgui.fastpath import compiled
from specgui.fastpath import device as devices
from specgui.fastpath.device import Staging

PLANS = 8  # skip plans whose forward programs a table keeps (the least recently used goes first)
LOG = logging.getLogger("specgui.fastpath")


def compiles_for(runner: Runner) -> bool:
    """Whether the runner's fast-path programs run compiled kernels, by its `compile_mode` (`compiled.resolve`, or
    the installed device's own rule: `fastpath.device.installed`)."""
    return devices.kind_for(runner.device).compiles(runner.compile_mode, runner.device)


def key(block: nn.Module | None, kind: int, rows: int, *variant: Any) -> tuple[Any, ...]:
    """A program's key in its table: the module it runs (None: the runner's own), its kind, its bucket and more."""
    return (0 if block is None else id(block), kind, rows, *variant)


class Programs:
    """The programs made over one cache, by key (`by_key`), and how they run: on the cache's `device` (captured and
    replayed where it has `graphs`), with compiled kernels (`compiled`, of `shape`) or the modules. Made after the
    cache's buffers, so that `base_bytes` counts what the graphs add to them. One table per cache: captured graphs
    hold the addresses of its buffers."""

    def __init__(self, runner: Runner) -> None:
        self.device = devices.device_for(runner.device, runner.capturable)
        self.graphs = self.device.graphs
        self.compiled = compiles_for(runner)
        self.shape = compiled.shape_of(runner.config, self.device.by_hand)
        self.by_key: dict[tuple[Any, ...], Program] = {}
        self.plans: collections.OrderedDict[SkipPlan, None] = collections.OrderedDict()  # most recently used last
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.base_bytes = self.device.memory()

    def __len__(self) -> int:
        """The programs held (what a start's calibration reports it made)."""
        return len(self.by_key)

    def kernel(self, name: str) -> Callable[..., torch.Tensor]:
        """The compiled function `name` (`compiled.FUNCTIONS`) as this table's programs call it."""
        return self.device.kernel(name)

    def get(self, name: tuple[Any, ...], make: Callable[[], Program]) -> Program:
        """The program of key `name`, made by `make()` on first use."""
        if name not in self.by_key:
            self.by_key[name] = make()
        return self.by_key[name]

    def use(self, plan: SkipPlan) -> None:
        """`plan` used now: past `PLANS` plans, the least recently used one's programs go."""
        self.plans[plan] = None
        self.plans.move_to_end(plan)
        if len(self.plans) > PLANS:
            dropped, _ = self.plans.popitem(last=False)
            self.by_key = {k: p for k, p in self.by_key.items() if dropped not in k}


class Program:
    """A function of one static input buffer, run by a replay of its capture where the table's device captures, by a
    plain call elsewhere. The buffer is the program's own, or (`shared`) the `example` itself: whole-model forwards
    read their ids from a view of the cache's token buffer, where the pass's upload or a chained draft puts them.

    `__call__` returns the output buffer, the same tensor every time. Where the device captures, `prepare` (at
    warm-up, or on first use) has it run the function once (lazy initialisations, allocator), allocate the output
    buffer from that result, then capture the function and a copy into that buffer (`device.Host.capture`); a
    function that cannot be captured stays eager.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor, table: Programs,
                 capturable: bool, read: bool = True, shared: bool = False, output: torch.Tensor | None = None) -> None:
        self.fn = fn
        self.read = read  # whether callers read its output (a bucket's inputs builder writes its inputs instead)
        self.table = table
        self.input = example if shared else torch.zeros_like(example)  # shared: a view of the cache's token buffer
        self.given = output  # where its output goes, if not a buffer of its own (a verify Top: the cache's readout)
        self.output: torch.Tensor | None = output
        self.graphs = table.graphs and capturable
        self.graph: devices.Replay = None
        self.failed = False
        self.ready = False
        self.calls = 0  # (before its first, a captured program's output holds nothing: `StaticKVCache.nonfinite`)
        self.staging: Staging | None = None  # where `send` packs the host's values (made at its first use)

    def prepare(self) -> None:
        """Capture now (where the device captures), or, where the table compiles, run once now so that its functions
        compile here rather than inside a timed step (elsewhere); called once, before the first call. The time goes to
        `capture_s`."""
        self.ready = True
        if not (self.graphs or self.table.compiled):
            return  # nothing to make: the function is called as it is (and no capture is counted)
        started = time.perf_counter()
        device = self.table.device
        device.follow()
        if self.graphs:
            try:
                self.output, self.graph = device.capture(self.fn, self.input, self.output)
            except RuntimeError as exc:
                if not any(p.failed for p in self.table.by_key.values()):
                    LOG.warning("a program could not be captured as a CUDA graph and runs eagerly (others may "
                                "follow, logged once): %s", str(exc).splitlines()[0])
                self.graphs, self.output, self.failed = False, self.given, True
        else:
            self.fn(self.input)
        self.table.capture_s += time.perf_counter() - started

    def send(self, values: Any) -> None:
        """The host's `values` (anything numpy assigns to the input's shape) into the input, as one copy from a
        staging buffer of the program's own (pinned on CUDA, reused in turn: `device.Staging`): a launch's few
        control values without a host array, its tensor and, on CUDA, a pinned block made at every launch (host time
        between a verdict's read and the next launch, where a GPU waits for it)."""
        if self.staging is None:
            dtype = torch.empty(0, dtype=self.input.dtype).numpy().dtype
            self.staging = Staging(np.zeros(self.input.shape, dtype=dtype), self.table.device)
        self.staging.next()[...] = values
        self.staging.send(self.input)

    def __call__(self) -> torch.Tensor:
        if not self.ready:
            self.prepare()
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            self.table.device.follow()
            out = self.fn(self.input)
            if self.output is None:
                self.output = torch.empty_like(out)
            self.output.copy_(out)
        if _checking and self.read:  # an output nobody reads is neither poisoned nor poisons
            for other in _live:  # (outputs in one buffer, the verify Tops, are each other's to overwrite anyway)
                if other is not self and other.output is not None and not _same_buffer(other.output, self.output):
                    other.output.fill_(float("nan"))
            _live[:] = [self]
        return self.output


@contextlib.contextmanager
def overwrite_check() -> Iterator[None]:
    """Inside: every program call fills every other program's output with NaN (any device).

    Stricter than the hardware (which overwrites an output only when the same program runs again), so a
    caller that keeps an output across any other program call gets NaN logits and wrong tokens.
    """
    global _checking
    before, _checking = _checking, True
    try:
        yield
    finally:
        _checking = before
        _live.clear()


_checking = False
_live: list[Program] = []  # outputs not yet poisoned, in check mode


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

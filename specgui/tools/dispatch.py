"""Counting what a decode costs the host on a GPU, on any device: programs per forward pass, host reads per token.

Why: on a GPU a small model's step is bound by launches and round trips, not arithmetic. A pass that runs as one
CUDA graph replay costs about one replay whatever it skips or records; a pass that replays a program per sub-layer
costs dozens; and every read of a device value on the host (`item`, `tolist`, a tensor's truth value, indexing by a
Python list, which uploads it) stalls the host until the device catches up. Both are properties of the code path,
not of the device, so they are counted here on whatever device runs (CI's CPU included), where a timing could
only be taken on a GPU.

`counting` is a context manager: inside it, every `Runner.new_pass` starts a pass, every program call is charged to
the pass that makes it (`StaticPass.call`: a spliced forward's pieces to the target's pass, its compressed passes to
their own), a torch function mode counts the host reads and a dispatch mode the operations on the model's device
outside program calls (eager work between programs: on a GPU each a launch of its own). A step clock's read counts
as one synchronisation (on CUDA it waits for the step's last event; on a CPU it waits for nothing, and is counted all
the same, since the count is of the path), unless it follows the step's own read of the device (`synced`), which its
last mark precedes. A step's forward launched while no other step's is in flight (every verdict read) is counted as
`waited`: on a GPU the device sat idle through the host's work between that read and the launch; plain steps chained
on the device (`fastpath.PlainSteps`) wait only where a chain starts. What runs inside a program's function is not
counted as a host read: on a GPU it is captured, and a read there would fail the capture; nor, for the same reason,
as eager work.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"})


def _by_list(index: Any) -> bool:
    """Whether a `__getitem__` index holds a Python list (torch uploads it to the tensor's device first)."""
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


class _HostReads(TorchFunctionMode):
    """Counts the torch calls that read a tensor's value on the host, by name."""

    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self.counts = counts
        self.paused = 0  # inside a program's function

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if not self.paused and (name in READS or (name == "__getitem__" and len(args) > 1 and _by_list(args[1]))):
            self.counts["list index" if name == "__getitem__" else name] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Counts:
    """What one counted stretch of decoding did: programs per pass, host reads by kind, generated tokens."""

    programs: list[int] = field(default_factory=list)  # per pass, in order
    reads: collections.Counter[str] = field(default_factory=collections.Counter)
    eager: collections.Counter[str] = field(default_factory=collections.Counter)  # device operations between programs
    tokens: int = 0
    steps: int = 0  # decoding steps (the caller adds a run's)
    waited: int = 0  # step forwards launched with no step's forward in flight: after the host read every verdict
    in_flight: int = 0  # step forwards launched and not yet read

    def summary(self) -> dict[str, Any]:
        passes = len(self.programs)
        ops = sum(self.eager.values())
        return {"passes": passes, "tokens": self.tokens, "steps": self.steps,
                "eager_ops_per_step": ops / self.steps if self.steps else 0.0,
                "eager_ops": dict(self.eager.most_common()),
                "programs_per_pass_max": max(self.programs, default=0),
                "programs_per_pass_mean": sum(self.programs) / passes if passes else 0.0,
                "syncs_per_token": sum(self.reads.values()) / self.tokens if self.tokens else 0.0,
                "waited_launches_per_step": self.waited / self.steps if self.steps else 0.0,
                "reads": dict(self.reads)}


class EagerOps(TorchDispatchMode):
    """Counts the operations that run on `device` outside program calls, by name: views (which launch nothing) and
    the empty allocations left out. On a GPU each is a launch between two programs; on a CPU the host's own tensor
    work (building a step's positions, say) counts too, so there a count is an upper bound of a GPU's."""

    FREE = frozenset({"empty", "empty_strided", "_to_copy", "lift_fresh", "detach", "alias"})

    def __init__(self, counts: collections.Counter[str], device: Callable[[], torch.device | None],
                 paused: Callable[[], int]) -> None:
        super().__init__()
        self.counts, self.device, self.paused = counts, device, paused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        device = self.device()
        if not self.paused() and not func.is_view and name not in self.FREE and device is not None:
            tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]  # lists too (cat)
            if any(t.device == device for t in tensors):
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting() -> Iterator[Counts]:
    """Count passes, programs, host reads and device operations between programs of everything run inside (see the
    module docstring)."""
    from specgui import fastpath
    from specgui.core import clock, launch, step
    from specgui.core.runner import Runner

    counts = Counts()
    mode = _HostReads(counts.reads)
    devices: list[torch.device] = []  # the device of the last runner that started a pass
    eager = EagerOps(counts.eager, lambda: devices[-1] if devices else None, lambda: mode.paused)
    new_pass, call, read, run = Runner.new_pass, fastpath.StaticPass.call, clock.Clock.read, fastpath.Program.__call__
    passes: dict[int, int] = {}  # id of a pass -> its index in `counts.programs`

    def counted_pass(self: Runner, *args: Any, **kwargs: Any) -> Any:
        devices[:] = [self.device]
        made = new_pass(self, *args, **kwargs)
        passes[id(made)] = len(counts.programs)
        counts.programs.append(0)
        return made

    def counted_call(self: fastpath.StaticPass, program: fastpath.Program) -> torch.Tensor:
        if id(self) in passes:
            counts.programs[passes[id(self)]] += 1
        return call(self, program)

    def paused_run(self: fastpath.Program) -> torch.Tensor:  # any program: a pass's, or its inputs' builder
        mode.paused += 1
        try:
            return run(self)
        finally:
            mode.paused -= 1

    def counted_read(self: Any, synced: bool = False) -> list[float]:
        if not synced:  # a read after the step's own read of the device waits for nothing
            counts.reads["step clock"] += 1
        return read(self, synced)

    def counted_launch(*args: Any, **kwargs: Any) -> Any:
        counts.waited += counts.in_flight == 0
        counts.in_flight += 1
        return launched(*args, **kwargs)

    def counted_verify(*args: Any, **kwargs: Any) -> Any:
        counts.in_flight = max(0, counts.in_flight - 1)  # the prompt forward's read has no step in flight
        return verify(*args, **kwargs)

    launched, verify = launch.launch, step.verify
    Runner.new_pass, fastpath.StaticPass.call, clock.Clock.read = counted_pass, counted_call, counted_read
    fastpath.Program.__call__ = paused_run
    launch.launch, step.verify = counted_launch, counted_verify
    try:
        with mode, eager:
            yield counts
    finally:
        Runner.new_pass, fastpath.StaticPass.call, clock.Clock.read = new_pass, call, read
        fastpath.Program.__call__ = run
        launch.launch, step.verify = launched, verify

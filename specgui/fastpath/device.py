"""The device a cache's programs run on, as the fast path sees it: how a program is captured and replayed, how values
cross between host and device, and the events that say when a copy has landed.

Why a seam of its own: what a GPU does that a CPU does not (a program captured once, then replayed on its buffers as
they are then; copies that land behind the host's back, in stream order, seen by the host only after their event) is
where the fast path's GPU-only defects hide, and a CPU run shows none of it unless a device imitates it. So every such
act goes through one object per cache (`Programs.device`), made by `device_for`:

  * `Host`: a CPU (or any device without graphs): a program is its function, called; a copy lands as it is made.
  * `Cuda`: programs captured as CUDA graphs (a warm-up run on a side stream, then the capture, in one memory pool)
    and replayed; host buffers pinned; copies non-blocking with an event behind each, recorded on the stream of the
    model's own device (a model on cuda:1 orders its copies on cuda:1, whatever the current device is).
  * `fastpath.emulation.Emulated`: CUDA's semantics computed on a CPU, installed by `fastpath.emulation.emulated()`
    (the tests' matrix, `python -m specgui smoke --emulate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from specgui.fastpath import compiled

Replay = Any  # what `capture` returns to replay a program: a `torch.cuda.CUDAGraph`, or the emulation's


class Event(Protocol):
    """Behind a copy: `synchronize` waits until it has landed, `query` says whether it has, without waiting."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class Host:
    """A device that runs what it is given when it is given it: a CPU, or a GPU whose model graphs cannot hold (then
    `Cuda` with `graphs` off). Programs are their functions, called; copies land as they are made (no events)."""

    graphs = False  # whether programs are captured and replayed
    by_hand = False  # attention written out as products and a softmax (`compiled.Shape.by_hand`): CUDA's form

    def __init__(self, device: torch.device, capturable: bool = False) -> None:
        self.device = device

    @staticmethod
    def compiles(mode: str, device: torch.device) -> bool:
        """Whether programs on `device` run compiled kernels under compile `mode` (`compiled.resolve`)."""
        return compiled.resolve(mode, device)

    def kernel(self, name: str) -> Callable[..., torch.Tensor]:
        """The compiled form of `compiled.FUNCTIONS[name]` that programs call."""
        return compiled.compiled(name)

    def host_buffer(self, array: np.ndarray) -> torch.Tensor:
        """Host memory (a copy of `array`) the device copies from or into behind the host: pinned on CUDA."""
        return torch.from_numpy(array.copy())

    def to_device(self, target: torch.Tensor, source: torch.Tensor) -> Event | None:
        """Copy a host buffer into a device tensor; the event behind the copy (None where it has landed)."""
        target.copy_(source)
        return None

    def to_host(self, target: torch.Tensor, source: torch.Tensor) -> Event | None:
        """Copy device values into a host buffer; the event to wait for before reading it (None where it has landed)."""
        target.copy_(source)
        return None

    def follow(self) -> None:
        """Work launched next follows every copy sent before it (stream order): nothing to do where copies land as
        they are made."""

    def capture(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, output: torch.Tensor | None
                ) -> tuple[torch.Tensor, Replay]:
        """`fn` on its input `x` captured: the output buffer (`output`, or one made from a warm-up run's result) and
        what replays the capture (`output.copy_(fn(x))` on the buffers as they are then). Raises RuntimeError where
        `fn` cannot be captured (its program then runs eagerly)."""
        raise RuntimeError("this device captures nothing")

    def synchronize(self) -> None:
        """Wait until the device has run everything launched."""

    def memory(self) -> int:
        """Device memory allocated now (what the captures add to the cache's buffers is read as a difference)."""
        return 0


class Cuda(Host):
    """A CUDA GPU: captured programs (where `graphs`: the model can be held by graphs), pinned host buffers, copies
    non-blocking with an event behind each, on the stream of the model's device."""

    by_hand = True

    def __init__(self, device: torch.device, capturable: bool = False) -> None:
        super().__init__(device)
        self.graphs = capturable
        self.pool = torch.cuda.graph_pool_handle() if capturable else None
        self.side = torch.cuda.Stream(device) if capturable else None  # every capture's warm-up runs here

    def host_buffer(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array.copy()).pin_memory()

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_device(self, target: torch.Tensor, source: torch.Tensor) -> Event:
        with torch.cuda.device(self.device):
            target.copy_(source, non_blocking=True)
            return self._event()

    def to_host(self, target: torch.Tensor, source: torch.Tensor) -> Event:
        with torch.cuda.device(self.device):
            target.copy_(source, non_blocking=True)
            return self._event()

    def capture(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, output: torch.Tensor | None
                ) -> tuple[torch.Tensor, Replay]:
        with torch.cuda.device(self.device):
            current, side = torch.cuda.current_stream(self.device), self.side
            side.wait_stream(current)
            with torch.cuda.stream(side):
                first = fn(x)
                if output is None:
                    output = torch.empty_like(first)  # outside the shared pool: no replay reuses it
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                output.copy_(fn(x))
        return output, graph

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory(self) -> int:
        return torch.cuda.memory_allocated(self.device)


_installed: list[type[Host]] = []  # the kind of device `installed` puts in place of the machine's, innermost last


def kind_for(device: torch.device) -> type[Host]:
    """The kind of device a cache on `device` runs its programs on: the one `installed`, else the machine's."""
    if _installed:
        return _installed[-1]
    return Cuda if device.type == "cuda" else Host


def device_for(device: torch.device, capturable: bool) -> Host:
    """The device a cache on `device` runs its programs on (`capturable`: whether graphs can hold the model)."""
    return kind_for(device)(device, capturable)


@contextlib.contextmanager
def installed(kind: type[Host]) -> Iterator[None]:
    """Inside, caches made anew run their programs on devices of `kind` (the emulation's), whatever the machine."""
    _installed.append(kind)
    try:
        yield
    finally:
        _installed.remove(kind)


class Staging:
    """Host buffers an upload is packed into in place and sent from, reused in turn: pinned on CUDA, where the copy
    runs behind the host. What `kvcache.upload` makes at every call (a host array, its tensor, on CUDA a pinned block),
    made once: a pass's launch is host time a GPU waits for.

    A buffer whose copy has not landed yet (the device is that many uploads behind, as when a bucket is loaded several
    times within one step: Fractal's uncompiled splice, CLaSp's row search) is passed over, and where every buffer is
    in flight one more is made, so that the host never waits for the device mid-step; past `MOST` buffers it waits
    for the oldest (`waits` counts those)."""

    SLOTS = 2  # buffers made at first: one in flight while the next is packed
    MOST = 8

    def __init__(self, initial: np.ndarray, device: Host) -> None:
        self.device, self.initial = device, initial.copy()
        self.buffers: list[torch.Tensor] = []
        self.arrays: list[np.ndarray] = []  # the same memory, written on the host
        self.sent: list[Event | None] = []
        for _ in range(self.SLOTS):
            self._grow()
        self.slot = 0
        self.waits = 0

    def _grow(self) -> None:
        self.buffers.append(self.device.host_buffer(self.initial))
        self.arrays.append(self.buffers[-1].numpy())
        self.sent.append(None)

    def next(self) -> np.ndarray:
        """The buffer to pack the next upload into, as it was last packed (its own since: `slot` says which; a buffer
        made anew holds the initial values)."""
        for _ in range(len(self.buffers)):
            sent = self.sent[self.slot]
            if sent is None or sent.query():
                return self.arrays[self.slot]
            self.slot = (self.slot + 1) % len(self.buffers)
        if len(self.buffers) < self.MOST:
            self._grow()
            self.slot = len(self.buffers) - 1
            return self.arrays[self.slot]
        self.waits += 1
        self.sent[self.slot].synchronize()
        return self.arrays[self.slot]

    def send(self, target: torch.Tensor) -> None:
        """`target` gets the buffer `next` gave, as one copy (on CUDA non-blocking); the next buffer's turn comes."""
        self.sent[self.slot] = self.device.to_device(target, self.buffers[self.slot])
        self.slot = (self.slot + 1) % len(self.buffers)

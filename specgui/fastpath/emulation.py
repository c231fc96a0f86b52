"""CUDA's semantics on a CPU: what the fast path relies on a GPU doing, imitated where a CPU computes, for the tests
and `python -m specgui smoke --emulate`.

Why: on a CPU a program is its function called and a copy lands as it is made, so a whole class of GPU-only defects
(a capture's warm-up run leaving state behind, a replay running work frozen at its capture, inductor's index wrap,
the attention form only CUDA uses, a host row read before its copy landed) passes every CPU test and shows first on a
GPU. Inside `emulated()` every cache made anew runs its programs on an `Emulated` device, which computes on the CPU
and behaves as CUDA does:

  * capture: the function runs once with its side effects (the side stream's warm-up), then once recorded with its
    writes undone (a capture runs nothing); a replay runs the function again on the buffers as they are then, and
    fails where its work is not the captured work (another operation, a tensor at another address, another Python
    constant: a graph replays what it captured, whatever the Python code would do now). A program that reads a
    device value on the host, or makes a tensor from host values, fails as a capture would.
  * compiled functions: inductor's indexing (a negative index wraps, one past the end asserts) and CUDA's attention
    form (`compiled.Shape.by_hand`), without compiling anything.
  * asynchrony: a copy to the host lands only when its event is waited for (a read that does not wait sees the old
    values); a copy to the device reads its host buffer when the device gets to it (the next program); an event
    completes only once the host has waited for it or for something launched after it (a read of the device,
    `kvcache.read_together`, and a timing's synchronisation wait for everything; so does a capture, as
    `torch.cuda.graph` synchronises first), so the device runs behind by whatever was launched since.
  * NaN: every replay's output is scanned for NaN and Inf (`StaticKVCache.nonfinite` scans a cache after a run).
What it cannot show: real stream timing (how far behind a GPU really runs), the graphs' memory pool reusing one
graph's intermediates in another (`program.overwrite_check` covers that contract), and CUDA kernels' own rounding.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from specgui.core import kvcache
from specgui.fastpath import compiled
from specgui.fastpath import device as devices

aten = torch.ops.aten

# operations a captured program cannot hold: a host read of a device value, a tensor made from host values
_HOST_VALUES = frozenset({aten.item.default, aten._local_scalar_dense.default, aten.is_nonzero.default,
                          aten.equal.default, aten.lift_fresh.default, aten.lift_fresh_copy.default})


class EmulationError(AssertionError):
    """A defect the emulation found. Not a RuntimeError: `Program.prepare` takes those for a capture CUDA refused, and
    runs the program eagerly."""


class _Event:
    """An emulated CUDA event behind the `seq`-th thing launched on `device`."""

    def __init__(self, device: Emulated, seq: int) -> None:
        self.device, self.seq = device, seq

    def synchronize(self) -> None:
        self.device.wait(self.seq)

    def query(self) -> bool:
        return self.device.done >= self.seq


def _named(made: dict[int, tuple[int, int]], x: Any) -> Any:
    """How a recorded operation names one of its arguments: a tensor made in the same run by what made it, any other
    by where a graph would read it (its address) and its shape; a float exactly; a list item by item; anything else
    as it is."""
    if isinstance(x, torch.Tensor):
        return made.get(id(x)) or (x.data_ptr(), x.shape, x.stride(), x.dtype)
    if isinstance(x, list | tuple):
        return tuple(_named(made, y) for y in x)
    if isinstance(x, float):
        return x.hex()
    return x


class _Recorder(TorchDispatchMode):
    """A program's work as the operations it dispatches: recorded at its capture (`dry`: the writes undone after), or
    checked against that record at a replay. Index operations inside an emulated kernel wrap as inductor's
    (`_inductor_args`), named as the kernel's code gave them."""

    def __init__(self, name: str, captured: list[Any] | None = None, dry: bool = False) -> None:
        super().__init__()
        self.name, self.captured, self.dry = name, captured, dry
        self.ops: list[Any] = []
        self.made: dict[int, tuple[int, int]] = {}
        self.kept: list[Any] = []  # what `made` names, alive for the run (an id is not reused meanwhile)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage -> (its whole, a copy before)

    def __enter__(self) -> _Recorder:
        _recorders.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _recorders.pop()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_VALUES:
            what = "makes a tensor from host values" if "lift" in str(func) else "reads a device value on the host"
            raise EmulationError(f"{self.name} {what} ({func}): a CUDA graph cannot capture it")
        made = self.made
        op = (func, _named(made, args), _named(made, tuple(kwargs.items())) if kwargs else ())
        index = len(self.ops)
        if self.captured is not None and (index >= len(self.captured) or self.captured[index] != op):
            was = self.captured[index][0] if index < len(self.captured) else "nothing"
            raise EmulationError(f"{self.name}: a replay's operation {index} ({func}) is not the captured one ({was}, "
                                 f"or its arguments differ): a CUDA graph would replay the captured work")
        self.ops.append(op)
        if self.dry:
            self._save_written(func, args, kwargs)
        if _kernels:
            args = _inductor_args(func, args)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            made[id(out)] = (index, 0)
            self.kept.append(out)
        elif isinstance(out, list | tuple):
            for j, t in enumerate(out):
                made[id(t)] = (index, j)
            self.kept.append(out)
        return out

    def _save_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Before an operation of the recorded (dry) run writes a tensor: its whole storage as it is, once."""
        schema = func._schema.arguments
        named = {a.name: a for a in schema}
        pairs = list(zip(schema, args)) + [(named[k], v) for k, v in kwargs.items() if k in named]
        for argument, value in pairs:
            if isinstance(value, torch.Tensor) and argument.alias_info is not None and argument.alias_info.is_write:
                storage = value.untyped_storage()
                if storage.data_ptr() not in self.saved and storage.nbytes():
                    whole = value.as_strided((storage.nbytes() // value.element_size(),), (1,), 0)
                    self.saved[storage.data_ptr()] = whole, whole.clone()

    def undo(self) -> None:
        """Every storage the recorded run wrote, back as it was before."""
        for whole, before in self.saved.values():
            whole.copy_(before)

    def check(self) -> None:
        """A replay ran the whole captured work, not a part of it."""
        if self.captured is not None and len(self.ops) != len(self.captured):
            raise EmulationError(f"{self.name}: a replay ran {len(self.ops)} operations, its capture "
                                 f"{len(self.captured)}: a CUDA graph would replay the captured work")


class _Graph:
    """A program captured by an `Emulated` device: `replay` runs its function again under a recorder that checks it
    against the capture, after the copies sent before it, then scans its output."""

    def __init__(self, device: Emulated, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 output: torch.Tensor, captured: list[Any], name: str) -> None:
        self.device, self.fn, self.x, self.output, self.captured, self.name = device, fn, x, output, captured, name
        self.replays = 0

    def replay(self) -> None:
        self.device.follow()
        recorder = _Recorder(self.name, self.captured)
        with recorder:
            self.output.copy_(self.fn(self.x))
        recorder.check()
        self.replays += 1
        if self.output.is_floating_point() and not torch.isfinite(self.output).all():
            raise EmulationError(f"{self.name}'s output holds NaN or Inf after replay {self.replays}")


# operation -> (position of its dim, position of its index) (None: its indices, each a dim's)
_INDEXED: dict[Any, tuple[int | None, int]] = {
    aten.index_copy_.default: (1, 2), aten.index_copy.default: (1, 2), aten.index_select.default: (1, 2),
    aten.index_put_.default: (None, 1), aten.index_put.default: (None, 1), aten.index.Tensor: (None, 1)}
_kernels = 0  # emulated compiled functions running now
_recorders: list[_Recorder] = []  # recorders active now, innermost last


def _inductor_args(func: Any, args: tuple) -> tuple:
    """`args` of an index operation as inductor's kernels take them: a negative index wrapped (Python's rule); one out
    of range even then is a device-side assert."""
    where = _INDEXED.get(func)
    if where is None:
        return args
    args = list(args)
    dim, at = where
    if dim is None:
        args[at] = [None if index is None else _wrapped(index, args[0].shape[d], func)
                    for d, index in enumerate(args[at])]
    else:
        args[at] = _wrapped(args[at], args[0].shape[args[dim]], func)
    return tuple(args)


def _wrapped(index: torch.Tensor, size: int, func: Any) -> torch.Tensor:
    if index.dtype == torch.bool:
        return index
    with _disable_current_modes():  # (the kernel's own arithmetic, and the device's assert: nothing recorded or read)
        wrapped = torch.where(index < 0, index + size, index)
        outside = bool(((wrapped < 0) | (wrapped >= size)).any())
    if outside:
        raise EmulationError(f"{func}: index out of range for a dimension of {size} (a device-side assert)")
    return wrapped


class _InductorIndexing(TorchDispatchMode):
    """Index operations as inductor's kernels do them, where no recorder runs (which does the same itself)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*_inductor_args(func, args), **(kwargs or {}))


def _as_inductor(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`fn` as an emulated compiled function: its index operations wrap as inductor's (`_inductor_args`)."""
    global _kernels
    if not _recorders:
        with _InductorIndexing():
            return fn(*args)
    _kernels += 1
    try:
        return fn(*args)
    finally:
        _kernels -= 1


class Emulated(devices.Host):
    """A device that computes on the CPU and behaves as CUDA does (the module's docstring says how far)."""

    by_hand = True

    def __init__(self, device: torch.device, capturable: bool = False) -> None:
        super().__init__(device, capturable)
        self.graphs = capturable
        self.launched = 0  # copies launched, in stream order
        self.done = 0  # the host has waited for everything up to here
        self.sending: list[tuple[torch.Tensor, torch.Tensor]] = []  # copies to the device the device has not run
        self.landing: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # copies to the host not landed yet
        self.captures = 0
        self.host: dict[int, torch.Tensor] = {}  # its host buffers by storage (held: no address is reused)
        _made.append(self)

    def host_buffer(self, array: Any) -> torch.Tensor:
        buffer = super().host_buffer(array)
        self.host[buffer.untyped_storage().data_ptr()] = buffer
        return buffer

    @staticmethod
    def compiles(mode: str, device: torch.device) -> bool:
        """Compiled programs wherever asked for: their kernels are emulated, nothing is compiled."""
        return compiled.checked(mode) != "off"

    def kernel(self, name: str) -> Callable[..., torch.Tensor]:
        return functools.partial(_as_inductor, compiled.FUNCTIONS[name])

    def _event(self) -> _Event:
        self.launched += 1
        return _Event(self, self.launched)

    def to_device(self, target: torch.Tensor, source: torch.Tensor) -> _Event:
        self.sending.append((target, source))
        return self._event()

    def to_host(self, target: torch.Tensor, source: torch.Tensor) -> _Event:
        self.follow()
        event = self._event()
        self.landing.append((event.seq, target, source.clone()))
        return event

    def follow(self) -> None:
        for target, source in self.sending:
            target.copy_(source)
        self.sending.clear()

    def wait(self, seq: int) -> None:
        """The host waits for the `seq`-th launch: the copies to the host up to it land, in order."""
        self.follow()
        while self.landing and self.landing[0][0] <= seq:
            _, target, values = self.landing.pop(0)
            target.copy_(values)
        self.done = max(self.done, seq)

    def synchronize(self) -> None:
        self.wait(self.launched)

    def capture(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, output: torch.Tensor | None
                ) -> tuple[torch.Tensor, _Graph]:
        self.synchronize()  # (as `torch.cuda.graph` does before a capture)
        self.captures += 1
        name = f"program {getattr(fn, '__qualname__', fn)} (capture {self.captures})"
        with _Recorder(name):  # the warm-up: effects and all, and no read of the device inside
            first = fn(x)
        if output is None:
            output = torch.full_like(first, float("nan")) if first.is_floating_point() else torch.empty_like(first)
        recorder = _Recorder(name, dry=True)
        try:
            with recorder:
                output.copy_(fn(x))
        finally:
            recorder.undo()
        return output, _Graph(self, fn, x, output, recorder.ops, name)


_made: list[Emulated] = []  # the devices made inside `emulated()` (their waits at every read of the device)


def _host_waits(reading: list[torch.Tensor] | None) -> None:
    """The host waits for the devices: to read `reading` (where it is all host buffers, nothing: a read of a pinned
    row waits for no device), or for everything (None)."""
    if reading is not None and all(_host_memory(t) for t in reading):
        return
    for made in _made:
        made.synchronize()


def _host_memory(tensor: torch.Tensor) -> bool:
    return any(tensor.untyped_storage().data_ptr() in made.host for made in _made)


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """Inside, caches made anew run on `Emulated` devices (a runner's cache of another device is made anew at its
    next run: `fastpath.cache_for`), and a read of the device waits for everything launched."""
    kvcache.DEVICE_WAITS.append(_host_waits)
    try:
        with devices.installed(Emulated):
            yield
    finally:
        kvcache.DEVICE_WAITS.remove(_host_waits)
        _made.clear()

"""The KV cache: preallocated per-layer buffers with a length per layer.

Speculative methods leave caches ragged: a draft that skipped the attention of layer 5 wrote no key for
layer 5, a tree verify forward wrote keys for branches that lost. transformers' `DynamicCache.crop(n)`
removes the same *count* from every layer, which is wrong for ragged caches, and its `update`
re-concatenates the whole cache on every token. Here each layer has a buffer and a length: `crop`
sets lengths (absolute), `keep` compacts the accepted positions, `update` writes in place.
`view(n)` lets a pass read the first n positions without growing the cache (CLaSp's batched DP,
Fractal's compressed sub-passes).

`Cache` is what a forward needs of a cache; `KVCache` and `FrozenView` implement it here, and the fast
path's fixed-capacity cache (`specgui.fastpath`) implements it for static shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

MIN_CAPACITY = 256


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without stalling the host: on CUDA through pinned memory, copied
    asynchronously (a copy from pageable memory blocks until the device has taken it). torch's pinned
    allocator keeps the pinned block until the copy has run, so the caller may drop it at once."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def upload(target: torch.Tensor, values: np.ndarray | torch.Tensor) -> None:
    """Write `values` into the device tensor `target` (its shape) as one copy: host values (numpy, built on the host
    where the step is timed) on CUDA non-blocking from pinned memory (`to_device`); device values as they are. On a
    GPU the copy is a launch, and `specgui.tools.dispatch` counts it as one on any device."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if host.device.type == "cpu" and target.device.type == "cuda":
        host = host.pin_memory()
    target.copy_(host, non_blocking=True)


# what the host's waits for the device (a read of its values, a timing's synchronisation: `wait_for_devices`) also
# wait for where a device runs behind the host without CUDA's own synchronisation (the emulation's:
# `fastpath.emulation`); on CUDA the read itself waits for everything launched before it
DEVICE_WAITS: list[Callable[[list[torch.Tensor] | None], None]] = []


def wait_for_devices(reading: list[torch.Tensor] | None = None) -> None:
    """The host waits here for what `DEVICE_WAITS` holds (nothing, but inside the emulation): to read `reading` (a
    read of host memory, a pinned row, waits for nothing), or for everything launched (None)."""
    for wait in DEVICE_WAITS:
        wait(reading)


def read_together(parts: list[torch.Tensor]) -> list[float]:
    """The values of `parts` (on one device) flattened, in one read of the device: one tensor read as it is; several
    that lie in one buffer (the fast path's `readout`: a verify's Top and a draft chain's or Fractal's slot guesses)
    as the span that covers them, the gaps dropped on the host; others joined first (one device operation, as
    float32)."""
    wait_for_devices(parts)
    if len(parts) == 1:
        return parts[0].reshape(-1).tolist()
    first = parts[0]
    if all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
           and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts):
        lo = min(p.storage_offset() for p in parts)
        span = first.as_strided((max(p.storage_offset() + p.numel() for p in parts) - lo,), (1,), lo).tolist()
        return [v for p in parts for v in span[p.storage_offset() - lo : p.storage_offset() - lo + p.numel()]]
    device = first.device
    return torch.cat([part.reshape(-1).to(device, torch.float32) for part in parts]).tolist()


@dataclass(frozen=True)
class Layout:
    """Where one forward's keys sit in one layer's key tensor, as attention reads it.

    New tokens see every position in [0, prefix); their own keys are stored at [offset, offset + rows);
    attention reads `columns` key positions in all, any others masked. A growing cache reads exactly
    prefix + rows columns with offset = prefix; a fixed-capacity one reads the whole buffer.
    """

    prefix: int
    offset: int
    columns: int


class Cache(Protocol):
    """What a forward calls on a cache: its attention modules `update` and `get_seq_length` (transformers'
    interface, the part used), the runner its `layout` for masks, drafters `view` for read-only passes. A cache that
    keeps its keys in buffers may also offer `slot` (`KVCache.slot`): where a layer run as one C call
    (`specgui.cpu.layers`) writes its new keys and values itself."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions held for layer `layer_idx`."""
        ...

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Take a forward's new keys/values [1, heads, T, dim] for a layer; return what attention reads."""
        ...

    def layout(self, layer: int, rows: int) -> Layout:
        """Where a forward of `rows` new tokens puts its keys in `layer` and what it reads there."""
        ...

    def view(self, length: int, scratch: bool = False) -> Cache:
        """A read-only window on the first `length` positions: a pass over it sees them and keeps nothing.
        `scratch`: the caller declares the positions held past `length` dead (a pass may overwrite them)."""
        ...


class KVCache:
    """Keys and values [1, heads, capacity, head_dim] per layer, valid up to `lengths[layer]`."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.lengths: list[int] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx] if layer_idx < len(self.lengths) else 0

    def layout(self, layer: int, rows: int) -> Layout:
        n = self.get_seq_length(layer)
        return Layout(n, n, n + rows)

    def view(self, length: int, scratch: bool = False) -> FrozenView:
        return FrozenView(self, length, scratch)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values [1, heads, T, dim] to one layer; return that layer's valid prefix."""
        while len(self.lengths) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
            self.lengths.append(0)
        if self.keys[layer_idx] is None:
            self._grow(layer_idx, keys.shape[-2], keys, values)
        return _write(self.slot(layer_idx, keys.shape[-2]), keys, values)

    def slot(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Room in place for a forward's `rows` new keys and values in `layer`: (keys buffer, values buffer, start),
        buffers [1, heads, capacity, dim] whose positions [start, start + rows) the forward fills and whose first
        start + rows its attention reads; the layer holds start + rows positions from now on. None before the layer
        has a buffer (`update` makes the first, shaped by the keys it is given)."""
        if layer >= len(self.lengths) or self.keys[layer] is None:
            return None
        start = self.lengths[layer]
        if start + rows > self.keys[layer].shape[-2]:
            self._grow(layer, start + rows)
        self.lengths[layer] = start + rows
        return self.keys[layer], self.values[layer], start

    def _grow(self, layer: int, needed: int, keys: torch.Tensor | None = None,
              values: torch.Tensor | None = None) -> None:
        """Room for `needed` positions in `layer`, shaped like its buffer (or, before it has one, like `keys`)."""
        old_k, old_v = self.keys[layer], self.values[layer]
        like_k, like_v = (keys, values) if old_k is None else (old_k, old_v)
        capacity = max(MIN_CAPACITY, needed, 2 * (old_k.shape[-2] if old_k is not None else 0))
        new_k = like_k.new_empty((*like_k.shape[:-2], capacity, like_k.shape[-1]))
        new_v = like_v.new_empty((*like_v.shape[:-2], capacity, like_v.shape[-1]))
        n = self.lengths[layer]
        if old_k is not None and n:
            new_k[..., :n, :] = old_k[..., :n, :]
            new_v[..., :n, :] = old_v[..., :n, :]
        self.keys[layer], self.values[layer] = new_k, new_v

    def crop(self, length: int) -> None:
        """Cut every layer to at most `length` positions (an absolute length, unlike `DynamicCache.crop`)."""
        lengths = self.lengths
        if min(lengths, default=length) >= length:  # every step crops after its read, where a GPU waits: one list
            self.lengths = [length] * len(lengths)
        else:
            self.lengths = [min(n, length) for n in lengths]

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep positions `[0, start)` plus `start + o` for each offset, compacted in that order.

        After a forward that carried candidates or branches, only the accepted tokens' keys and values
        stay, so that position `start + i` holds the i-th kept token in every layer.
        """
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
            return
        end = start + len(offsets)
        host = torch.as_tensor([start + o for o in offsets])
        indices: dict[torch.device, torch.Tensor] = {}  # one upload per device, not one per layer
        for layer, buf in enumerate(self.keys):
            if buf is None:
                continue
            if buf.device not in indices:
                indices[buf.device] = to_device(host, buf.device)
            index = indices[buf.device]
            buf[..., start:end, :] = buf.index_select(-2, index)
            self.values[layer][..., start:end, :] = self.values[layer].index_select(-2, index)
            self.lengths[layer] = end


class FrozenView:
    """A read-only window on the first `length` positions of a cache.

    A pass over it attends to the window and its own new keys/values, and leaves no trace in the cache: its
    keys are written past the window, where nothing valid lies (the cache holds no more than `length`
    positions in that layer, or the caller declared the positions past it dead: `scratch`), and the cache's
    lengths stay as they were. Only where live positions lie past the window are the window and the new keys
    joined in a copy (every new key would otherwise cost a copy of the whole prefix, in every layer).
    """

    def __init__(self, cache: KVCache, length: int, scratch: bool = False) -> None:
        self.cache = cache
        self.length = length
        self.scratch = scratch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.length, self.cache.get_seq_length(layer_idx))

    def layout(self, layer: int, rows: int) -> Layout:
        n = self.get_seq_length(layer)
        return Layout(n, n, n + rows)

    def view(self, length: int, scratch: bool = False) -> FrozenView:
        return FrozenView(self.cache, min(length, self.length), scratch or self.scratch)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's keys/values followed by the new ones; the cache's lengths are not changed."""
        room = self.slot(layer_idx, keys.shape[-2])
        if room is not None:
            return _write(room, keys, values)
        cache, n = self.cache, self.get_seq_length(layer_idx)
        if n == 0:
            return keys, values
        return (torch.cat([cache.keys[layer_idx][..., :n, :], keys], dim=-2),
                torch.cat([cache.values[layer_idx][..., :n, :], values], dim=-2))

    def slot(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """As `KVCache.slot`, past the window, the cache's lengths unchanged; None where nothing is cached in the
        layer, or where live positions lie past the window (then `update` joins the window and the new keys in a
        copy)."""
        cache, n = self.cache, self.get_seq_length(layer)
        if n == 0 or not (self.scratch or n == cache.lengths[layer]):
            return None
        if n + rows > cache.keys[layer].shape[-2]:
            cache._grow(layer, n + rows)
        return cache.keys[layer], cache.values[layer], n


def _write(room: tuple[torch.Tensor, torch.Tensor, int], keys: torch.Tensor,
           values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new keys/values into a `slot`'s room; return what attention reads there (the buffers up to them)."""
    key_buffer, value_buffer, start = room
    end = start + keys.shape[-2]
    key_buffer[..., start:end, :] = keys
    value_buffer[..., start:end, :] = values
    return key_buffer[..., :end, :], value_buffer[..., :end, :]

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

from dataclasses import dataclass
from typing import Any, Protocol

import torch

MIN_CAPACITY = 256


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without stalling the host: on CUDA through pinned memory, copied
    asynchronously (a copy from pageable memory blocks until the device has taken it). torch's pinned
    allocator keeps the pinned block until the copy has run, so the caller may drop it at once."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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
    interface, the part used), the runner its `layout` for masks, drafters `view` for read-only passes."""

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
        start = self.lengths[layer_idx]
        end = start + keys.shape[-2]
        buf = self.keys[layer_idx]
        if buf is None or end > buf.shape[-2]:
            self._grow(layer_idx, end, keys, values)
        self.keys[layer_idx][..., start:end, :] = keys
        self.values[layer_idx][..., start:end, :] = values
        self.lengths[layer_idx] = end
        return self.keys[layer_idx][..., :end, :], self.values[layer_idx][..., :end, :]

    def _grow(self, layer: int, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        old_k, old_v = self.keys[layer], self.values[layer]
        capacity = max(MIN_CAPACITY, needed, 2 * (old_k.shape[-2] if old_k is not None else 0))
        new_k = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        new_v = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        n = self.lengths[layer]
        if old_k is not None and n:
            new_k[..., :n, :] = old_k[..., :n, :]
            new_v[..., :n, :] = old_v[..., :n, :]
        self.keys[layer], self.values[layer] = new_k, new_v

    def crop(self, length: int) -> None:
        """Cut every layer to at most `length` positions (an absolute length, unlike `DynamicCache.crop`)."""
        self.lengths = [min(n, length) for n in self.lengths]

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep positions `[0, start)` plus `start + o` for each offset, compacted in that order.

        After a forward that carried candidates or branches, only the accepted tokens' keys and values
        stay, so that position `start + i` holds the i-th kept token in every layer.
        """
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
            return
        end = start + len(offsets)
        host = torch.tensor([start + o for o in offsets])
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
        cache = self.cache
        n = self.get_seq_length(layer_idx)
        if n == 0:
            return keys, values
        if not (self.scratch or n == cache.lengths[layer_idx]):
            return (torch.cat([cache.keys[layer_idx][..., :n, :], keys], dim=-2),
                    torch.cat([cache.values[layer_idx][..., :n, :], values], dim=-2))
        end = n + keys.shape[-2]
        if end > cache.keys[layer_idx].shape[-2]:
            cache._grow(layer_idx, end, keys, values)
        cache.keys[layer_idx][..., n:end, :] = keys
        cache.values[layer_idx][..., n:end, :] = values
        return cache.keys[layer_idx][..., :end, :], cache.values[layer_idx][..., :end, :]

"""Buckets and a bucket's inputs: the device tensors every program of one bucket size reads.

  * Buckets: a forward of T tokens runs as the next size in `BUCKETS`. Padded rows see only themselves,
    no real row sees them, and their keys land past the layer's length, where the next forward
    overwrites them. A causal forward beyond the largest bucket (a long prompt) runs as bucketed chunks.
  * `BucketInputs`: per bucket, the device tensors every program of that bucket reads (rotary tables,
    masks [L, 1, 1, Tb, C], write indices [L, Tb]). A pass uploads what it needs in one non-blocking
    copy from pinned memory, and one program of the bucket (its `builder`) builds the rest on the device: loading
    never stalls the host and costs the device a copy and a replay, not a launch per tensor operation.

A bucket's inputs are also the cache object attention sees while a program runs (`BucketInputs.update`), so they
see their cache through `Store`: what of it they read and write.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from specgui.core.kvcache import to_device
from specgui.core.runner import Runner
from specgui.fastpath.device import Staging
from specgui.fastpath.program import Program, Programs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # 128: Lookahead's window and branch, Self-Draft's wide trees


_BUCKET_OF = [next(b for b in BUCKETS if b >= rows) for rows in range(BUCKETS[-1] + 1)]  # bucket's, by rows


def bucket(rows: int) -> int | None:
    """The bucket a forward of `rows` tokens runs as; None beyond the largest. (A table: a pass asks three times, and
    its launch is host time a GPU waits for.)"""
    return _BUCKET_OF[rows] if rows <= BUCKETS[-1] else None


class Store(Protocol):
    """What a bucket's inputs use of their cache (`StaticKVCache`)."""

    runner: Runner
    columns: int  # positions a layer's buffers hold, scratch included
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: torch.Tensor  # [1, largest bucket] the ids whole-model forwards read
    programs: Programs


@functools.lru_cache(maxsize=128)
def fixed_block(rows: int, causal: bool) -> np.ndarray:
    """[rows, rows] bool, read-only: the causal block (a pass without a visibility of its own) or the identity (a
    bucket's padding, a row seeing only itself), made once a size rather than at every pass's launch."""
    block = np.tri(rows, dtype=bool) if causal else np.eye(rows, dtype=bool)
    block.flags.writeable = False
    return block


def masks(prefix: torch.Tensor, offset: torch.Tensor, block: torch.Tensor, columns: int) -> torch.Tensor:
    """[L, rows, C] bool: row t of layer l sees [0, prefix_l) and the block at offset_l as `block` says.

    `prefix`, `offset` [L, 1] and `block` [rows, rows] (already padded: a padded row sees only itself, as a
    row seeing nothing would make softmax NaN, which would reach the cache) live on the target device.
    """
    rows = block.shape[0]
    col = torch.arange(columns, device=block.device)[None, :]  # [1, C]
    rel = col - offset  # [L, C]: column j's row in the new block, if 0 <= rel < rows
    in_block = (rel >= 0) & (rel < rows)
    seen = block[:, rel.clamp(0, rows - 1)]  # [rows, L, C]
    allowed = (col < prefix)[None] | (in_block[None] & seen)
    return allowed.permute(1, 0, 2).contiguous()


@dataclass
class BucketInputs:
    """The device tensors every program of one bucket reads, and which pass's values they hold now.

    It is also the cache object attention sees while a program runs: `update` writes a forward's keys at
    this bucket's write indices and returns the layer's whole buffers.
    """

    store: Store
    rows: int
    positions: torch.Tensor  # [1, Tb]
    cos: torch.Tensor  # [1, Tb, D]
    sin: torch.Tensor
    mask: torch.Tensor  # [L, 1, 1, Tb, C] bool
    index: torch.Tensor  # [L, Tb] where each row's keys go, per layer
    live: torch.Tensor  # [L, 1, 1, C, 1] bool: the columns some row sees, per layer
    origin: torch.Tensor  # [1] the first row's position as loaded (a draft chain's rows count from it)
    owner: object = field(default=None, repr=False)
    builder: Program | None = field(default=None, repr=False)  # a bucket's: fills the tensors above from the upload
    staging: Staging | None = field(default=None, repr=False)  # a bucket's: where its uploads are packed (`load`)
    shown: dict[int, int] = field(default_factory=dict, repr=False)  # per staging buffer, the rows its last pass packed

    @classmethod
    def empty(cls, store: Store, rows: int) -> BucketInputs:
        runner, device = store.runner, store.runner.device
        positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        cos, sin = runner.rotary(torch.empty(0, dtype=runner.dtype, device=device), positions)
        made = cls(store, rows, positions, cos, sin,
                   torch.zeros(runner.num_layers, 1, 1, rows, store.columns, dtype=torch.bool, device=device),
                   torch.zeros(runner.num_layers, rows, dtype=torch.long, device=device),
                   torch.zeros(runner.num_layers, 1, 1, store.columns, 1, dtype=torch.bool, device=device),
                   torch.zeros(1, dtype=torch.long, device=device))
        if bucket(rows) == rows:  # a bucket's inputs live on; a larger forward's are made for its one pass
            initial = cls.layout(rows, runner.num_layers)
            made.staging = Staging(initial, store.programs.device)
            made.builder = Program(made._build, torch.from_numpy(initial).to(device), store.programs, True, read=False)
        return made

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.store.keys[layer_idx], self.store.values[layer_idx]
        k.index_copy_(2, self.index[layer_idx], keys)
        v.index_copy_(2, self.index[layer_idx], values)
        # attention reads every column under a mask, and a masked weight of 0 times a NaN or Inf left in a slot no row
        # sees (scratch, stale or padded keys) is NaN: such slots are read as zeros
        live = self.live[layer_idx]
        return k.masked_fill(~live, 0), v.masked_fill(~live, 0)

    def load(self, owner: object, positions: np.ndarray, prefix: np.ndarray, offset: np.ndarray, visible: np.ndarray,
             tokens: np.ndarray | None = None) -> None:
        """Fill these inputs for a forward at `positions` [T] with `visible` [T, T] (bool; both on the host, numpy),
        each layer's keys in [0, `prefix`) seen and its new ones written from `offset` ([L] each: `Layout`'s),
        unless `owner`'s are here: one upload of [positions, prefixes, offsets, visible block] packed on the host,
        then one program (`builder`, a CUDA graph on a GPU) builds the rotary tables, masks and write indices from
        it, so that a pass's inputs cost the device one copy and one replay, not a launch per operation. `tokens` [T]
        (a whole-model forward's ids) ride in the same upload into the cache's token buffer; a negative id, or none,
        keeps the id the buffer holds at that row (placed on the device: `passes.chain`, `StaticKVCache.place`)."""
        if self.owner is owner:
            return
        t, rows, n = positions.shape[0], self.rows, prefix.shape[0]
        staging = self.staging  # (None beyond the buckets: packed afresh and built as it comes, for this one pass)
        packed = self.layout(rows, n) if staging is None else staging.next()
        packed[rows : rows + n] = prefix
        packed[rows + n : rows + 2 * n] = offset
        if staging is None:
            self._pack(packed, t, positions, visible, tokens, 0)
            self._build(to_device(torch.from_numpy(packed), self.positions.device))
        else:  # into the staging buffer over what it held: only what may differ is written
            self._pack(packed, t, positions, visible, tokens, self.shown.get(staging.slot, 0))
            self.shown[staging.slot] = t
            staging.send(self.builder.input)
            self.builder()
        self.owner = owner

    @staticmethod
    def layout(rows: int, n: int) -> np.ndarray:
        """An upload as it is before any pass packs it (`load`'s layout: [positions, prefixes, offsets, visible block,
        ids]; a padded row seeing only itself, every id kept), for `n` layers."""
        packed = np.zeros(rows + 2 * n + rows * rows + rows, dtype=np.int64)
        packed[rows + 2 * n : -rows].reshape(rows, rows)[:] = fixed_block(rows, causal=False)
        packed[-rows:] = -1
        return packed

    def _pack(self, packed: np.ndarray, t: int, positions: np.ndarray, visible: np.ndarray, tokens: np.ndarray | None,
              shown: int) -> None:
        """A pass's positions, visible block and ids into `packed`, which holds an earlier pass's of `shown` rows
        (their block and ids, past the padding's, put back first)."""
        rows = self.rows
        packed[:t] = positions
        packed[t:rows] = positions[-1]  # any real position: padded rows are never read
        block = packed[-rows - rows * rows : -rows].reshape(rows, rows)
        if shown > t:
            block[:shown, :shown] = fixed_block(shown, causal=False)
        block[:t, :t] = visible
        ids = packed[-rows:]
        ids[: max(shown, t)] = -1
        if tokens is not None:
            ids[:t] = tokens

    def _build(self, data: torch.Tensor) -> torch.Tensor:
        """Positions, rotary tables, masks, seen columns and write indices from an upload `data` (`load`'s layout)."""
        rows, n = self.rows, self.index.shape[0]
        self.positions.copy_(data[:rows].view(1, rows))
        cos, sin = self.store.runner.rotary(self.cos, self.positions)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        prefix, offset = data[rows : rows + n, None], data[rows + n : rows + 2 * n, None]
        self.mask.copy_(masks(prefix, offset, data[rows + 2 * n : -rows].view(rows, rows).bool(), self.store.columns)
                        .unsqueeze(1).unsqueeze(1))
        self.live.copy_(self.mask.any(3).unsqueeze(-1))
        self.index.copy_(offset + torch.arange(rows, device=data.device))
        self.origin.copy_(data[:1])
        if rows <= self.store.tokens.shape[1]:  # beyond: a forward of hidden states, no ids
            held = self.store.tokens[0, :rows]
            ids = data[-rows:]
            held.copy_(torch.where(ids >= 0, ids, held))
        return self.positions

    def rows_of(self, start: int, count: int) -> BucketInputs:
        """These inputs for rows [start, start + count) alone, as views (inside a program: Fractal's lower pass runs
        the slot rows of its forward, seeing what they see there, writing their keys where the forward does)."""
        rows = slice(start, start + count)
        return BucketInputs(self.store, count, self.positions[:, rows], self.cos[:, rows], self.sin[:, rows],
                            self.mask[:, :, :, rows], self.index[:, rows], self.live, self.origin)

    def advance(self, attended: torch.Tensor) -> None:
        """Inside a chained draft program (`passes.chain`), one row's inputs moved on by a position: the next
        row sees the key this one wrote in every layer whose attention ran (`attended`, layer indices), and writes
        its own one column further; the other layers' keys stay where they were. What the builder would make from the
        next pass's upload, made on the device."""
        layers, columns = self.index.shape[0], self.store.columns
        written = self.index.index_select(0, attended)[:, 0] + 1  # the next row's own column, per attended layer
        self.mask.view(layers, columns).index_put_((attended, written), torch.ones_like(written, dtype=torch.bool))
        self.live.view(layers, columns).index_put_((attended, written), torch.ones_like(written, dtype=torch.bool))
        self.index.index_copy_(0, attended, written[:, None])
        self.positions.add_(1)
        cos, sin = self.store.runner.rotary(self.cos, self.positions)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

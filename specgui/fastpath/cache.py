"""The static cache: keys and values in buffers of a capacity fixed when the run starts, and read-only views of it.

Attention reads a layer's whole buffer and a mask hides what is not there; keys are written through device index
tensors (`index_copy_`, at a bucket's write indices: `BucketInputs.update`), so one captured kernel serves every step.
Lengths stay on the host; `crop` and `keep` work in place as in `KVCache`. Read-only passes (`view`) put their own
keys in a scratch region past the capacity, which no other pass sees. One cache per runner, held by the runner (so
that dropping a model frees its cache and every graph with it).

The cache holds what its programs read and write at fixed addresses (the token buffer, the `readout`, each bucket's
inputs) and the table of those programs (`Programs`), but makes none of them but its own keeper: which programs a
pass runs is `forwards`' business.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from specgui.core.kvcache import KVCache
from specgui.core.runner import Pass, Runner
from specgui.errors import SpecGUIError
from specgui.fastpath.inputs import BUCKETS, BucketInputs, bucket
from specgui.fastpath.program import Program, Programs, key
from specgui.fastpath.readout import CHAIN, Readout

SCRATCH = 2 * BUCKETS[-1]  # rows past the capacity where read-only passes keep their own keys
KEEP = -2  # the `kind` of a keeper program (moves a step's accepted keys into place in every layer)


class StaticKVCache(KVCache):
    """Keys and values in buffers of `capacity` positions (plus scratch) per layer, allocated once."""

    pass_type: type[Pass]  # set in `passes`: forwards over this cache run as `StaticPass`
    chunk_rows = BUCKETS[-1]  # a causal forward over more rows runs as chunks of this many (the runner asks)

    def __init__(self, runner: Runner, capacity: int) -> None:
        super().__init__()
        config = runner.config
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.runner = runner
        self.capacity = capacity
        self.columns = capacity + SCRATCH
        shape = (1, heads, self.columns, head_dim)
        device = runner.device
        self.keys = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.values = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.lengths = [0] * runner.num_layers
        self.inputs: dict[int, BucketInputs] = {}
        self.readout = Readout(BUCKETS[-1], device)
        # the token ids every whole-model forward program reads (a bucket's first rows): written by the pass's upload
        # (`BucketInputs.load`) or on the device by a chained draft (`passes.chain`), where the next forward finds them
        self.tokens = torch.zeros(1, BUCKETS[-1], dtype=torch.long, device=device)
        # the run's tokens as the device knows them, and how many (the pending one's included): where prompt lookup's
        # steps chained on the device find their n-grams and leave what they accept (`lookup.LookupSteps`)
        self.history = torch.zeros(capacity, dtype=torch.long, device=device)
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)
        # what a carried step leaves for the next (`slots.SlotSteps`): its slots' tokens, the target's predictions at
        # them (up to a chain's longest each) and whether its draft was accepted whole
        self.carried = torch.zeros(2 * CHAIN + 1, dtype=torch.long, device=device)
        self.programs = Programs(runner)  # last: its graphs' memory is counted from here

    @property
    def store(self) -> StaticKVCache:
        return self

    def bounds(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Where a forward of `rows` tokens reads and writes, every layer at once: (prefix, offset) [L] (`Layout`'s,
        its columns the cache's): each layer's keys so far are seen, the new ones go right after them. As arrays, not
        a `Layout` a layer: a pass's 30 of them cost more host time than the rest of its launch (a GPU waits for it)."""
        longest = max(self.lengths)  # (Python's: numpy's reduction costs the host ten times more, cold after a forward)
        if longest + rows > self.capacity:
            raise SpecGUIError(f"a forward of {rows} tokens at {longest} does not fit the fast path's capacity "
                               f"of {self.capacity} positions; use --fast-path off")
        n = np.asarray(self.lengths, dtype=np.int64)
        return n, n

    def view(self, length: int, scratch: bool = False) -> StaticView:
        return StaticView(self, length, scratch)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a StaticKVCache is written by fast-path passes (runner.new_pass), not directly")

    def slot(self, layer: int, rows: int) -> None:
        """No room for a one-call layer (`KVCache.slot`): fast-path passes write this cache, as `update` says."""
        return None

    def inputs_for(self, rows: int) -> BucketInputs:
        """The persistent inputs of a bucket (made on first use); a larger forward gets its own, once."""
        if bucket(rows) != rows:
            return BucketInputs.empty(self, rows)
        if rows not in self.inputs:
            self.inputs[rows] = BucketInputs.empty(self, rows)
        return self.inputs[rows]

    def place(self, row: int, ids: torch.Tensor) -> None:
        """Device-held token ids into the token buffer from `row` on, where the next whole-model forward reads them
        (its upload names their rows as kept: `BucketInputs.load`)."""
        self.tokens[0, row : row + ids.numel()].copy_(ids.reshape(-1))

    def keep(self, start: int, offsets: list[int]) -> None:
        """`KVCache.keep` as one program (`keeper`): a tree's accepted keys move into place in every layer by one
        upload and one replay, not two device operations a layer for keys and two for values."""
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
            return
        n = len(offsets)
        program = self.keeper(bucket(n) or n)
        moves = np.full((2, program.input.shape[1]), self.capacity, dtype=np.int64)  # padding: scratch onto itself
        moves[0, :n] = np.add(offsets, start)
        moves[1, :n] = np.arange(start, start + n)
        program.send(moves)
        program()
        self.lengths = [start + n] * len(self.lengths)

    def nonfinite(self) -> list[str]:
        """What of this cache holds NaN or Inf, named: its layers' keys and values (all of them: zeros as allocated,
        keys computed from real or padded rows, so a non-finite one is a defect wherever it sits), and the outputs of
        its programs that have run (a program's last output)."""
        found = [f"{kind} of layer {layer}" for kind, buffers in (("keys", self.keys), ("values", self.values))
                 for layer, buffer in enumerate(buffers) if not torch.isfinite(buffer).all()]
        for name, program in self.programs.by_key.items():
            output = program.output
            if (program.calls and output is not None and output.is_floating_point()
                    and not torch.isfinite(output).all()):
                found.append(f"the output of program {name}")
        return found

    def waits(self) -> int:
        """How often the host waited for a staging buffer's copy to land (`device.Staging.waits`): on a GPU a stall of
        the host mid-step, until the device caught up."""
        stagings = [inputs.staging for inputs in self.inputs.values()]
        stagings += [program.staging for program in self.programs.by_key.values()]
        return sum(staging.waits for staging in stagings if staging is not None)

    def keeper(self, rows: int) -> Program:
        """The program moving up to `rows` keys and values of every layer: from the columns in its input's first row
        to those in its second (made at warm-up per bucket; its output is read by nobody)."""

        def make() -> Program:
            def run(moves: torch.Tensor) -> torch.Tensor:
                for buffer in (*self.keys, *self.values):
                    buffer.index_copy_(2, moves[1], buffer.index_select(2, moves[0]))
                return moves[0]

            example = torch.zeros(2, rows, dtype=torch.long, device=self.runner.device)
            return Program(run, example, self.programs, True, read=False)

        return self.programs.get(key(None, KEEP, rows), make)


class StaticView:
    """A read-only window on the first `length` positions of a `StaticKVCache`: new keys go to the scratch region,
    or, where the caller declares the positions past the window dead (`scratch`), right after the window, as
    `FrozenView` puts them (Fractal's kept-slot redo reads a lower pass's keys there)."""

    def __init__(self, store: StaticKVCache, length: int, scratch: bool = False) -> None:
        self.store = store
        self.length = length
        self.scratch = scratch

    pass_type: type[Pass]  # set in `passes`

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.length, self.store.lengths[layer_idx])

    def bounds(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """`StaticKVCache.bounds` for this window: keys past it unseen, new ones written to the scratch region (or,
        `scratch`, right after the window where they fit)."""
        if rows > SCRATCH:
            raise SpecGUIError(f"a read-only pass of {rows} tokens exceeds the fast path's scratch of {SCRATCH}")
        capacity = self.store.capacity
        n = np.minimum(np.asarray(self.store.lengths, dtype=np.int64), self.length)
        return n, (np.where(n + rows <= capacity, n, capacity) if self.scratch else np.full_like(n, capacity))

    def view(self, length: int, scratch: bool = False) -> StaticView:
        return StaticView(self.store, min(length, self.length), scratch or self.scratch)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a StaticView is written by fast-path passes (runner.new_pass), not directly")

"""What every step chained on the device shares: the run's tokens as the device knows them, where the step starts.

Why: a step launched before the one before it is read (`lookup.LookupSteps`, `skips.SkipSteps`) cannot take its
pending token or its position from the host. The device keeps the run's tokens (`StaticKVCache.history`) and how many
(`cursor`, the pending token's included); a chained step reads its pending token and position there, builds its
bucket's inputs at that position on the device (`Block.build`), verifies, and writes what it accepts back, the
cursor moved past it (`Block.accept`). Where the host decoded steps the device did not write (a chain's first step,
after plain steps or a read), it uploads what the history lacks first (`Synced.sync`).
"""

from __future__ import annotations

import numpy as np
import torch

from specgui.core.kvcache import upload
from specgui.errors import SpecGUIError
from specgui.fastpath.cache import StaticKVCache
from specgui.fastpath.device import Event
from specgui.fastpath.inputs import fixed_block
from specgui.fastpath.program import Program, key
from specgui.fastpath.readout import HostRows

ROW = -8  # the `kind` of the program that builds one-row inputs where the host says (`start_row`)
_NOWHERE = np.zeros(1, dtype=np.int64)  # a chained step's pass's positions (its inputs are built on the device)


class Block:
    """A bucket's causal block at the device's cursor, for a program's function: its constants made once, when the
    program is (never inside a capture)."""

    def __init__(self, cache: StaticKVCache, rows: int) -> None:
        self.cache, self.inputs = cache, cache.inputs_for(rows)
        device = cache.runner.device
        self.ahead = torch.arange(rows, device=device)
        self.causal = torch.from_numpy(fixed_block(rows, causal=True).astype(np.int64).reshape(-1)).to(device)

    def build(self, length: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None = None,
              visible: torch.Tensor | None = None) -> None:
        """The bucket's inputs for the block at the pending token's position (`length` [1] less one) on, every layer
        seeing the keys before it, its rows' ids `ids` (negative: the id the token buffer holds there): what
        `BucketInputs.load` would upload, made on the device. Its rows at `offsets` [rows] past that position, seeing
        each other as `visible` [rows * rows] (int64) says (by default one after the other, causally: a chain)."""
        at, layers = length - 1, self.cache.runner.num_layers
        offsets = self.ahead if offsets is None else offsets
        visible = self.causal if visible is None else visible
        self.inputs._build(torch.cat([at + offsets, at.expand(layers), at.expand(layers), visible, ids]))

    def accept(self, length: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, best: torch.Tensor
               ) -> torch.Tensor:
        """Greedy acceptance of a chain draft, written back: `ids` [R] the block's ids (the pending token's, then the
        draft's), `valid` [R - 1] the draft tokens that may be accepted, `best` [R] the target's choice at each row.
        The accepted draft tokens and the verifier's own go to the history after the pending token, and the cursor
        moves past them. Returns how many draft tokens it accepted [1]."""
        history, ahead = self.cache.history, self.ahead
        accepted = ((ids[1:] == best[:-1]) & valid).long().cumprod(0).sum().view(1)
        own = best.index_select(0, accepted)
        kept = torch.where(ahead < accepted, torch.cat([ids[1:], own]), own)
        history.index_copy_(0, (length + ahead).clamp(max=history.shape[0] - 1), kept)
        self.cache.cursor.copy_(length + accepted + 1)
        return accepted


def row_program(cache: StaticKVCache) -> Program:
    """The program behind `start_row`: its input [length, id] (int64) the host's two values, the rest `Block.build`.
    Until a start sends its own, the input is a row at the scratch region's first column (length capacity + 1), so
    that a capture's warm-up run builds inputs that write nowhere a run reads (zeros would be a row at position -1:
    every layer's write index -1, its mask seeing nothing)."""

    def make() -> Program:
        block = Block(cache, 1)

        def run(control: torch.Tensor) -> torch.Tensor:
            block.build(control[:1], control[1:])
            return control

        program = Program(run, torch.zeros(2, dtype=torch.long, device=cache.runner.device), cache.programs, True,
                          read=False)
        program.input[0] = cache.capacity + 1
        return program

    return cache.programs.get(key(None, ROW, 1), make)


def start_row(cache: StaticKVCache, position: int, token: int) -> None:
    """The one-row inputs at `position`, its id `token`, every layer seeing the keys before it and writing its own
    there (every layer holds the committed prefix, as a drafter finds the cache): two values uploaded and built on the
    device (`row_program`), for a draft chain the host starts (`passes.chain`). A load (`BucketInputs.load`) would
    pack the layers' bounds, the positions, the block and the ids on the host between the verdict's read and the
    launch (on a CPU ~0.03 ms of a SWIFT step's, cold after a forward)."""
    program = row_program(cache)
    program.send((position + 1, token))
    program()
    cache.inputs_for(1).owner = None  # built on the device: the next pass that wants them loads its own


def replay(cache: StaticKVCache, program: Program, control: tuple[float, ...], rows: int, host: HostRows
           ) -> tuple[torch.Tensor, Event | None]:
    """One chained step whose one program does the whole step (`lookup.LookupSteps`, `slots.SlotSteps`): its `control`
    values sent, the program run as a forward pass of its own (counted: `dispatch`), the bucket of `rows` left to
    whichever pass wants it next (its inputs were built on the device: that pass loads its own), and the output copied
    to the next of the pinned `host` rows: that host view and the event to wait for before reading it."""
    program.send(control)
    out = cache.runner.new_pass(_NOWHERE, cache).call(program)
    cache.inputs_for(rows).owner = None
    return host.copy(out)


def check(accepted: list[float], path: list[int]) -> None:
    """After a chained step's read: the device accepted (the launch's count, as read) the draft tokens the host's
    verdict did (its `path`), and so wrote what the host decoded; else a one-line error (the steps chained after it
    would start where the host's tokens do not)."""
    if int(accepted[0]) != len(path):
        raise SpecGUIError(f"the device accepted {int(accepted[0])} draft tokens of a chained step, the host "
                           f"{len(path)}: a bug, please report it")


class Synced:
    """The host's side of a run's chained steps of one kind: what of the history it uploaded (the device's own steps
    wrote the rest, the same ids)."""

    def __init__(self, cache: StaticKVCache) -> None:
        self.cache = cache
        self.synced = 0

    def sync(self, tokens: list[int] | None, rows: int) -> int:
        """Before a step launched with the run's `tokens` (the pending one last): the history's missing ids uploaded,
        and their count returned; -1 for a step launched on what the device holds (`tokens` None). A one-line error
        where a step of `rows` rows from there would not fit the cache."""
        if tokens is None:
            return -1
        cache, length = self.cache, len(tokens)
        if length + rows > cache.capacity:
            raise SpecGUIError(f"a chained step of {rows} rows at {length} does not fit the fast path's capacity of "
                               f"{cache.capacity} positions; use --fast-path off")
        upload(cache.history[self.synced : length], np.asarray(tokens[self.synced :], dtype=np.int64))
        self.synced = length
        return length

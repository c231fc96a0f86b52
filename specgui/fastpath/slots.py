"""Carried steps chained on the device: Fractal's chain from the step before's slots, its verify and what it accepts.

Why: a carrying Fractal step (`methods.fractal`, `carry`) drafts the chain the step before's draft slots predicted,
cut where a slot held another token than the chain before it predicts, and starts its own slots from a prompt lookup
over the text and that chain. Drafted from the host, that is a read, accepting, the chain's cut, the lookup, the
slots' inputs and their upload, while the device waits (on a CPU 0.18-0.19 ms a step, over the 0.15 a GPU's step
affords). Every one of them is a function of what the step before left on the device: its slots' tokens and the
target's predictions at them, whether its draft was accepted whole (`StaticKVCache.carried`), and the run's tokens
(`history`, `cursor`). So one program a size does the whole step there: the chain (`standing`), the slots' starting
tokens (`lookup.match`, pld's rule), the bucket's inputs built on the device (`cursor.Block.build`: the slots after
the chain's valid tokens, seeing only those), the spliced verify forward (the slots refined inside it, continuing
the chain's last valid row: `SlotChain.splice`), the greedy acceptance written to the history, and what the next
step carries. Step t + 1 is launched before step t is read wherever the drafter's plan is known without t's verdict.

The verify carries the chain's whole size whatever stands (the rows past the cut are seen by no row and accepted
never), so that the program has one shape a size; the host reads each step a step behind, its tokens with the
verdict (`Unread`), and checks that the device accepted what the host's verifier did (`cursor.check`).
"""

from __future__ import annotations

import numpy as np
import torch

from specgui.core.draft import SlotChain
from specgui.core.runner import VERIFY_TOP, Top
from specgui.fastpath.cache import StaticKVCache
from specgui.fastpath.cursor import Block, Synced, replay
from specgui.fastpath.device import Event
from specgui.fastpath.forwards import forward_program
from specgui.fastpath.inputs import bucket
from specgui.fastpath.lookup import matcher
from specgui.fastpath.program import Program, key
from specgui.fastpath.readout import CHAIN, HostRows, width

SLOTS = -9  # the `kind` of a carried step's program


def standing(pending: torch.Tensor, held: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """`methods.fractal.consistent_chain` in fixed shapes: which of the slots' predictions `predicted` [w] stand as
    draft tokens after `pending` [1] (the token the anchor's row produced), the slots having held `held` [w]: slot j's
    while every slot up to j held the token the chain before it predicts (slot 0 `pending`). Bool [w]."""
    expected = torch.cat([pending, predicted[:-1]])
    return (held == expected).long().cumprod(0).bool()


def visibility(size: int, window: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A carried step's block, less what depends on the cut: [rows, rows] the pending token and the chain causal, each
    slot seeing the pending token and the slots up to its own, a padded row itself; and [rows] the slot rows, which
    also see the chain's valid tokens (added on the device)."""
    exact = 1 + size
    block = np.eye(rows, dtype=np.int64)
    block[:exact, :exact] = np.tri(exact, dtype=np.int64)
    block[exact : exact + window, 0] = 1
    block[exact : exact + window, exact : exact + window] = np.tri(window, dtype=np.int64)
    slot_rows = np.zeros(rows, dtype=np.int64)
    slot_rows[exact : exact + window] = 1
    return block, slot_rows


def slot_program(cache: StaticKVCache, chain: SlotChain) -> Program:
    """The program of a carried step drafting up to `chain.size` tokens. Its input, the step's one upload (int64):
    [length, restart], the history's length where the host knows it (else -1: the cursor's) and whether the chain
    restarts (nothing stands: the step before carried no slots). Its output, flat: how many draft tokens the device
    accepted, the verify's packed `Top` of each row of the bucket, how many of the chain's tokens stood, the chain's
    tokens (the slots' predictions, standing or not) and every fractal layer's slot guesses (`splice`'s `parts`)."""
    size, window, rows = chain.size, chain.window, bucket(chain.rows)

    def make() -> Program:
        block, device = Block(cache, rows), cache.runner.device
        history, carried, columns, find = cache.history, cache.carried, cache.history.shape[0], matcher(cache)
        anchor = torch.zeros(1, dtype=torch.long, device=device)  # the row the slots continue: the chain's last
        hook = chain.splice.anchored(anchor)
        forward = forward_program(cache, block.inputs, top=VERIFY_TOP, hook=hook)
        fixed, slot_rows = (torch.from_numpy(a).to(device) for a in visibility(size, window, rows))
        ahead, exact = block.ahead, 1 + size
        past = torch.zeros(rows - exact, dtype=torch.long, device=device)  # the rows past the chain: never accepted
        padding = torch.full((rows - exact - window,), -1, dtype=torch.long, device=device)

        def run(control: torch.Tensor) -> torch.Tensor:
            length = torch.where(control[:1] >= 0, control[:1], cache.cursor)  # [1]: the pending token's included
            pending = history.index_select(0, length - 1)
            held, predicted, whole = carried[:window], carried[window : 2 * window], carried[2 * window :][:1]
            valid = (standing(pending, held, predicted) & (whole > 0) & (control[1:] == 0))[:size].long()
            stood = valid.sum().view(1)
            drafted = predicted[:size].clone()  # (`carried` is rewritten below)
            # the slots start from what followed the text + the standing chain where it occurred before (past the
            # history's length is scratch: the acceptance below writes over it)
            history.index_copy_(0, (length + ahead[:size]).clamp(max=columns - 1), drafted)
            found, available, _ = find(history, length + stood, chain.ngrams, window)
            start = torch.where(ahead[:window] < available, found, history.index_select(0, length + stood - 1))
            ids = torch.cat([pending, drafted, start, padding])
            seen = torch.cat([valid.new_zeros(1), valid, past])  # the columns of the chain's valid tokens
            offsets = torch.cat([ahead[:exact], stood + 1 + ahead[:window], past[window:]])
            block.build(length, ids, offsets, (fixed + slot_rows[:, None] * seen[None, :]).reshape(-1))
            anchor.copy_(stood)
            top = forward.fn(forward.input)  # the verify's packed Top of every row, the slots refined inside
            best = top[:, 0].long()
            accepted = block.accept(length, ids, torch.cat([valid, past]).bool(), best)
            carried[:window].copy_(hook.parts[-1].long())  # what the next step carries: the slots' last tokens,
            carried[window : 2 * window].copy_(best[exact : exact + window])  # the predictions at them,
            carried[2 * window].copy_((accepted == stood).long()[0])  # whether this draft was accepted whole
            return torch.cat([accepted.float(), top.reshape(-1), stood.float(), drafted.float(), *hook.parts])

        example = torch.zeros(2, dtype=torch.long, device=device)
        return Program(run, example, cache.programs, forward.graphs)  # where the forward's layers can be captured

    return cache.programs.get(key(None, SLOTS, rows, size, window, chain.ngrams, chain.splice.key), make)


class SlotSteps:
    """A run's carried steps (`SlotChain` drafts), launched by the host, each before the one before it is read where
    the drafter plans it without that verdict. A step's verdict and chain are copied to a pinned host row right after
    its replay (`readout.HostRows`), as `SkipSteps` does."""

    def __init__(self, cache: StaticKVCache) -> None:
        self.cache = cache
        self.host = HostRows(2 + CHAIN + cache.readout.buffer.numel(), cache.programs.device)
        self.synced = Synced(cache)

    def launch(self, chain: SlotChain, tokens: list[int] | None
               ) -> tuple[Top, Event | None, torch.Tensor, torch.Tensor]:
        """A step drafting `chain` from what the step before left on the device, or, given the run's `tokens` (the
        pending one last), from those (the carried slots are the device's either way). Returns its verdict as a host
        `Top` [rows, 3 k + 1], the event to wait for before reading it (None off CUDA), the host view of how many draft
        tokens the device accepted [1] (read with the verdict: `cursor.check`) and of its draft's values (how many
        stood, the chain, the slot guesses: `Unread.values`)."""
        cache, rows = self.cache, bucket(chain.rows)
        host, event = replay(cache, slot_program(cache, chain), (self.synced.sync(tokens, rows), chain.restart), rows,
                             self.host)
        end = 1 + rows * width(VERIFY_TOP)
        return Top(host[1:end].view(rows, -1), VERIFY_TOP), event, host[:1], host[end:]


def warm_up(cache: StaticKVCache, chains: list[SlotChain]) -> None:
    """Make (on CUDA: capture) the programs of `chains`' sizes before any timed step (a method's `setup`, the cache
    still empty: what they write, at its first positions, the run's prompt forward and steps write over; a restart,
    so that what they leave to carry is never read)."""
    with torch.inference_mode():
        for chain in chains:
            program = slot_program(cache, chain)
            if not program.ready:
                program.input.copy_(torch.tensor([1, 1]))  # a history of one token, restarting
                program.prepare()
                cache.inputs_for(bucket(chain.rows)).owner = None

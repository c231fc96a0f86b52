"""Layer-skip steps chained on the device: a draft chain from the device's cursor, its verify and what it accepts.

Why: a layer-skip step (CLaSp, ASD/ADMG, Draft & Verify) drafts with the target's own layers, so its draft needs the
token the step before accepted; drafted from the host, that is a read, accepting, the drafter's `observe`, the next
draft's launch, while the device waits (on a GPU a paused layer-skip method ran under plain decoding's speed, a drafting
one further under). Here the step starts where the step before left the device's cursor (`cursor`): one replay builds
the one-row inputs at the pending token's position (`start_program`), the plan's chained program drafts `size` tokens
(`forwards.chained_program`: each replay feeds the next, as `passes.chain`), and one program of the verify's bucket
(`verify_program`) builds its inputs there, runs the verify forward, applies the draft-exit (a token stands while every
draft token before it reached the threshold, the draft's top-1 probability, compared in float64 as the host compares)
and the greedy acceptance, and writes the accepted tokens to the history. So step t + 1 is launched before step t is
read wherever the drafter knows its plan, size and threshold without t's verdict (`methods.layerskip`).

The host reads each step a step behind: the verify's `Top` and the chain's Tops come back in one pinned row
(`readout.HostRows`), and the drafter settles the chain from them (`layerskip.UnreadChain.decide`) as it settles a chain
it launched itself: the tokens that stand are those a read-as-you-go draft would have drafted.
"""

from __future__ import annotations

import numpy as np
import torch

from specgui.core.draft import SkipChain
from specgui.core.runner import VERIFY_TOP, SkipPlan, Top
from specgui.fastpath.cache import StaticKVCache
from specgui.fastpath.cursor import Block, Synced
from specgui.fastpath.device import Event
from specgui.fastpath.forwards import chained_program, forward_program
from specgui.fastpath.inputs import bucket
from specgui.fastpath.program import Program, key
from specgui.fastpath.readout import CHAIN, HostRows, width

START = -6  # the `kind` of the program starting a chained layer-skip step (its one-row inputs at the cursor)
SKIP = -7  # the `kind` of a chained layer-skip step's verify program


def start_program(cache: StaticKVCache) -> Program:
    """The program that starts a chained layer-skip step. Its input, the step's one upload (float64, exact for these):
    [length, size, threshold], the history's length where the host knows it (a chain's first step; else -1: the
    cursor's), kept as the cursor, and what the step's verify reads (`verify_program`). It builds the one-row inputs
    at the pending token's position, its id the history's there (the chained draft's first input)."""

    def make() -> Program:
        block = Block(cache, 1)

        def run(control: torch.Tensor) -> torch.Tensor:
            length = torch.where(control[:1] >= 0, control[:1].long(), cache.cursor)
            cache.cursor.copy_(length)
            block.build(length, cache.history.index_select(0, length - 1))
            return length

        example = torch.zeros(3, dtype=torch.float64, device=cache.runner.device)
        return Program(run, example, cache.programs, True, read=False)

    return cache.programs.get(key(None, START, 1), make)


def verify_program(cache: StaticKVCache, rows: int) -> Program:
    """The verify of a chained layer-skip step at a bucket of `rows`, reading the draft tokens that may stand and the
    draft-exit threshold from the step's upload (`start_program`'s input: no upload of its own). The block is the
    pending token at the cursor and the chain's tokens where the chained draft placed them (`StaticKVCache.tokens`,
    rows 1 on). Its output, flat [1 + (rows + min(rows - 1, CHAIN)) * (3 k + 1)]: how many draft tokens the device
    accepted, the verify's packed `Top` of each row, then the chain's, read in one piece."""

    def make() -> Program:
        block, control = Block(cache, rows), start_program(cache).input
        forward = forward_program(cache, block.inputs, top=VERIFY_TOP)
        kept = min(rows - 1, CHAIN)  # chain positions the ring holds (a chain is at most that long)
        chain = Top(cache.readout.ring(VERIFY_TOP)[:kept], VERIFY_TOP)  # its Tops, where the chained draft left them
        device = cache.runner.device
        first, beyond = torch.ones(1, dtype=torch.bool, device=device), torch.zeros(rows - 1 - kept, dtype=torch.bool,
                                                                                   device=device)
        drafted = block.ahead[: rows - 1]

        def run(_: torch.Tensor) -> torch.Tensor:
            length = cache.cursor.clone()
            pending = cache.history.index_select(0, length - 1)
            block.build(length, torch.cat([pending, torch.full_like(drafted, -1)]))  # -1: the chain's ids in place
            top = forward.fn(forward.input)  # the verify's packed Top of every row
            reached = chain.probs[:, 0].double() >= control[2]
            standing = torch.cat([torch.cat([first, reached[:-1]]).long().cumprod(0).bool(), beyond])
            accepted = block.accept(length, cache.tokens[0, :rows], standing & (drafted < control[1]),
                                    top[:, 0].long())
            return torch.cat([accepted.float(), top.reshape(-1), chain.packed.reshape(-1)])

        example = torch.zeros(1, device=cache.runner.device)  # (read nowhere)
        return Program(run, example, cache.programs, forward.graphs)  # where the forward's layers can be captured

    return cache.programs.get(key(None, SKIP, rows), make)


class SkipSteps:
    """A run's chained layer-skip steps (`SkipChain` drafts), launched by the host, each before the one before it is
    read where the drafter fixes it without that verdict. A step's verdict and chain are copied to a pinned host row
    right after its verify (`readout.HostRows`), as `LookupSteps` does."""

    def __init__(self, cache: StaticKVCache) -> None:
        self.cache = cache
        self.host = HostRows(1 + 2 * cache.tokens.shape[1] * width(VERIFY_TOP), cache.programs.device)
        self.synced = Synced(cache)
        self.nowhere = np.zeros(1, dtype=np.int64)  # a replay's pass's positions (its inputs are built on the device)
        self.plan: SkipPlan | None = None  # the plan of the programs at hand (a run's plan changes rarely)
        self.made: dict[int, tuple[Program, Program, Program]] = {}  # by bucket: the start, chain and verify programs

    def launch(self, chain: SkipChain, tokens: list[int] | None
               ) -> tuple[Top, Event | None, torch.Tensor, torch.Tensor]:
        """A step drafting `chain` from the device's cursor, or, given the run's `tokens` (the pending one last), from
        those. Returns its verdict as a host `Top` [rows, 3 k + 1], the event to wait for before reading it (None off
        CUDA), the host view of how many draft tokens the device accepted [1] (read with the verdict: `cursor.check`)
        and of the chain's Tops [size, 3 k + 1] (its nodes' values: `Unread.values`)."""
        cache, rows = self.cache, bucket(1 + chain.size)
        if chain.plan is not self.plan:
            self.plan, self.made = chain.plan, {}
        if rows not in self.made:
            self.made[rows] = (start_program(cache), chained_program(cache, cache.inputs_for(1), chain.plan, 1)[0],
                               verify_program(cache, rows))
        start, program, verify = self.made[rows]
        # each replay a forward pass of its own: the first made before the start's launch, the others after it, before
        # the first replay (between two replays the host only calls; `passes.chain`)
        passes = [cache.runner.new_pass(self.nowhere, cache)]
        cache.inputs_for(1).owner = cache.inputs_for(rows).owner = None  # built on the device: others load their own
        start.send((self.synced.sync(tokens, rows), chain.size, chain.threshold))
        start()
        passes += [cache.runner.new_pass(self.nowhere, cache) for _ in range(chain.size)]
        for step in passes[:-1]:
            step.call(program)
        out = passes[-1].call(verify)
        host, event = self.host.copy(out)
        end = 1 + rows * width(VERIFY_TOP)
        return (Top(host[1:end].view(rows, -1), VERIFY_TOP), event, host[:1],
                host[end : end + chain.size * width(VERIFY_TOP)].view(chain.size, -1))


def warm_up(cache: StaticKVCache, sizes: range) -> None:
    """Make (on CUDA: capture) the programs of chained steps drafting any of `sizes` tokens but the plans' own (made
    when a method adopts a plan), before any timed step (a method's `setup`, the cache still empty: what they write,
    at its first positions, the run's prompt forward and steps write over)."""
    with torch.inference_mode():
        start = start_program(cache)
        if not start.ready:
            start.input.copy_(torch.tensor([1.0, 0.0, 1.0]))  # a history of one token
            start.prepare()
        buckets = sorted({bucket(1 + size) for size in sizes if 0 < size <= CHAIN})
        for rows in buckets:
            program = verify_program(cache, rows)
            if not program.ready:
                start()  # (the verify reads the cursor the start left)
                program.prepare()
        for rows in (1, *buckets):
            cache.inputs_for(rows).owner = None

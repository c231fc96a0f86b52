"""Prompt lookup's steps chained on the device: the n-gram match, the draft, its verify and what it accepts in one.

Why: plain decoding's steps chain on the device (`passes.PlainSteps`: step t + 1 launched before step t is read), but a
prompt-lookup step needs the tokens step t accepted to find its n-gram, and on the host that means a read, then the
lookup, then the launch, while the device waits (and prompt lookup ran near plain decoding's speed on a GPU, far under
its ceiling). Here one program a bucket does the whole step from what the device holds, as vLLM's GPU n-gram proposer
does for its asynchronous scheduler: the run's tokens (`StaticKVCache.history`, how many in `cursor`), the longest
suffix n-gram's first earlier occurrence with a continuation (the rule of `methods.pld.NgramIndex`, in fixed shapes), up
to `size` tokens of that continuation as a chain draft, the bucket's inputs built on the device (`BucketInputs._build`),
the verify forward ending in its `Top`, the greedy acceptance, and the accepted tokens and the verifier's own written
back to the history, the cursor moved past them. The chain's keys are already where the next step reads them (a chain
writes its rows in order), so nothing is cropped.

The host still decides how much to draft (the policy's size, chosen a step ahead: `methods.pld`) and still drafts the
same lookup itself when it reads the step, a step behind, for the step's event: the step's row brings back the ids
the device drafted, and a draft that differs stops the run (`check`) rather than verify one draft against another's
forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specgui.core.runner import VERIFY_TOP, Top
from specgui.errors import SpecGUIError
from specgui.fastpath import compiled
from specgui.fastpath.cache import StaticKVCache
from specgui.fastpath.cursor import Block, Synced, replay
from specgui.fastpath.device import Event
from specgui.fastpath.forwards import forward_program
from specgui.fastpath.inputs import bucket
from specgui.fastpath.program import Program, key
from specgui.fastpath.readout import HostRows, width

LOOKUP = -5  # the `kind` of a lookup step's program in the cache's table


@compiled.register("match")
def match(history: torch.Tensor, length: torch.Tensor, ngrams: tuple[int, int], count: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lookup of `methods.pld.NgramIndex` over the first `length` ([1]) ids of `history` [C], in fixed shapes (no
    read, so that it runs inside a captured program): the longest suffix n-gram (n from `ngrams`' longest down to its
    shortest) whose first earlier occurrence has a continuation. Returns the `count` ids after that occurrence [count]
    (clamped to the buffer: only the first `available` are the continuation), how many of them are (`available` [1],
    0 without a match) and the n matched ([1], 0 without). About 15 small operations a size over the whole history:
    where the programs compile, called compiled (`matcher`), a few fused kernels."""
    columns = history.shape[0]
    starts = torch.arange(columns, device=history.device)
    found = torch.zeros(1, dtype=torch.bool, device=history.device)
    start = torch.zeros(1, dtype=torch.long, device=history.device)
    size = torch.zeros(1, dtype=torch.long, device=history.device)
    lo, hi = ngrams
    for n in range(min(hi, columns - 1), lo - 1, -1):
        suffix = history.index_select(0, (length - n + starts[:n]).clamp(min=0))
        windows = history.unfold(0, n, 1)  # [C - n + 1, n]: every start's n-gram
        candidates = starts[: columns - n + 1]
        # an occurrence ends before the pending token (its continuation has a token), which the suffix ends with
        hit = (windows == suffix).all(1) & (candidates <= length - n - 1)
        first = torch.where(hit, candidates, columns).amin().view(1)
        take = (first < columns) & ~found
        start = torch.where(take, first, start)
        size = torch.where(take, n, size)
        found = found | take
    available = torch.where(found, length - start - size, 0)
    ids = history.index_select(0, (start + size + starts[:count]).clamp(max=columns - 1))
    return ids, available, size


def matcher(cache: StaticKVCache) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`match` as the cache's programs call it: compiled where they compile (`Programs.kernel`)."""
    table = cache.programs
    return table.kernel("match") if table.compiled else match


def lookup_program(cache: StaticKVCache, rows: int, ngrams: tuple[int, int]) -> Program:
    """The program of one chained lookup step at a bucket of `rows` (1: a step that drafts nothing, its lookup left
    out). Its input: [size, length], the most tokens to draft and, where the host knows it (a chain's first step), the
    history's length (else -1: the cursor's). Its output, flat [rows * (3 k + 1) + rows]: the verify's packed `Top` of
    each row, then each row's id (row 0 the pending token's, then the draft's, -1 past it), read in one piece."""
    history, cursor = cache.history, cache.cursor

    def make() -> Program:
        block = Block(cache, rows)
        forward = forward_program(cache, block.inputs, top=VERIFY_TOP)
        ahead, find = block.ahead, matcher(cache)

        def run(control: torch.Tensor) -> torch.Tensor:
            length = torch.where(control[1:] >= 0, control[1:], cursor)  # [1]: the pending token's included
            pending = history.index_select(0, length - 1)
            if rows > 1:
                draft, available, _ = find(history, length, ngrams, rows - 1)
                valid = ahead[: rows - 1] < torch.minimum(available, control[:1])
                ids = torch.cat([pending, torch.where(valid, draft, pending)])
            else:
                valid, ids = ahead[:0] > 0, pending
            block.build(length, ids)
            top = forward.fn(forward.input)  # the verify's packed Top of every row
            block.accept(length, ids, valid, top[:, 0].long())
            shown = torch.cat([ids[:1], torch.where(valid, ids[1:], -1)]).float()
            return torch.cat([top.reshape(-1), shown])

        control = torch.zeros(2, dtype=torch.long, device=cache.runner.device)
        return Program(run, control, cache.programs, forward.graphs)  # where the forward's layers can be captured

    return cache.programs.get(key(None, LOOKUP, rows, *ngrams), make)


class LookupSteps:
    """A run's prompt-lookup steps on the device (`lookup_program`), launched by the host, each before the one before
    it is read where the host's policy sizes it without that verdict (`methods.pld`).

    A step's row (its `Top` and drafted ids) is copied to a pinned host row right after its replay, as `PlainSteps`
    does (`readout.HostRows`): reading step t waits for step t alone, not for step t + 1. A step launched
    with the host's tokens (a chain's first, or after a read) first uploads what the device's history lacks of them."""

    def __init__(self, cache: StaticKVCache, ngrams: tuple[int, int]) -> None:
        self.cache, self.ngrams = cache, ngrams
        self.host = HostRows(cache.tokens.shape[1] * (width(VERIFY_TOP) + 1), cache.programs.device)
        self.synced = Synced(cache)

    def launch(self, size: int, tokens: list[int] | None) -> tuple[Top, Event | None, torch.Tensor]:
        """A step drafting up to `size` tokens from the device's history, or, given the run's `tokens` (the pending
        one last), from those. Returns its verdict as a host `Top` [rows, 3 k + 1], the event to wait for before
        reading it (None off CUDA) and the host view of the ids it drafted [rows] (read with the verdict: `check`)."""
        cache, rows = self.cache, bucket(1 + size)
        program = lookup_program(cache, rows, self.ngrams)
        host, event = replay(cache, program, (size, self.synced.sync(tokens, rows)), rows, self.host)
        tops = rows * width(VERIFY_TOP)
        return Top(host[:tops].view(rows, -1), VERIFY_TOP), event, host[tops:]


def check(drafted: list[float], tokens: list[int]) -> None:
    """After the step's read: the ids the device drafted (`LookupSteps.launch`'s view as read, -1 past the draft) are
    the host's draft `tokens`; else a one-line error (the step's verdict was of another draft)."""
    ids = [int(v) for v in drafted[1:] if v >= 0]
    if ids != tokens:
        raise SpecGUIError(f"the device's prompt lookup drafted {ids}, the host's {tokens}: a bug, please report it")


def warm_up(cache: StaticKVCache, ngrams: tuple[int, int], sizes: range) -> None:
    """Make (on CUDA: capture) the lookup programs of steps drafting up to any of `sizes` tokens, before any timed step
    (a method's `setup`, the cache still empty: what the captures write, at its first positions, the run's prompt
    forward and steps write over)."""
    with torch.inference_mode():
        for rows in sorted({bucket(1 + size) for size in sizes}):
            program = lookup_program(cache, rows, ngrams)
            if not program.ready:
                program.input.copy_(torch.tensor([0, 1]))  # a history of one token: reads and writes in place
                program.prepare()
                cache.inputs_for(rows).owner = None

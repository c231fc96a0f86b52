"""`pld`: prompt-lookup decoding (Saxena 2023), n-gram drafts copied from the context itself.

The last `n` tokens (n from `max_ngram` down to `min_ngram`) are looked up among earlier positions of
prompt + output; the tokens that followed their first occurrence become a chain draft. The first, as in
Saxena's reference code (and transformers' port): in input-grounded text the first occurrence is usually in
the prompt, where the continuation being copied lives, while a later one is often in the output itself (on
SmolLM2-135M's suite, 48 tokens, one prompt per category: 1.37x over baseline with the first, 1.34x with the
most recent).
No forward is spent on drafting, which makes it the cheapest check of the drafter interface and the
verifier end to end, and strong wherever output copies input (summaries, code edits). How many of the
found tokens to copy is the cost model's call (`specgui.methods.policy`): a verify of many tokens is
nearly free on a GPU and is not on a CPU, and a prompt that rarely repeats itself wants short drafts.

On the fast path under greedy decoding the device makes the lookup (`fastpath.LookupSteps`): the step's program finds
the n-gram in the tokens the step before left there, so that, pipelined, each step is launched before the one before
it is read and the device never waits for the host. The host then sizes a step's draft before it reads the verdict
before it (the plan is chosen beside the forward before, `after_launch`, from what the policy learnt up to the step
before that, and not cut to what the lookup found: the device cuts it), and looks the draft up itself at the step's
turn, for its event. The policy learns each verdict into the curve its plan was priced by (the regime two verdicts
back) and settles a paused step as paused. The serial loop sizes and launches alike, so both loops draft the same
under the same prices (pipelined, the cost model learns a step later: `decode.generate`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specgui import fastpath
from specgui.core.draft import Draft, Lookup, Outcome
from specgui.costs import time_ms
from specgui.methods.base import DecodeState, Drafter, register
from specgui.methods.params import param
from specgui.methods.policy import SizedParams


class NgramIndex:
    """First start position of every n-gram (n in [lo, hi]) that has a continuation."""

    def __init__(self, lo: int, hi: int) -> None:
        self.sizes = range(lo, hi + 1)
        self.table: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.done = {n: 0 for n in self.sizes}  # next start position to index, per n

    def update(self, tokens: list[int]) -> None:
        for n in self.sizes:
            table = self.table[n]
            for start in range(self.done[n], len(tokens) - n):
                table.setdefault(tuple(tokens[start : start + n]), start)
            self.done[n] = max(self.done[n], len(tokens) - n)

    def lookup(self, tokens: list[int], limit: int) -> tuple[list[int], int]:
        """Continuation (up to `limit` tokens) of the longest matching suffix, and that match's n."""
        for n in reversed(self.sizes):
            if len(tokens) <= n:
                continue
            start = self.table[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + limit], n
        return [], 0


@dataclass(frozen=True)
class PldParams(SizedParams):
    max_ngram: int = param(low=1, high=8, help="longest suffix n-gram to look up")
    min_ngram: int = param(low=1, high=8, help="shortest suffix n-gram to look up")
    num_draft: int = param(low=1, high=64, help="most tokens copied per draft (the cost model may copy fewer)")

    @property
    def ngrams(self) -> tuple[int, int]:
        """The n-gram sizes looked up, (shortest, longest), whichever way round the two bounds were given."""
        return min(self.min_ngram, self.max_ngram), max(self.min_ngram, self.max_ngram)


@register
class PromptLookup(Drafter):
    name = "pld"
    title = "Prompt lookup"
    summary = "Copies the continuation of the first earlier match of the last n-gram."
    Params = PldParams
    pauses_plainly = True  # a paused step drafts nothing (what its lookup found waits)

    def setup(self, state: DecodeState) -> None:
        self.lookup_ms = (state.profile.mechanism("pld.lookup", lambda: _lookup_ms(*self.params.ngrams))
                          if state.profile else 0.0)
        if state.unread:  # the device's lookup programs, made before any step is timed
            fastpath.lookup.warm_up(state.cache, self.params.ngrams, range(self.params.num_draft + 1))

    def begin(self, state: DecodeState) -> None:
        self.index = NgramIndex(*self.params.ngrams)
        self.policy = self.sizing(state, range(1, self.params.num_draft + 1))
        self.drafted, self.exhausted = 0, False
        self.on_device = state.unread  # the lookup made on the device, sized a step ahead (see the module docstring)

    def draft(self, state: DecodeState) -> Draft:
        if self.on_device:
            return self._device_draft(state)
        held = self.policy.paused_ahead()  # a pause served whole: nothing is looked up
        found, n = ([], 0) if held else self.index.lookup(state.tokens, min(self.params.num_draft, state.max_depth))
        if not found and not held:
            self.drafted = 0
            return Draft(info={"ngram": n}, cost_ms=self.lookup_ms)
        plan = self.policy.choose(lambda k: state.step_ms(self.lookup_ms, 1 + k), state.plain_ms(),
                                  None if held else len(found))
        tokens = found[: plan.size]
        self.drafted, self.exhausted = len(tokens), plan.size == len(found)
        return Draft(tokens=tokens, cost_ms=0.0 if held else self.lookup_ms,
                     info={"ngram": n, "plan": plan})

    def _pricing(self, state: DecodeState) -> tuple[Callable[[int], float], float]:
        """The prices of a lookup the device makes, sized before the lookup is known (`DraftPolicy.take`)."""
        return (lambda k: state.step_ms(self.lookup_ms, 1 + k)), state.plain_ms()

    def _room(self, room: int) -> int:
        """The most a lookup drafts with `room` tokens of the budget left."""
        return min(self.params.num_draft, max(0, room))

    def _device_draft(self, state: DecodeState) -> Draft:
        """The step's draft as the device makes it (`Lookup`), looked up here too for the step's event: the plan's
        size of the continuation found, which may be shorter (`exhausted`) or nothing."""
        plan = self.policy.take(functools.partial(self._pricing, state), self._room(state.max_depth))
        found, n = self.index.lookup(state.tokens, plan.size) if plan.size else ([], 0)
        self.drafted, self.exhausted = len(found), len(found) < plan.size
        return Draft(tokens=found, cost_ms=self.lookup_ms if plan.size else 0.0,
                     info={"ngram": n, "plan": plan}, device_draft=Lookup(plan.size, self.params.ngrams))

    def after_launch(self, state: DecodeState) -> None:
        if self.on_device:  # (this step emits at least one token: the next has that much less room)
            self.policy.plan_ahead(*self._pricing(state), self._room(state.max_depth - 1))

    def ahead(self, state: DecodeState) -> Draft | None:
        if self.on_device:
            planned = self.policy.next
            return Draft(device_draft=Lookup(planned[0].size, self.params.ngrams)) if planned is not None else None
        return super().ahead(state)

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        if not outcome.prefill:
            self.policy.learn(outcome.path, self.drafted, self.exhausted, len(outcome.emitted), outcome.priced)
        self.index.update(state.tokens)
        return {}


def _lookup_ms(lo: int, hi: int) -> float:
    """One lookup in the index of a 1024-token text (the mechanism's cost for the cost model)."""
    text = torch.randint(0, 1000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    index = NgramIndex(lo, hi)
    index.update(text)
    return time_ms(lambda: index.lookup(text, 8), torch.device("cpu"))

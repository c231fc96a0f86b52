"""`pld`: prompt-lookup decoding (Saxena 2023), n-gram drafts copied from the context itself.

The last `n` tokens (n from `max_ngram` down to `min_ngram`) are looked up among earlier positions of
prompt + output; the tokens that followed the most recent earlier occurrence become a chain draft.
No forward is spent on drafting, which makes it the cheapest check of the drafter interface and the
verifier end to end, and strong wherever output copies input (summaries, code edits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specgui.draft import Draft, Outcome
from specgui.methods.base import DecodeState, Drafter, register
from specgui.params import param


class NgramIndex:
    """Most recent start position of every n-gram (n in [lo, hi]) that has a continuation."""

    def __init__(self, lo: int, hi: int) -> None:
        self.sizes = range(lo, hi + 1)
        self.table: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.done = {n: 0 for n in self.sizes}  # next start position to index, per n

    def update(self, tokens: list[int]) -> None:
        for n in self.sizes:
            table = self.table[n]
            for start in range(self.done[n], len(tokens) - n):
                table[tuple(tokens[start : start + n])] = start
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
class PldParams:
    max_ngram: int = param(low=1, high=8, help="longest suffix n-gram to look up")
    min_ngram: int = param(low=1, high=8, help="shortest suffix n-gram to look up")
    num_draft: int = param(low=1, high=64, help="most tokens copied per draft")


@register
class PromptLookup(Drafter):
    name = "pld"
    title = "Prompt lookup"
    summary = "Copies the continuation of the latest earlier match of the last n-gram."
    Params = PldParams

    def begin(self, state: DecodeState) -> None:
        lo, hi = sorted((self.params.min_ngram, self.params.max_ngram))
        self.index = NgramIndex(lo, hi)

    def draft(self, state: DecodeState) -> Draft:
        tokens, n = self.index.lookup(state.tokens, min(self.params.num_draft, state.max_depth))
        return Draft(tokens=tokens, info={"ngram": n})

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        self.index.update(state.tokens)
        return {}

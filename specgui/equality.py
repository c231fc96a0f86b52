"""Greedy equality with baseline, and how a difference explains itself.

Lossless greedy decoding means a method's output equals `baseline`'s token for token. Verify forwards run
several tokens at once, and the same logits computed over another batch shape can differ in the last
bits, so where the baseline's top-1 and top-2 logits are within that noise either token is the model's
answer: such a divergence is a numerical near-tie, not a bug. Everything that compares two greedy runs
(the bench's tables, the app's verdict) asks `first_divergence`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NEAR_TIE = 1e-3  # float32 noise between two batch shapes, as a top-2 logit margin


@dataclass(frozen=True)
class Divergence:
    """Where two greedy runs first differ, and the baseline's top-1 minus top-2 logit margin there."""

    position: int
    baseline_token: int | None  # None: that run ended first
    method_token: int | None
    baseline_margin: float | None
    near_tie: bool


def first_divergence(method: Sequence[int], baseline: Sequence[int], baseline_margins: Sequence[float],
                     noise: float = NEAR_TIE) -> Divergence | None:
    """None when the token lists are equal; else the first position that differs (or where one ends)."""
    if list(method) == list(baseline):
        return None
    pos = next((i for i, (a, b) in enumerate(zip(method, baseline)) if a != b), min(len(method), len(baseline)))
    margin = baseline_margins[pos] if pos < len(baseline_margins) else None
    return Divergence(position=pos, baseline_token=baseline[pos] if pos < len(baseline) else None,
                      method_token=method[pos] if pos < len(method) else None, baseline_margin=margin,
                      near_tie=margin is not None and margin < noise)

"""`baseline`: plain autoregressive decoding on the same runner and KV cache, one token per forward.

It is the base `Drafter` unchanged (an empty draft every step), so the loop, cache and timing it uses
are exactly those the speculative methods use: speedups compare like with like.
"""

from specgui.core.draft import Draft
from specgui.methods.base import DecodeState, Drafter, register


@register
class Baseline(Drafter):
    name = "baseline"
    title = "Baseline"
    summary = "Plain autoregressive decoding: one target forward per token."

    def ahead(self, state: DecodeState) -> Draft:
        return Draft()

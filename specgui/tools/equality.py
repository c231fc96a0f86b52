"""Greedy equality with baseline, and how a difference explains itself.

Lossless greedy decoding means a method's output equals `baseline`'s token for token. Verify forwards run
several tokens at once, and the same logits computed over another batch shape differ in the last bits
(other kernels, other summation orders). Where the baseline's top-1 and top-2 logits are within that
noise, either token is the model's answer: such a divergence is a numerical near-tie, not a bug. How
large the noise is depends on the dtype and the hardware (fp32 on a CPU: ~1e-5; bf16 on a GPU, where a
logit of 16-32 moves in steps of 0.125: a few tenths), so `logit_noise` measures it on the model in
hand instead of assuming it. Everything that compares two greedy runs (the bench's tables, the app's
verdict) asks `first_divergence`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specgui import fastpath
from specgui.core.kvcache import KVCache
from specgui.core.runner import Runner

NEAR_TIE = 1e-3  # a fallback where nothing was measured: float32 noise of two batch shapes, with room
SIZES = (2, 4, 8, 16, 32, 64)  # block sizes whose first row is compared with a one-token forward
_MEASURED: weakref.WeakKeyDictionary[Runner, dict[bool, float]] = weakref.WeakKeyDictionary()


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
                      near_tie=margin is not None and margin <= noise)


def _tree_noise(runner: Runner, cache: KVCache | fastpath.StaticKVCache, block: list[int], n: int) -> float:
    """|logit difference| between tokens decoded one by one and the same tokens verified as a tree: each
    chain token followed by a sibling the later ones do not see (a tree verify's layout), over a cache the
    plain steps wrote. Beyond the first row's noise, this holds what keys computed in a batch and a
    sparse mask change, which is what a tree method's later tokens see."""
    k = len(block)
    plain = torch.stack([runner.forward(torch.tensor([t]), torch.tensor([n + i]), cache)[0]
                         for i, t in enumerate(block)])  # writes block's keys: positions n .. n + k - 1
    cache.crop(n)
    rows = 2 * k
    visible = torch.zeros(rows, rows, dtype=torch.bool)
    for i in range(k):
        visible[2 * i, [2 * j for j in range(i + 1)]] = True  # chain row i sees the chain up to itself
        visible[2 * i + 1, [2 * j for j in range(i + 1)] + [2 * i + 1]] = True  # its sibling: same, and itself
    tokens = [t for pair in zip(block, reversed(block)) for t in pair]
    positions = [n + i + d for i in range(k) for d in (0, 1)]
    tree = runner.forward(torch.tensor(tokens), torch.tensor(positions), cache.view(n), visibility=visible,
                          logits_rows=torch.arange(0, rows, 2))
    return float((tree - plain).abs().max())


def logit_noise(runner: Runner, prompts: Sequence[Sequence[int]], *, fast_path: bool = False) -> float:
    """The largest |logit difference| between a token's one-token forward and the same token as the first
    row of a multi-token forward (2 ... 64 tokens) over the same prefix, or as a row of a tree verify
    (`_tree_noise`), in the runner's dtype and on the
    path decoding takes (`fast_path`): how far two batch shapes disagree on this model and hardware.

    Each prompt is split in half: the first half is the prefix, the second (repeated as needed) the block.
    Measured once per runner and path; later calls return the first figure.
    """
    known = _MEASURED.setdefault(runner, {})
    if fast_path in known:
        return known[fast_path]
    noise = 0.0
    with torch.inference_mode():
        for ids in prompts:
            n = len(ids) // 2
            if n < 1:
                continue
            block = (list(ids[n:]) * SIZES[-1])[: SIZES[-1]]
            cache = fastpath.cache_for(runner, len(ids) + SIZES[-1]) if fast_path else KVCache()
            runner.forward(torch.tensor(ids[:n]), torch.arange(n), cache)
            alone = runner.forward(torch.tensor(block[:1]), torch.tensor([n]), cache.view(n))[0]
            for size in SIZES:
                first = runner.forward(torch.tensor(block[:size]), torch.arange(n, n + size), cache.view(n),
                                       logits_rows=slice(0, 1))[0]
                noise = max(noise, float((first - alone).abs().max()))
            noise = max(noise, _tree_noise(runner, cache, block[:8], n))
    known[fast_path] = noise
    return noise

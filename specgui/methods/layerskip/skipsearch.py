"""What SWIFT and Draft & Verify share to search skip sets by measurement instead of by hidden states.

Both papers treat the skip set as a 0/1 vector over sub-layers and score candidate vectors by running the
skipped model; `bayesopt` proposes vectors, this module turns them into `SkipPlan`s and scores them:

  * `SkipSpace`: the sub-layers a search may skip, in the papers' order (every attention, then every MLP),
    and the map between 0/1 vectors and `SkipPlan`s; random vectors with a fixed number of ones (SWIFT's
    k-subsets) or with a random density (a free search like Draft & Verify's).
  * `matchness`: SWIFT's score. The skipped model reads a stretch of text the full model already produced
    (teacher forcing, one forward over the whole stretch, the prefix's keys from the full model through a
    read-only view) and predicts each next token; the share it gets right is how often its drafts would
    be accepted. One forward of a few tens of tokens scores a candidate, so a search costs forwards, not
    generations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specgui.core.kvcache import KVCache
from specgui.core.runner import ATTN, MLP, Runner, SkipPlan
from specgui.core.vocab import DraftVocab


@dataclass(frozen=True)
class SkipSpace:
    """Searchable sub-layers: (layer, kind) pairs, attention ones first; vector i says whether unit i is skipped."""

    units: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, layers: range | list[int]) -> SkipSpace:
        layers = list(layers)
        return cls(tuple((layer, ATTN) for layer in layers) + tuple((layer, MLP) for layer in layers))

    def __len__(self) -> int:
        return len(self.units)

    def plan(self, x: np.ndarray) -> SkipPlan:
        chosen = [self.units[i] for i in np.flatnonzero(x)]
        return SkipPlan(attn=frozenset(layer for layer, kind in chosen if kind == ATTN),
                        mlp=frozenset(layer for layer, kind in chosen if kind == MLP))

    def vector(self, plan: SkipPlan) -> np.ndarray:
        return np.array([plan.skips(layer, kind) for layer, kind in self.units], dtype=np.uint8)

    def random_subsets(self, rng: np.random.Generator, count: int, size: int) -> np.ndarray:
        """`count` random vectors with exactly `size` ones (SWIFT's random search)."""
        out = np.zeros((count, len(self)), dtype=np.uint8)
        for row in out:
            row[rng.choice(len(self), size=size, replace=False)] = 1
        return out

    def random_vectors(self, rng: np.random.Generator, count: int, max_density: float) -> np.ndarray:
        """`count` random vectors, each with its own density drawn from [0, max_density]."""
        density = rng.uniform(0.0, max_density, size=(count, 1))
        return (rng.random((count, len(self))) < density).astype(np.uint8)


def matchness(runner: Runner, cache: KVCache, prefix: int, tokens: list[int], plan: SkipPlan,
              vocab: DraftVocab | None = None) -> tuple[int, int]:
    """(right, total): how many of `tokens[1:]` the skipped model predicts from the text before each, with the head
    its drafts use (the full one, or a draft vocabulary's part), choosing as its drafts choose (the head's `Top`, on
    the fast path computed in the forward's program: one read, no device work around it).

    `tokens` follow the first `prefix` cached positions; the cache is read, never grown.
    """
    if len(tokens) < 2:
        return 0, 0
    n = len(tokens) - 1
    top = runner.forward(np.asarray(tokens[:-1], dtype=np.int64), np.arange(prefix, prefix + n), cache.view(prefix),
                         skip=plan, vocab=vocab, top=2)
    chosen = top.packed[:, 0].tolist()
    return sum(int(c) == t for c, t in zip(chosen, tokens[1:])), n

"""Decoding settings and the one place logits become probabilities.

Target and draft distributions must be processed identically (temperature, then top-k, then top-p) or
speculative sampling stops being lossless, so every method calls `probabilities` from here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from specgui.errors import SpecGUIError


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise SpecGUIError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise SpecGUIError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecGUIError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecGUIError(f"top-k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator:
        """A generator seeded from `seed` (or fresh entropy), on the device where sampling happens."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen

    def to_dict(self) -> dict:
        return asdict(self)


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Rows of logits [..., V] -> the sampling distribution [..., V] (float32)."""
    logits = logits.float() / max(sampling.temperature, 1e-6)
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked above it already reach top_p; the top token always stays
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


GREEDY = Sampling()

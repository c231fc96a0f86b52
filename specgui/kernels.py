"""A CPU matmul shape choice, made by measurement, for the multi-token forwards speculative methods verify.

A linear layer over a few rows can be computed as `x @ W.T` (the stock kernel) or as `(W @ x.T).T`, and
which is faster depends on the CPU and its BLAS. On one development machine (MKL, 2 cores, fp32) the stock
kernel over 2-8 rows was *slower* than over one row, and the transposed form made a 4-token forward of
SmolLM2-135M cost 46 ms instead of 84-92 ms; on another (MKL, 2 cores, fp32, 2026-11-23) the transposed
form took 110 us against 32 us for two rows of a 576 x 1536 product and doubled every multi-token
forward. So neither is assumed: `install` times both forms on each distinct weight shape of the model at
load, for 2 ... 64 rows, and routes a product through the transposed form only for the row counts where
it measured faster. One-row products always keep the stock kernel.

It is installed on the model's own `nn.Linear` modules, so everything that runs the model benefits
alike, transformers' `generate` (and its prompt lookup) included: comparisons stay like for like.
`python -m specgui bench --small-batch-matmul off` measures without it.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterable

import torch
from torch import nn

MAX_ROWS = 64
PROBE_ROWS = (2, 3, 4, 6, 8, 12, 16, 32, 64)  # row counts timed; others take the nearest one below


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows not in self.transposed_rows:
        return nn.functional.linear(x, self.weight, self.bias)
    out = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def install(model: nn.Module, rows: Iterable[int] | None = None) -> int:
    """Route products of every plain CPU `nn.Linear` through the transposed form for the row counts where it
    measured faster on that weight's shape (or for `rows`, when given); return how many modules take it."""
    forced = frozenset(rows) if rows is not None else None
    chosen: dict[tuple[int, ...], frozenset[int]] = {}
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.device.type != "cpu" or hasattr(module, "_hf_hook"):
            continue
        shape = tuple(module.weight.shape)
        if shape not in chosen:
            chosen[shape] = forced if forced is not None else faster_rows(module.weight)
        if chosen[shape]:
            module.transposed_rows = chosen[shape]
            module.forward = types.MethodType(_linear, module)
            count += 1
    return count


def faster_rows(weight: torch.Tensor, repeats: int = 5) -> frozenset[int]:
    """Row counts in 2..MAX_ROWS for which `(W @ x.T).T` beat `x @ W.T` (median of `repeats`) on `weight`."""
    wins = []
    with torch.inference_mode():
        for n in PROBE_ROWS:
            x = torch.randn(n, weight.shape[1], dtype=weight.dtype)
            stock = _median_s(lambda x=x: x @ weight.t(), repeats)
            transposed = _median_s(lambda x=x: (weight @ x.t()).t(), repeats)
            wins.append(transposed < stock)
    return frozenset(r for r in range(2, MAX_ROWS + 1)
                     if wins[max(i for i, n in enumerate(PROBE_ROWS) if n <= r)])


def _median_s(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[repeats // 2]

"""A CPU matmul shape fix that makes multi-token verify forwards cheap.

On the development machine (MKL, 2 cores, fp32) a linear layer over 2-8 rows was *slower* than over one
row: `x @ W.T` with a small row count streams the weight matrix badly, so a whole 4-token forward of
SmolLM2-135M cost 84-92 ms against 53-56 ms for one token. Computing the same product as `(W @ x.T).T`
reads W once for all rows: 4 tokens then cost 46 ms, 8 tokens 66 ms, 32 tokens 107 ms (vs 127 ms).
One-token forwards keep the stock kernel (the transposed form is no faster there). Speculative methods
verify several tokens per forward, so this decides whether they can win on a CPU at all.

It is installed on the model's own `nn.Linear` modules, so everything that runs the model benefits
alike, transformers' `generate` (and its prompt lookup) included: comparisons stay like for like.
`python -m specgui bench --small-batch-matmul off` measures without it.
"""

from __future__ import annotations

import types

import torch
from torch import nn

MAX_ROWS = 64


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows < 2 or rows > MAX_ROWS:
        return nn.functional.linear(x, self.weight, self.bias)
    out = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def install(model: nn.Module) -> int:
    """Route small-batch products of every plain CPU `nn.Linear` through `_linear`; return how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and not hasattr(module, "_hf_hook"):
            module.forward = types.MethodType(_linear, module)
            count += 1
    return count


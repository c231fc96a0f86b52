"""Grouped-query attention of a few rows over a mask, without copying keys and values, on a CPU.

SmolLM2-135M has 9 query heads over 3 key/value heads. transformers' sdpa attention hands torch's kernel the grouping
itself only when there is no mask (a plain step); one query row with a mask it folds into the key heads. Every other
forward with a mask (a verify over 2+ rows, a tree, every fast-path forward over its static cache) first repeats the
keys and values to 9 heads: a copy of the layer's whole cache, three times over, in every layer of every verify. On a
CPU torch's kernel takes the grouping with a mask (`enable_gqa`): the same numbers within rounding (bit for bit on the
CPUs measured, which nothing leans on: rows of different forwards through torch's kernel agree only within rounding
anyway, `specgui/cpu/kernels.py`), and on an AMD EPYC (one thread) a 2-row forward of the embedded model over a
1024-token context fell from 90-100 ms to 74-77 (one row: 65-74 ms), 4 rows from 93-112 to 82-85.

On a CPU an fp32 Llama-shaped model's layers run in C (`specgui/cpu/layers.py`, with its own attention): what
reaches this is a long prompt's prefill, a bf16 model or layers of other shapes.

On a GPU a mask with `enable_gqa` may leave the fused kernels, which this machine cannot measure: there, and
for anything this does not cover (one row, no mask, a position bias, a paged cache), transformers' own
function runs, until a measurement says otherwise: `python -m specgui gpucheck` times both forms for a verify
on the device at hand and checks that their logits are equal (`grouped_on` switches a device type over).
It is installed on transformers' "sdpa" entry, for the whole process, so that transformers'
`generate` runs the same attention as SpecGUI's loop: comparisons stay like for like.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import PagedAttentionCache, sdpa_attention_forward

STOCK = sdpa_attention_forward
GROUPED_DEVICES = {"cpu"}  # device types on which `grouped` computes what it covers (measured faster and exact)


def install() -> None:
    """Route transformers' "sdpa" attention through `grouped` (idempotent)."""
    AttentionInterface.register("sdpa", grouped)


@contextlib.contextmanager
def grouped_on(device_type: str, enabled: bool) -> Iterator[None]:
    """Within: `grouped` computes (or, not `enabled`, leaves to transformers) the calls it covers on
    `device_type`, so that the two forms can be timed against each other on one device."""
    before = set(GROUPED_DEVICES)
    if enabled:
        GROUPED_DEVICES.add(device_type)
    else:
        GROUPED_DEVICES.discard(device_type)
    try:
        yield
    finally:
        GROUPED_DEVICES.clear()
        GROUPED_DEVICES.update(before)


def covered(module: nn.Module, query: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
    """Whether `grouped` computes this call itself: a device of `GROUPED_DEVICES`, grouped heads, a mask, 2+ rows,
    nothing else asked."""
    return (query.device.type in GROUPED_DEVICES and getattr(module, "num_key_value_groups", 1) > 1 and mask is not None
            and query.shape[2] > 1 and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions") and not isinstance(kwargs.get("cache"), PagedAttentionCache))


def grouped(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (same arguments, same [B, T, H, D] result), grouped heads uncopied where
    `covered`. With a mask, transformers never asks the kernel for its causal shortcut, nor does this."""
    if not covered(module, query, attention_mask, kwargs):
        return STOCK(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None

"""Grouped-query attention over a mask (`specgui.cpu.attention`): transformers' numbers within rounding, without the
copied keys and values, and what transformers' own generate runs too."""

import pytest
import torch
from torch import nn
from transformers import AttentionInterface

from helpers import rounding_bound, tiny_model
from specgui.cpu import attention


class Grouped(nn.Module):
    """What the attention functions read from a layer's attention module."""

    num_key_value_groups = 3
    is_causal = True


def assert_same_attention(ours: torch.Tensor, theirs: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, scaling: float) -> None:
    """Two attentions of the same q, k, v that may sum in other orders (grouped or repeated heads, another kernel
    blocking) differ by at most what the arithmetic allows: scores are sums of D products, each off by
    rounding_bound(D, scaling * sum|q k|); a softmax weight moves relatively by twice its score's error plus the
    rounding of exp, the normaliser's sum of C terms and the division; the output, a sum of C weighted values
    (weights summing to 1), by that times max|v| plus its own C-term rounding. Bit-equal on the CPUs measured, but
    no path leans on it: rows of other forwards through torch's kernel agree only within rounding anyway."""
    columns, dim = k.shape[-2], q.shape[-1]
    qf, kf, vf = (t.double().abs() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    score_terms = scaling * (qf @ kf.repeat_interleave(groups, 1).transpose(-1, -2))  # [1, H, T, C] sum|q k|
    score_error = rounding_bound(dim, score_terms.amax(-1))  # [1, H, T]
    u = torch.finfo(torch.float32).eps / 2
    relative = 2 * score_error + 2 * rounding_bound(columns, 1.0) + 6 * u
    bound = (relative * vf.amax((-1, -2)).repeat_interleave(groups, 1)[..., None]).transpose(1, 2)[..., None]
    if ours.dtype != torch.float32:  # each side rounds its result once to the narrower type
        bound = bound + torch.finfo(ours.dtype).eps * theirs.double().abs()
    gap = (ours.double() - theirs.double()).abs()
    assert bool((gap <= bound).all()), f"off by {float((gap - bound).max()):.3g} past the rounding bound"


def tensors(rows: int, columns: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 9, rows, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 3, columns, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(1, 1, rows, columns, generator=g) > 0.4
    mask[..., 0] = True  # every row sees something
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,columns", [(2, 40), (5, 300), (16, 16)])
def test_masked_rows_equal_transformers_within_rounding(rows, columns, dtype):
    q, k, v, mask = tensors(rows, columns, dtype)
    assert attention.covered(Grouped(), q, mask, {})
    ours, _ = attention.grouped(Grouped(), q, k, v, mask, scaling=0.25)
    theirs, _ = attention.STOCK(Grouped(), q, k, v, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (1, rows, 9, 16)
    assert_same_attention(ours, theirs, q, k, v, 0.25)


def test_what_it_does_not_cover_goes_to_transformers():
    q, k, v, mask = tensors(4, 20)
    one, *_ = tensors(1, 20)
    ungrouped = Grouped()
    ungrouped.num_key_value_groups = 1
    assert not attention.covered(Grouped(), q, None, {})  # no mask: transformers groups the heads itself
    assert not attention.covered(Grouped(), one, mask[..., :1, :], {})  # one row: folded into the key heads
    assert not attention.covered(ungrouped, q, mask, {})
    assert not attention.covered(Grouped(), q, mask, {"position_bias": torch.zeros(1)})
    assert not attention.covered(Grouped(), q.to("meta"), mask, {})  # not a CPU tensor
    ours, _ = attention.grouped(Grouped(), q, k, v, None)  # causal over the first rows, as transformers does
    theirs, _ = attention.STOCK(Grouped(), q, k, v, None)
    assert_same_attention(ours, theirs, q, k, v, 1 / 4)  # sdpa's own scale: 1 / sqrt(16)


def test_grouped_on_switches_a_device_type_for_a_measurement_and_restores_it():
    q, _, _, mask = tensors(4, 20)
    with attention.grouped_on("cpu", False):
        assert not attention.covered(Grouped(), q, mask, {})  # what gpucheck times as "stock" on a CPU
        with attention.grouped_on("meta", True):
            assert attention.covered(Grouped(), q.to("meta"), mask, {})
        assert not attention.covered(Grouped(), q.to("meta"), mask, {})
    assert attention.covered(Grouped(), q, mask, {}) and {"cpu"} == attention.GROUPED_DEVICES


def test_installed_for_every_model_so_transformers_generate_runs_it_too():
    lm = tiny_model(seed=3, cpu=False)  # its runner installs it (layers in C would not call attention at all)
    assert AttentionInterface._global_mapping["sdpa"] is attention.grouped
    calls = []
    original = attention.grouped

    def counting(*args, **kwargs):
        calls.append(args[1].shape[2])
        return original(*args, **kwargs)

    AttentionInterface.register("sdpa", counting)
    try:
        mask = torch.ones(1, 6, dtype=torch.long)
        lm.model.generate(torch.tensor([[1, 2, 3, 4, 5, 6]]), attention_mask=mask, max_new_tokens=3, do_sample=False)
    finally:
        AttentionInterface.register("sdpa", original)
    assert calls and calls[0] == 6  # the prompt's rows, then one row a step

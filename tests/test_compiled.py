"""Compiled programs (`specgui.fastpath.compiled`): the layer functions against transformers, the compiled fast path
against the eager one for every method, bf16's whole layer and units bit for bit.

Compiling on a CPU takes inductor's C++ backend seconds a graph; the tiny model's graphs are few (one per function
and row class) and land in the compile cache, so the module stays short after its first run on a machine."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers import needs_inductor, tiny_model
from specgui import fastpath, methods
from specgui.core import decode
from specgui.errors import SpecGUIError
from specgui.fastpath import compiled
from specgui.tools import gpucheck


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("by_hand", [False, True])
def test_layer_functions_equal_transformers_layers(arch, by_hand):
    """The whole-layer function over a static buffer, causal mask, both attention forms (torch's fused kernel, as on
    a CPU; grouped products by hand, as on CUDA), equals the model's own forward within float rounding: q/k/v biases
    (qwen2) and q/k norms (qwen3) included, three query heads to a key head."""
    lm = tiny_model(arch=arch, cpu=False, hidden=96)
    model, runner = lm.model, lm.runner
    if arch == "llama":  # more query heads per key head than the helper's two
        assert runner.config.num_attention_heads // runner.config.num_key_value_heads >= 2
    ids = torch.randint(0, runner.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    shape = compiled.shape_of(runner.config, by_hand)
    columns, t = 32, ids.shape[1]
    with torch.inference_mode():
        expected = model.model(ids).last_hidden_state
        h = runner.embed(ids)
        cos, sin = runner.rotary(h, torch.arange(t)[None])
        mask = torch.zeros(1, 1, t, columns, dtype=torch.bool)
        mask[0, 0, :, :t] = torch.ones(t, t, dtype=torch.bool).tril()
        for block in runner.layers:
            keys = torch.full((1, shape.kv_heads, columns, shape.head_dim), 0.0)
            values = torch.zeros_like(keys)
            h = compiled.layer(h, compiled.weights_of(block), keys, values, cos, sin, mask, torch.arange(t), shape)
        got = runner.norm(h)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4), (got - expected).abs().max()


def test_fused_weights_are_views_where_no_cpu_plan_holds_the_modules():
    lm = tiny_model(cpu=False)
    block = lm.runner.layers[0]
    weights = compiled.weights_of(block)
    assert block.self_attn.q_proj.weight.data_ptr() == weights.qkv.data_ptr()  # nothing held twice
    assert compiled.weights_of(block) is weights
    planned = tiny_model(cpu=True).runner.layers[0]
    assert planned.self_attn.q_proj.weight.data_ptr() != compiled.weights_of(planned).qkv.data_ptr()


def test_compile_modes():
    cpu = torch.device("cpu")
    assert compiled.resolve("auto", cpu) is False  # a CPU compiles only when asked
    assert compiled.resolve("off", cpu) is False
    assert compiled.with_path("off", "auto") == "auto"
    with pytest.raises(SpecGUIError, match="fast path"):
        compiled.with_path("off", "on")
    with pytest.raises(SpecGUIError, match="compile must be one of"):
        compiled.checked("sometimes")
    with pytest.raises(SpecGUIError, match="compile must be one of"):
        decode.run(tiny_model(), [1, 2, 3], max_new_tokens=2, fast_path="on", compile="yes")


@needs_inductor
def test_compiled_path_is_token_identical_to_the_eager_programs_for_every_method():
    """Every method on the compiled fast path gives plain decoding's tokens on that path, which are the eager fast
    path's (fp32, a model whose greedy choices stand far from ties), the methods drafting on the paper's schedule."""
    lm = tiny_model(init=0.3)
    ids = [1, 5, 9, 3, 7, 2, 11, 4, 1, 5, 9, 3, 7, 2]
    eager = decode.run(lm, ids, "baseline", max_new_tokens=20, fast_path="on", compile="off")
    plain = decode.run(lm, ids, "baseline", max_new_tokens=20, fast_path="on", compile="on")
    assert plain.events[0].compiled and not eager.events[0].compiled
    assert fastpath.stats(lm.runner)["compiled"]
    assert plain.token_ids == eager.token_ids
    drafted = 0
    for method in methods.names():
        got = decode.run(lm, ids, method, max_new_tokens=20, fast_path="on", compile="on",
                         params=gpucheck._drafting(method))
        assert got.token_ids == plain.token_ids, method
        drafted += got.summary.drafted
    assert drafted > 0


@needs_inductor
def test_in_bf16_the_compiled_layer_equals_its_two_units_bit_for_bit():
    """Plain programs run the whole-layer function, skip plans and recording variants its two units: in bf16 inductor
    would keep a fused intermediate in float32 where the units round it, and the layer-skip methods would leave plain
    decoding's tokens at near-ties (seen on an H200). Rounded as eager rounds, all three forms agree bit for bit.
    Compiled in a thread of its own after another compiled first (the settings are made once a thread: torch keeps
    them per thread, and a thread without them compiled without the casts)."""
    compiled.compiled("mlp")  # this thread's settings made here, as by an earlier compilation
    found: dict = {}
    worker = threading.Thread(target=lambda: found.update(bits=_whole_units_eager()))
    worker.start()
    worker.join()
    whole, whole_keys, units, unit_keys, eager = found["bits"]
    assert torch.equal(whole_keys, unit_keys)
    assert torch.equal(whole, units), (whole.float() - units.float()).abs().max()
    assert torch.equal(whole, eager)


def _whole_units_eager():
    """A bf16 layer's output and keys as the whole-layer function, its two units and eager compute them."""
    lm = tiny_model(cpu=False, hidden=96)
    block = lm.runner.layers[0]
    shape = compiled.shape_of(lm.runner.config, False)
    weights = compiled.LayerWeights(*(None if w is None else w.to(torch.bfloat16)
                                      for w in compiled.weights_of(block)))
    rows, columns = 5, 16
    gen = torch.Generator().manual_seed(3)
    h = (torch.randn(1, rows, 96, generator=gen) * 4).to(torch.bfloat16)
    cos, sin = (torch.randn(1, rows, shape.head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, rows, columns, dtype=torch.bool)
    index = torch.arange(rows) + 3

    def run(first, then=None):  # a whole layer, or an attention unit then an MLP unit
        keys = torch.randn(1, shape.kv_heads, columns, shape.head_dim, generator=torch.Generator().manual_seed(4))
        keys, values = keys.to(torch.bfloat16), keys.flip(-1).to(torch.bfloat16)
        out = first(h, weights, keys, values, cos, sin, mask, index, shape)
        return (out if then is None else then(out, weights, shape)), keys

    with torch.inference_mode():
        whole, whole_keys = run(compiled.compiled("layer"))
        units, unit_keys = run(compiled.compiled("attention"), compiled.compiled("mlp"))
        eager, _ = run(compiled.attention_unit, compiled.mlp_unit)
    return whole, whole_keys, units, unit_keys, eager

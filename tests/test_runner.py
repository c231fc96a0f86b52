"""The layer runner against `model.forward`, and the capabilities methods build on."""

import pytest
import torch

from helpers import assert_within_rounding, product_magnitude, rounding_bound, tiny_model
from specgui.core.kvcache import FrozenView, KVCache
from specgui.core.runner import ATTN, MLP, SkipPlan
from specgui.cpu import kernels
from specgui.errors import SpecGUIError


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_runner_matches_model_forward_incrementally(arch, attn):
    lm = tiny_model(arch=arch, attn=attn, seed=3)
    ids = torch.randint(0, 48, (12,))
    with torch.no_grad():
        reference = lm.model(ids[None]).logits[0]
        cache = KVCache()
        chunks = [(0, 5), (5, 6), (6, 9), (9, 12)]  # prefill, one token, then multi-token verify blocks
        got = torch.cat([lm.runner.forward(ids[a:b], torch.arange(a, b), cache) for a, b in chunks])
    assert torch.allclose(got, reference, atol=1e-5), (got - reference).abs().max()


def test_embedded_model_runner_matches_forward(embedded_lm):
    ids = torch.tensor(embedded_lm.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"])
    with torch.no_grad():
        reference = embedded_lm.model(ids[None]).logits[0, -3:]
        cache = KVCache()
        embedded_lm.runner.forward(ids[:-3], torch.arange(len(ids) - 3), cache)
        got = embedded_lm.runner.forward(ids[-3:], torch.arange(len(ids) - 3, len(ids)), cache)
    assert torch.allclose(got, reference, atol=1e-4), (got - reference).abs().max()


def test_skipping_sublayers_equals_zeroing_them(tiny_lm):
    """Skipping layer 1's attention and layer 2's MLP = running a model whose those outputs are zero."""
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    plan = SkipPlan(attn=frozenset({1}), mlp=frozenset({2}))
    layers = tiny_lm.runner.layers
    with torch.no_grad():
        got = tiny_lm.runner.forward(ids, torch.arange(8), KVCache(), skip=plan)
        saved = layers[1].self_attn.o_proj.weight.clone(), layers[2].mlp.down_proj.weight.clone()
        layers[1].self_attn.o_proj.weight.zero_()
        layers[2].mlp.down_proj.weight.zero_()
        try:
            reference = tiny_lm.model(ids[None]).logits[0]
        finally:
            layers[1].self_attn.o_proj.weight.copy_(saved[0])
            layers[2].mlp.down_proj.weight.copy_(saved[1])
    assert torch.allclose(got, reference, atol=1e-5)


def test_a_skipping_forward_runs_the_whole_layers_between_skips_as_one_call(tiny_lm, layer_calls):
    """Skipping layer 1's MLP: layer 0 and layers 2-3 run as C calls of whole layers, layer 1 as its attention
    sub-layer; the same logits bit for bit as every sub-layer on its own (an observer's path)."""
    calls = layer_calls
    plan = SkipPlan(mlp=frozenset({1}))
    ids = torch.tensor([3, 1, 4, 1, 5])
    with torch.no_grad():
        logits = []
        for observer in (None, lambda k, h: None):
            cache = KVCache()
            tiny_lm.runner.forward(ids[:4], torch.arange(4), cache)
            calls.clear()
            logits.append(tiny_lm.runner.forward(ids[4:], torch.tensor([4]), cache, skip=plan, observer=observer))
            if observer is None:
                assert calls == [1, 2]
    assert torch.equal(*logits)


def test_skipped_attention_leaves_that_layer_cache_short(tiny_lm):
    cache = KVCache()
    with torch.no_grad():
        tiny_lm.runner.forward(torch.tensor([1, 2, 3]), torch.arange(3), cache)
        tiny_lm.runner.forward(torch.tensor([4]), torch.tensor([3]), cache, skip=SkipPlan(attn=frozenset({2})))
    assert [cache.get_seq_length(i) for i in range(4)] == [4, 4, 3, 4]


def test_visibility_runs_independent_branches_in_one_forward(tiny_lm):
    """Two branches side by side with a block-diagonal mask = each branch run alone."""
    prefix, a, b = [5, 6, 7, 8], [9, 10, 11], [12, 13]
    with torch.no_grad():
        cache = KVCache()
        tiny_lm.runner.forward(torch.tensor(prefix), torch.arange(4), cache)
        visible = torch.zeros(5, 5, dtype=torch.bool)
        visible[:3, :3] = torch.ones(3, 3).tril().bool()
        visible[3:, 3:] = torch.ones(2, 2).tril().bool()
        positions = torch.tensor([4, 5, 6, 4, 5])  # both branches continue the same prefix
        both = tiny_lm.runner.forward(torch.tensor(a + b), positions, FrozenView(cache, 4), visibility=visible)
        alone_a = tiny_lm.runner.forward(torch.tensor(a), torch.arange(4, 7), FrozenView(cache, 4))
        alone_b = tiny_lm.runner.forward(torch.tensor(b), torch.arange(4, 6), FrozenView(cache, 4))
    assert torch.allclose(both, torch.cat([alone_a, alone_b]), atol=1e-5)
    assert cache.get_seq_length(0) == 4  # the frozen view wrote nothing


def test_a_pre_layer_that_names_its_layers_is_called_before_those_only(tiny_lm):
    """`layers` may name the final norm (num_layers); the layers between run as one piece, with the same result."""
    calls = []

    def hook(layer, h, step):
        calls.append(layer)
        return h

    hook.layers = {2, tiny_lm.runner.num_layers}
    with torch.no_grad():
        plain = tiny_lm.runner.forward(torch.tensor([1, 2]), torch.arange(2), KVCache())
        hooked = tiny_lm.runner.forward(torch.tensor([1, 2]), torch.arange(2), KVCache(), pre_layer=hook)
    assert calls == [2, tiny_lm.runner.num_layers]
    assert torch.equal(plain, hooked)


def test_observer_sees_every_sublayer_and_pre_layer_can_rewrite(tiny_lm):
    seen = []
    calls = []

    def pre_layer(layer, h, step):
        calls.append(layer)
        return h * 0 if layer == 3 else h  # wipe the stream before the last layer

    with torch.no_grad():
        tiny_lm.runner.forward(torch.tensor([1, 2]), torch.arange(2), KVCache(),
                               observer=lambda k, h: seen.append((k, h.shape)))
        wiped = tiny_lm.runner.forward(torch.tensor([1, 2]), torch.arange(2), KVCache(), pre_layer=pre_layer)
        fresh = tiny_lm.runner.forward(torch.tensor([7, 7]), torch.arange(2), KVCache(), pre_layer=pre_layer)
    assert [k for k, _ in seen] == list(range(0, 2 * 4 + 1))
    assert calls == [0, 1, 2, 3] * 2
    assert torch.allclose(wiped, fresh)  # after the wipe, the input no longer matters


def test_logits_rows_and_run_unit_kinds(tiny_lm):
    """The LM head over one row against the same row among four: bit for bit where the machine routes both row
    counts through the row-independent skinny form (what greedy identity leans on), else within the rounding of
    a sum over the hidden width (another BLAS shape, another summation order: 1.8e-7 apart on an Intel Xeon)."""
    ids = torch.tensor([4, 3, 2, 1])
    states = []
    with torch.no_grad():
        full = tiny_lm.runner.forward(ids, torch.arange(4), KVCache(), observer=lambda k, h: states.append(h))
        last = tiny_lm.runner.forward(ids, torch.arange(4), KVCache(), logits_rows=slice(3, 4))
        normed = tiny_lm.runner.norm(states[-1][0, 3:])
    head = tiny_lm.runner.lm_head
    if {getattr(head, "row_forms", ("stock",) * 5)[rows] for rows in (1, 4)} == {"skinny"}:
        assert torch.equal(full[3:], last)
    else:
        assert_within_rounding(full[3:], last, head.in_features, product_magnitude(normed, head.weight))
    assert (ATTN, MLP) == (0, 1)


def test_products_of_other_shapes_agree_within_the_derived_bound():
    """torch's kernel over one row and over that row among many (the LM head's shape): within the bound the
    summation's length gives, whatever this CPU's BLAS does, and the bound is tight enough to mean something (a
    perturbation of a thousandth of the magnitude fails it)."""
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(4096, 576, generator=generator), torch.randn(8, 576, generator=generator)
    together, alone = torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x[5:6], weight)
    magnitude = product_magnitude(x[5:6], weight)
    assert_within_rounding(together[5:6], alone, 576, magnitude)
    assert float(rounding_bound(576, magnitude).max()) < 1e-3 * float(magnitude.max())
    with pytest.raises(AssertionError, match="past the rounding bound"):
        assert_within_rounding(alone + 1e-3 * magnitude.float(), alone, 576, magnitude)


@pytest.mark.parametrize("form", kernels.available_forms())
def test_every_matmul_form_is_the_same_product(form):
    lm = tiny_model(seed=5)
    ids = torch.randint(0, 48, (9,))
    with torch.no_grad():
        reference = lm.model(ids[None]).logits[0]
        assert kernels.install(lm.model, forced=form) == {form: 4 * 7 + 1}  # q, k, v, o, gate, up, down, LM head
        cache = KVCache()
        got = torch.cat([lm.runner.forward(ids[:5], torch.arange(5), cache),
                         lm.runner.forward(ids[5:6], torch.arange(5, 6), cache),
                         lm.runner.forward(ids[6:], torch.arange(6, 9), cache)])
    assert torch.allclose(got, reference, atol=1e-5)


def test_skinny_rows_do_not_depend_on_the_rows_beside_them(skinny_build):
    """What makes a verify forward's rows equal plain steps' bit for bit: each row's product is summed in the
    same order whether it is computed alone or among 40 rows, odd widths (a K tail, a partial block) included.
    Every row count from 1 to 40 runs: each takes its own register tile or groups of rows, in blocks of the input
    width where it is wide (1100), and past a pass's rows (12 with AVX-512, 32 with AVX2) the rows go in passes."""
    torch.manual_seed(0)
    for n, k in [(200, 72), (37, 13), (64, 576), (30, 1100)]:
        linear = torch.nn.Linear(k, n)
        kernels.install(linear, forced="skinny")
        x = torch.randn(40, k)
        with torch.no_grad():
            together = linear(x)
            assert torch.allclose(together, torch.nn.functional.linear(x, linear.weight, linear.bias), atol=1e-4)
            for rows in range(1, 41):
                assert torch.equal(linear(x[:rows]), together[:rows])
            threads = torch.get_num_threads()
            torch.set_num_threads(2)  # other blocks per thread, the same sums
            try:
                assert torch.equal(linear(x), together)
            finally:
                torch.set_num_threads(threads)


def test_skinny_bfloat16_form_is_the_widened_product_row_by_row(skinny_build):
    """bf16 weights (a user's `--dtype bfloat16` on a CPU): each row is the fp32 product of the exactly widened
    weights rounded to bf16 once (within half a bf16 step of the exact product), whatever rows share the call;
    a bf16 model through the form matches transformers' forward."""
    torch.manual_seed(1)
    for n, k in [(200, 72), (37, 13), (30, 1100)]:
        linear = torch.nn.Linear(k, n).to(torch.bfloat16)
        kernels.install(linear, forced="skinny")
        x = torch.randn(40, k).to(torch.bfloat16)
        with torch.no_grad():
            together = linear(x)
            exact = x.double() @ linear.weight.double().T + linear.bias.double()
            assert together.dtype == torch.bfloat16
            assert ((together.double() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-5).all()
            for rows in range(1, 41):
                assert torch.equal(linear(x[:rows]), together[:rows])
            strided = x.t().contiguous().t()  # the same rows as a column-major view
            assert torch.equal(linear(strided), together)
    lm = tiny_model(seed=5)
    lm.model.to(torch.bfloat16)
    ids = torch.randint(0, 48, (9,))
    with torch.no_grad():
        reference = lm.model(ids[None]).logits[0]
        assert kernels.install(lm.model, forced="skinny") == {"skinny": 4 * 7 + 1}
        got = lm.model(ids[None]).logits[0]
    assert torch.allclose(got.float(), reference.float(), atol=0.05)


def test_skinny_int8_form_is_the_scaled_product_row_by_row(skinny_build):
    """Fractal's CPU int8 weights: scale[n] * (x . w_n) + bias[n] against a float64 reference, with the rows
    independent of each other as in the fp32 form (every row count 1-40, odd widths, both thread counts)."""
    generator = torch.Generator().manual_seed(1)
    for n, k in [(200, 72), (37, 13), (960, 576)]:
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        scale, bias = torch.rand(n, generator=generator) / 100, torch.randn(n, generator=generator)
        x = torch.randn(40, k, generator=generator)
        together = kernels.skinny_int8(x, weight, scale, bias)
        reference = (x.double() @ weight.double().T) * scale.double() + bias.double()
        assert torch.allclose(together.double(), reference, rtol=1e-5, atol=1e-5)
        unbiased = reference - bias.double()
        assert torch.allclose(kernels.skinny_int8(x, weight, scale, None).double(), unbiased, rtol=1e-5, atol=1e-5)
        for rows in range(1, 41):
            assert torch.equal(kernels.skinny_int8(x[:rows], weight, scale, bias), together[:rows])
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(kernels.skinny_int8(x, weight, scale, bias), together)
        finally:
            torch.set_num_threads(threads)


def test_the_vector_form_is_the_cpus_best_or_the_one_specgui_simd_names(monkeypatch):
    """`SPECGUI_SIMD` picks the skinny library's vector form (its own build: the flags are in its digest, so a cost
    profile and a kernel choice never cross forms); unset, the best this CPU has; a bad value is a one-line error."""
    try:
        monkeypatch.delenv("SPECGUI_SIMD", raising=False)
        kernels.reset()
        assert kernels.simd() == kernels.best_simd()
        monkeypatch.setenv("SPECGUI_SIMD", "sse9")
        kernels.reset()
        with pytest.raises(SpecGUIError, match="SPECGUI_SIMD='sse9' is not a vector form: use one of avx512, avx2"):
            kernels.simd()
        digests = {}
        for form in ("avx2", "avx512"):
            monkeypatch.setenv("SPECGUI_SIMD", form)
            kernels.reset()
            if not kernels.SIMD_NEEDS[form] <= kernels._cpu_flags():
                with pytest.raises(SpecGUIError, match=f"SPECGUI_SIMD={form}: this CPU lacks"):
                    kernels.simd()
                continue
            digests[form] = kernels._source_digest()
            assert kernels.simd() == form and kernels.simd_label() in ("avx2+fma", "avx512")
        assert len(set(digests.values())) == len(digests)
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_the_row_independent_form_is_kept_whatever_the_timings(monkeypatch):
    """Where skinny is offered it takes every row count even when another form times faster (rows must equal plain
    steps bit for bit on every machine); without it, the faster of the other two by measurement."""
    linear = torch.nn.Linear(8, 8)
    for times, want in (({"stock": 1.0, "transposed": 1.05, "skinny": 1.08}, "skinny"),
                        ({"stock": 1.0, "transposed": 1.3, "skinny": 2.0}, "skinny"),
                        ({"stock": 1.0, "transposed": 0.9}, "transposed"),
                        ({"stock": 1.0, "transposed": 1.1}, "stock")):
        monkeypatch.setattr(kernels, "_least_s", lambda passes, repeats, t=times: {f: t[f] for f in passes})
        assert set(kernels.choose([linear], tuple(times))[1:]) == {want}, times


def test_matmul_forms_are_chosen_by_measurement_and_saved(tmp_path, monkeypatch):
    """Without the skinny library (no C compiler) the forms are timed, once per machine and shape."""
    monkeypatch.setattr(kernels, "available_forms", lambda: ("stock", "transposed"))
    lm = tiny_model(seed=6, cpu=False)
    counts = kernels.install(lm.model, tmp_path)
    assert set(counts) <= set(kernels.available_forms()) and sum(counts.values()) >= 29
    tables = {m.row_forms for m in lm.model.modules() if hasattr(m, "row_forms")}
    assert all(len(t) == kernels.MAX_ROWS + 1 and set(t) <= set(kernels.available_forms()) for t in tables)
    assert len(list((tmp_path / "kernels").glob("choices-*.json"))) == 1

    def timed_again(*args, **kwargs):
        raise AssertionError("a saved choice was measured again")

    monkeypatch.setattr(kernels, "choose", timed_again)
    again = tiny_model(seed=6, cpu=False)
    assert kernels.install(again.model, tmp_path) == counts
    unrouted = tiny_model(cpu=False).model
    assert kernels.signature(again.model) == kernels.signature(lm.model) != kernels.signature(unrouted)

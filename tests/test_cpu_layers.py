"""The target's decoder layers as C calls on a CPU (`specgui.cpu.layers`): what transformers' modules compute, rows
independent of each other bit for bit (so speculative greedy decoding reproduces plain decoding exactly), and the
same code under transformers' own forward and `generate`."""

import pytest
import torch

from specgui.core import decode
from specgui.core.kvcache import FrozenView, KVCache
from specgui.core.runner import ATTN, MLP
from specgui.cpu import kernels
from specgui.cpu import layers as cpu_layers
from tests.helpers import tiny_model

pytestmark = pytest.mark.skipif(kernels.skinny_library() is None, reason="no C compiler or no AVX2 here")

IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7])
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("window", ["plain step", "causal rows", "tree", "frozen view", "no prefix"])
def test_layers_compute_what_the_modules_do(skinny_build, arch, window):
    """Logits and the keys left in the cache, against transformers' modules, over each kind of forward a run makes
    (on the AVX-512 and the AVX2 build)."""
    lm = tiny_model(arch=arch, seed=4)
    runner = lm.runner
    assert all(hasattr(layer, "cpu_plan") for layer in runner.layers)
    start = 0 if window == "no prefix" else 8
    rows = {"plain step": 1, "no prefix": 6}.get(window, 4)

    def run() -> tuple[torch.Tensor, KVCache]:
        cache = KVCache()
        if start:
            runner.forward(IDS[:start], torch.arange(start), cache)
        target = FrozenView(cache, start - 2) if window == "frozen view" else cache
        first = target.get_seq_length(0)
        logits = runner.forward(IDS[start : start + rows], torch.arange(first, first + rows), target,
                                visibility=TREE if window == "tree" else None)
        return logits, cache

    with torch.inference_mode():
        got, got_cache = run()
        with cpu_layers.suspended():
            want, want_cache = run()
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert got_cache.lengths == want_cache.lengths
    for layer in range(runner.num_layers):
        n = got_cache.lengths[layer]
        assert torch.allclose(got_cache.keys[layer][..., :n, :], want_cache.keys[layer][..., :n, :], atol=1e-4)
        assert torch.allclose(got_cache.values[layer][..., :n, :], want_cache.values[layer][..., :n, :], atol=1e-4)


def test_a_verify_row_equals_the_plain_step_bit_for_bit(skinny_build):
    """A tree verify's rows on an accepted path equal plain steps over that path exactly: each row sees its listed
    columns in order, whatever else the forward carries (a masked branch moves no other column's lane). The LM head
    takes the form this machine chose for it (`tiny_model` installs them as loading does): the row-independent
    skinny kernel wherever it builds, so the promise is checked with the machine's own forms, in each vector form
    the CPU runs (`skinny_build`: AVX-512 and AVX2)."""
    lm = tiny_model(seed=5)
    runner = lm.runner
    with torch.inference_mode():
        cache = KVCache()
        runner.forward(IDS[:9], torch.arange(9), cache)
        # rows: a (pos 9), b (child of a, pos 10), c (child of a, pos 10), d (child of c, pos 11); path a -> c -> d
        tree = runner.forward(IDS[9:13], torch.tensor([9, 10, 10, 11]), cache.view(9), visibility=TREE)
        steps = [runner.forward(IDS[i : i + 1], torch.tensor([p]), cache) for i, p in ((9, 9), (11, 10), (12, 11))]
        causal_cache = KVCache()
        runner.forward(IDS[:9], torch.arange(9), causal_cache)
        causal = runner.forward(IDS[9:13], torch.arange(9, 13), causal_cache)
    for row, step in zip((0, 2, 3), steps):
        assert torch.equal(tree[row], step[0])
    assert not torch.equal(causal[2], tree[2])  # c after a and b is another row: the check above is not vacuous


@pytest.mark.parametrize("hidden,rows", [(64, 20), (72, 20), (256, 20), (320, 20), (64, kernels.MAX_ROWS + 6)])
def test_long_rows_equal_plain_steps_and_the_modules(skinny_build, hidden, rows):
    """Over a prefix longer than a block of keys, 20 causal rows (each row's own columns a block and more) equal 20
    plain steps bit for bit and transformers' modules within rounding: scores taken a block of keys at a time sum
    as one key at a time does, wherever a block starts. Head widths 16, 18, 64 and 80 take every path of the
    value sums (whole spans of vectors, single vectors, a scalar tail). A verify wider than `kernels.MAX_ROWS` (the
    Lookahead paper's window verifies 120 rows) keeps the C layers and the skinny LM head too, where BLAS would
    round its rows by the product's shape."""
    lm = tiny_model(hidden=hidden, vocab=64, seed=6)  # the machine's own forms: the LM head skinny, row-independent
    runner, prefix = lm.runner, 37
    ids = torch.randint(0, 64, (prefix + rows,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = KVCache()
        runner.forward(ids[:prefix], torch.arange(prefix), cache)
        together = runner.forward(ids[prefix:], torch.arange(prefix, prefix + rows), cache.view(prefix))
        steps = torch.cat([runner.forward(ids[i : i + 1], torch.tensor([i]), cache)
                           for i in range(prefix, prefix + rows)])
        with cpu_layers.suspended():
            modules = runner.forward(ids[prefix:], torch.arange(prefix, prefix + rows), cache.view(prefix))
    assert torch.equal(together, steps)
    assert torch.allclose(together, modules, atol=1e-4), (together - modules).abs().max()


@pytest.mark.parametrize("window", ["causal rows", "tree", "scratch view", "view with live positions past it"])
def test_layers_as_one_call_equal_their_sub_layers(monkeypatch, layer_calls, window):
    """`Pass.run_layers` as one C call for all layers, and as one a layer, each writing the new keys and values into
    the cache's buffers itself, against the two sub-layer calls a layer with the cache's own update between them: the
    same states and the same cache, bit for bit. Where live positions lie past a view the cache has no room in place:
    nothing is written, the sub-layers run."""
    lm = tiny_model(seed=9)
    runner = lm.runner
    one_call = window != "view with live positions past it"

    def run(how: str, cache: KVCache) -> torch.Tensor:
        target = {"scratch view": cache.view(7, scratch=True), "view with live positions past it": cache.view(7)}
        target = target.get(window, cache)
        first = target.get_seq_length(0)
        step = runner.new_pass(torch.arange(first, first + 4), target, TREE if window == "tree" else None)
        h = runner.embed(IDS[9:13].view(1, -1))
        if how == "all":
            return step.run_layers(h, range(runner.num_layers))
        for layer in range(runner.num_layers):
            h = (step.run_layers(h, range(layer, layer + 1)) if how == "each"
                 else step.run_unit(step.run_unit(h, layer, ATTN), layer, MLP))
        return h

    calls = layer_calls
    with torch.inference_mode():
        caches = {how: KVCache() for how in ("units", "each", "all")}
        for cache in caches.values():
            runner.forward(IDS[:9], torch.arange(9), cache)
        calls.clear()
        split = run("units", caches["units"])
        if one_call:  # the sub-layers may not run
            monkeypatch.setattr(cpu_layers.CPlan, "attention", lambda *a: pytest.fail("a sub-layer ran"))
        got = {how: run(how, caches[how]) for how in ("each", "all")}
    assert calls == ([1] * runner.num_layers + [runner.num_layers] if one_call else [])
    for how, whole in got.items():
        cache, want_cache = caches[how], caches["units"]
        assert torch.equal(whole, split), how
        assert cache.lengths == want_cache.lengths
        for layer in range(runner.num_layers):
            for mine, want in ((cache.keys, want_cache.keys), (cache.values, want_cache.values)):
                n = max(cache.lengths[layer], 11 if window == "scratch view" else 0)  # a scratch pass writes past
                assert torch.equal(mine[layer][..., :n, :], want[layer][..., :n, :]), how


def test_transformers_forward_and_generate_run_the_layers():
    """The model's own forward (transformers' `generate` calls it) goes through the plans and agrees with the
    modules; greedy `generate` reproduces SpecGUI's baseline token for token."""
    lm = tiny_model(seed=6, init=0.3)
    calls = []
    plan = lm.runner.layers[0].cpu_plan
    original = plan.mlp
    plan.mlp = lambda h: calls.append(h.shape[1]) or original(h)
    with torch.inference_mode():
        got = lm.model(IDS.view(1, -1)).logits
        with cpu_layers.suspended():
            want = lm.model(IDS.view(1, -1)).logits
    assert calls == [len(IDS)]
    assert torch.allclose(got, want, atol=1e-4)
    ours = decode.run(lm, IDS[:6].tolist(), "baseline", max_new_tokens=12, fast_path="off").token_ids
    with torch.inference_mode():
        theirs = lm.model.generate(IDS[:6].view(1, -1), max_new_tokens=12, do_sample=False)[0, 6:].tolist()
    assert list(ours) == theirs
    assert len(calls) > 1  # the steps of `generate` ran the plan too


def test_a_moved_weight_is_read_where_it_now_lies():
    """A plan reads weights through their current addresses: replacing a weight's storage after install is seen."""
    lm = tiny_model(seed=7)
    proj = lm.runner.layers[1].self_attn.q_proj
    with torch.inference_mode():
        before = lm.model(IDS.view(1, -1)).logits
        proj.weight.data = proj.weight.data * 2  # new storage: the old address is gone
        after = lm.model(IDS.view(1, -1)).logits
        with cpu_layers.suspended():
            want = lm.model(IDS.view(1, -1)).logits
    assert not torch.allclose(before, after)
    assert torch.allclose(after, want, atol=1e-4)


@pytest.mark.parametrize("case", ["qwen3", "bfloat16", "eager"])
def test_layers_of_another_kind_keep_their_modules(case):
    """q/k norms (Qwen3), bf16 weights and eager attention (float masks) get no plan: their modules run."""
    if case == "qwen3":
        lm = tiny_model(arch="qwen3", cpu=False)
    elif case == "eager":
        lm = tiny_model(attn="eager", cpu=False)
    else:
        lm = tiny_model(cpu=False)
        lm.model.to(torch.bfloat16)
    assert cpu_layers.install(lm.model) == 0
    assert cpu_layers.signature(lm.model) == "modules"


def test_a_long_prompt_runs_the_modules_and_as_long_a_verify_the_layers(monkeypatch):
    """More than `PROMPT_ROWS` rows that see no cached column (a prompt, through SpecGUI's loop or transformers' own
    forward) run the modules, where BLAS is faster; as many rows over a cached prefix (a verify, whose rows must equal
    plain steps bit for bit) and a shorter prompt run the C layers."""
    lm = tiny_model(seed=8)
    verdicts: list[tuple[int, bool]] = []
    runs = cpu_layers.CPlan.runs

    def spy(self, h, mask):
        verdicts.append((h.shape[1], runs(self, h, mask)))
        return verdicts[-1][1]

    monkeypatch.setattr(cpu_layers.CPlan, "runs", spy)
    long, short = cpu_layers.PROMPT_ROWS + 6, cpu_layers.PROMPT_ROWS
    ids = torch.arange(2 * long) % 40
    with torch.inference_mode():
        cache = KVCache()
        lm.runner.forward(ids[:long], torch.arange(long), cache)
        assert {v for v in verdicts} == {(long, False)}
        verdicts.clear()
        lm.runner.forward(ids[long:], torch.arange(long, 2 * long), cache)
        assert {v for v in verdicts} == {(long, True)}
        verdicts.clear()
        lm.runner.forward(ids[:short], torch.arange(short), KVCache())
        lm.model(ids[:long].view(1, -1))
    assert {v for v in verdicts} == {(short, True), (long, False)}


def test_rows_past_the_limit_run_the_modules():
    """A prefill longer than `kernels.MAX_ROWS` runs transformers' modules (the C products are for a few rows)."""
    lm = tiny_model(seed=8)
    ids = torch.arange(kernels.MAX_ROWS + 6) % 40
    with torch.inference_mode():
        got = lm.runner.forward(ids, torch.arange(len(ids)), KVCache())
        with cpu_layers.suspended():
            want = lm.runner.forward(ids, torch.arange(len(ids)), KVCache())
    assert torch.equal(got, want)

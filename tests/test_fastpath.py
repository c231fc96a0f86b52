"""The fast path (static cache, buckets, device-side inputs, programs) against the eager runner.

On a CPU a program is its function called on its static buffers, so these tests check everything the GPU
runs except the CUDA graph capture itself; the CUDA tests at the end check that too where a GPU exists.
"""

import contextlib
import gc
import weakref

import numpy as np
import pytest
import torch

from helpers import assert_greedy_identical, baseline_run, cuda, flat_profile, on_cuda, tiny_model
from specgui import fastpath, methods
from specgui.core import decode
from specgui.core.kvcache import KVCache
from specgui.core.runner import ATTN, SkipPlan
from specgui.errors import SpecGUIError
from specgui.fastpath.inputs import BucketInputs
from specgui.methods.layerskip.skipdp import HiddenRecorder

SPECULATIVE = [name for name in methods.names() if name != "baseline"]
TINY_PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_forwards_match_model_forward(arch):
    """Bucketed forwards (5 -> 8, 1, 3 -> 4, 70 -> 128) over one cache; every program was made at warm-up,
    none while decoding."""
    lm = tiny_model(arch=arch, seed=3)
    ids = torch.randint(0, 48, (82,))
    with torch.inference_mode():
        reference = lm.model(ids[None]).logits[0]
        cache = fastpath.cache_for(lm.runner, 100)
        made = set(cache.programs.by_key)
        chunks = [(0, 5), (5, 6), (6, 9), (9, 79), (79, 82)]
        got = torch.cat([lm.runner.forward(ids[a:b], torch.arange(a, b), cache) for a, b in chunks])
    assert torch.allclose(got, reference, atol=1e-5), (got - reference).abs().max()
    assert cache.lengths == [82] * 4 and sorted(cache.inputs) == list(fastpath.BUCKETS)
    # per bucket: the forward, the same ending in a verify's head, its recording variant and the keeper (moves accepted
    # keys); at one row, plain decoding's chained step, a draft chain's start and every sub-layer
    assert set(cache.programs.by_key) == made and len(made) == 4 * len(fastpath.BUCKETS) + 2 + 2 * 4


def test_masks_pad_rows_that_see_only_themselves():
    visible = torch.tensor([[True, False], [True, True]])
    block = torch.eye(4, dtype=torch.bool)  # padded as `BucketInputs.load` pads: a padded row sees itself
    block[:2, :2] = visible
    m = fastpath.masks(torch.tensor([[3], [2]]), torch.tensor([[3], [8]]), block, 12)
    assert m.shape == (2, 4, 12)
    # layer 0: prefix 0..2, then the block at 3 (causal), padded rows 2, 3 at columns 5, 6 see only themselves
    assert m[0, 0].nonzero().view(-1).tolist() == [0, 1, 2, 3]
    assert m[0, 1].nonzero().view(-1).tolist() == [0, 1, 2, 3, 4]
    assert m[0, 2].nonzero().view(-1).tolist() == [0, 1, 2, 5]
    assert m[0, 3].nonzero().view(-1).tolist() == [0, 1, 2, 6]
    # layer 1 (a read-only pass): prefix 0..1, its block in the scratch region at 8
    assert m[1, 1].nonzero().view(-1).tolist() == [0, 1, 8, 9]
    assert m[1, 3].nonzero().view(-1).tolist() == [0, 1, 11]
    assert not m[0, :, 7:].any() and not m[1, :, 2:8].any()  # nothing outside the prefix and the block


def test_a_bucket_packed_over_earlier_passes_uploads_what_a_fresh_one_uploads(tiny_lm):
    """A bucket's uploads are packed into staging buffers over what an earlier pass left there (`BucketInputs.load`):
    after passes of other sizes, visibilities and ids, the upload and what its builder makes equal a fresh bucket's
    from that pass alone."""
    cache = fastpath.cache_for(tiny_lm.runner, 64)
    n = len(cache.lengths)

    def load(inputs, t, seed):
        g = np.random.default_rng(seed)
        visible = np.tril(g.random((t, t)) < 0.6) | np.eye(t, dtype=bool)
        tokens = g.integers(-1, 40, t) if seed % 2 else None
        inputs.load(object(), np.arange(10, 10 + t), g.integers(0, 9, n), g.integers(9, 20, n), visible, tokens)

    with torch.inference_mode():
        for sizes in ([7, 3], [2, 8, 5, 1], [8, 8, 4, 6, 2], [3, 3]):
            inputs, fresh = cache.inputs_for(8), BucketInputs.empty(cache, 8)
            for seed, t in enumerate(sizes):
                load(inputs, t, seed)
            load(fresh, sizes[-1], len(sizes) - 1)
            for a, b in zip(*[(x.builder.input, x.positions, x.mask, x.live, x.index) for x in (inputs, fresh)]):
                assert torch.equal(a, b)


def test_read_only_views_write_scratch_and_see_what_a_dynamic_view_sees(tiny_lm):
    """Two branches in one forward over a view = the same over KVCache's view, and the cache is unchanged."""
    prefix, tokens = [5, 6, 7, 8], [9, 10, 11, 12, 13]
    visible = torch.zeros(5, 5, dtype=torch.bool)
    visible[:3, :3] = torch.ones(3, 3).tril().bool()
    visible[3:, 3:] = torch.ones(2, 2).tril().bool()
    positions = torch.tensor([4, 5, 6, 4, 5])
    with torch.inference_mode():
        eager, static = KVCache(), fastpath.cache_for(tiny_lm.runner, 16)
        for cache in (eager, static):
            tiny_lm.runner.forward(torch.tensor(prefix), torch.arange(4), cache)
        want = tiny_lm.runner.forward(torch.tensor(tokens), positions, eager.view(4), visibility=visible)
        got = tiny_lm.runner.forward(torch.tensor(tokens), positions, static.view(4), visibility=visible)
    assert torch.allclose(got, want, atol=1e-5)
    assert static.lengths == [4] * 4


def test_observers_get_copies_that_outlive_the_next_run(tiny_lm):
    ids = torch.tensor([3, 1, 4, 1, 5])
    plan = SkipPlan(attn=frozenset({1}))
    recorded = []
    with torch.inference_mode():
        for cache in (KVCache(), fastpath.cache_for(tiny_lm.runner, 16)):
            recorder = HiddenRecorder()
            tiny_lm.runner.forward(ids, torch.arange(5), cache, observer=recorder, skip=plan)
            tiny_lm.runner.forward(ids[:2], torch.arange(5, 7), cache)  # runs the same programs again
            recorded.append(torch.stack([recorder.row(r) for r in range(5)]))
    assert torch.allclose(recorded[0], recorded[1], atol=1e-5)


def test_one_cache_per_runner_reused_emptied_and_grown(tiny_lm):
    first = fastpath.cache_for(tiny_lm.runner, 40)
    with torch.inference_mode():
        tiny_lm.runner.forward(torch.tensor([1, 2, 3]), torch.arange(3), first)
    again = fastpath.cache_for(tiny_lm.runner, 100)
    assert again is first and again.lengths == [0] * 4  # programs keep their buffers: no new capture
    bigger = fastpath.cache_for(tiny_lm.runner, first.capacity)
    assert bigger is not first and bigger.capacity >= first.capacity + fastpath.SLACK


def test_a_forward_that_does_not_fit_is_a_clear_error(tiny_lm):
    cache = fastpath.cache_for(tiny_lm.runner, 8)
    with pytest.raises(SpecGUIError, match="capacity"), torch.inference_mode():
        tiny_lm.runner.forward(torch.zeros(cache.capacity + 1, dtype=torch.long), torch.arange(cache.capacity + 1),
                               cache)


def test_resolve_picks_the_path():
    lm = tiny_model()
    assert fastpath.resolve("auto", lm.runner) is False  # a CPU: eager is faster here
    assert fastpath.resolve("on", lm.runner) is True and fastpath.resolve("off", lm.runner) is False
    with pytest.raises(SpecGUIError, match="must be one of"):
        fastpath.resolve("fast", lm.runner)
    with pytest.raises(SpecGUIError, match="sdpa"):
        fastpath.resolve("on", tiny_model(attn="eager").runner)


@pytest.mark.parametrize("method", SPECULATIVE)
def test_every_method_is_token_identical_on_the_fast_path(tiny_lm, method):
    """Greedy on the fast path = greedy baseline on the eager runner (tiny model, fp32)."""
    results = assert_greedy_identical(tiny_lm, method, TINY_PROMPTS, 40, fast_path="on")
    assert all(r.events[0].fast_path for r in results)


@pytest.mark.parametrize("method", methods.names())
def test_every_method_is_token_identical_on_the_fast_path_on_the_embedded_model(embedded_lm, suite, method):
    """Two held-out prompts (code, summarization), 32 tokens: fast path against the eager baseline (fixed draft
    sizes, so a hand-made profile prices the runs: the fast path's own is measured on the tiny models)."""
    rows = [next(r for r in suite if r.category == c) for c in ("code", "summarization")]
    prompts = [r.encode(embedded_lm.tokenizer) for r in rows]
    assert_greedy_identical(embedded_lm, method, prompts, 32, fast_path="on", min_accepted=0,
                            profile=flat_profile(embedded_lm, True))


# -- on a GPU ------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("method", methods.names())
def test_cuda_graphs_are_token_identical_in_fp32(method):
    lm = on_cuda(tiny_model(seed=3))
    assert_greedy_identical(lm, method, TINY_PROMPTS, 40, fast_path="on", min_accepted=0)
    cache = fastpath.cache_for(lm.runner, 8)
    assert cache.programs.by_key and all(p.graph is not None for p in cache.programs.by_key.values())


@cuda
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="one CUDA GPU here")
@pytest.mark.parametrize("method", ["baseline", "pld", "clasp", "fractal"])
def test_a_model_on_another_gpu_than_the_current_one_orders_its_own_copies(method):
    """Pinned rows, staging buffers and clock marks are ordered by events on the stream of the model's device: a model
    on the last GPU while the current device is the first decodes pipelined (its chained steps read through those
    events) exactly as plain decoding does."""
    last = f"cuda:{torch.cuda.device_count() - 1}"
    assert torch.cuda.current_device() == 0
    lm = on_cuda(tiny_model(seed=3), device=last)
    assert_greedy_identical(lm, method, TINY_PROMPTS, 40, fast_path="on", min_accepted=0)


@cuda
def test_cuda_graph_verify_of_many_tokens_costs_about_one():
    """The premise of speculative decoding on a GPU: a 32-token forward costs < 2x a 1-token forward."""
    lm = on_cuda(tiny_model(hidden=512, layers=8, vocab=1024), dtype=torch.bfloat16)
    cache = fastpath.cache_for(lm.runner, 256)
    with torch.inference_mode():
        lm.runner.forward(torch.arange(64) % 1000, torch.arange(64), cache)
        times = {}
        for t in (1, 32):
            for _ in range(3):  # capture, then warm replays
                lm.runner.forward(torch.ones(t, dtype=torch.long), torch.arange(64, 64 + t), cache.view(64))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                lm.runner.forward(torch.ones(t, dtype=torch.long), torch.arange(64, 64 + t), cache.view(64))
            end.record()
            end.synchronize()
            times[t] = start.elapsed_time(end) / 20
    assert times[32] < 2 * times[1], times


def test_baseline_helper_is_the_eager_reference(tiny_lm):
    """The equality tests above compare with `baseline_run`, which must itself run eagerly."""
    assert baseline_run(tiny_lm, TINY_PROMPTS[0], 8).events[0].fast_path is False
    assert decode.run(tiny_lm, TINY_PROMPTS[0], "baseline", max_new_tokens=8, fast_path="on").token_ids == \
        baseline_run(tiny_lm, TINY_PROMPTS[0], 8).token_ids


# -- right by construction: held outputs, memory, long prompts, quantized targets -------------------------


FRACTAL_PAST_LAYER_0 = {"layers": "1,3", "window": 3, "policy": "fixed"}


@pytest.mark.parametrize("method", methods.names())
def test_every_method_is_identical_when_every_program_call_poisons_every_other_output(tiny_lm, method):
    """Under `overwrite_check` an output kept across another program call turns into NaN: a method that
    holds one (Fractal's splice past layer 0, CLaSp's search states) would change its tokens."""
    params = FRACTAL_PAST_LAYER_0 if method == "fractal" else None
    with fastpath.overwrite_check():
        assert_greedy_identical(tiny_lm, method, TINY_PROMPTS, 24, fast_path="on", params=params, min_accepted=0)


def test_the_overwrite_check_catches_a_held_output(tiny_lm):
    """The check itself: an output held across a later program call is NaN inside it, intact outside."""
    cache = fastpath.cache_for(tiny_lm.runner, 16)
    with torch.inference_mode():
        tiny_lm.runner.forward(torch.tensor([1, 2, 3]), torch.arange(3), cache)
        for check, poisoned in ((False, False), (True, True)):
            step = tiny_lm.runner.new_pass(torch.tensor([3]), cache.view(3))
            with fastpath.overwrite_check() if check else contextlib.nullcontext():
                held = step.run_unit(torch.ones(1, 1, 64), 0, ATTN)
                step.run_unit(torch.ones(1, 1, 64), 1, ATTN)
                assert bool(held.isnan().all()) is poisoned


def test_the_overwrite_check_covers_programs_made_after_others(tiny_lm):
    """A skip plan's forward is made when a method adopts it, after warm-up: its output is poisoned by an earlier
    program's call, and an earlier program's by its call."""
    runner = tiny_lm.runner
    cache = fastpath.cache_for(runner, 16)
    plan = SkipPlan(attn=frozenset({1}), mlp=frozenset({2}))
    with torch.inference_mode():
        runner.forward(torch.tensor([1, 2, 3]), torch.arange(3), cache)
        fastpath.adopt(cache, plan)
        for first, then in ((plan, None), (None, plan)):
            with fastpath.overwrite_check():
                held = runner.new_pass(torch.tensor([3]), cache.view(3)).whole_forward(torch.tensor([5]), first)
                assert not held.isnan().any()
                runner.new_pass(torch.tensor([3]), cache.view(3)).whole_forward(torch.tensor([5]), then)
                assert held.isnan().all()


@pytest.mark.parametrize("c_layers", [True, False], ids=["c-layers", "modules"])
@pytest.mark.parametrize("method", ["baseline", "pld", "admg", "clasp", "swift", "fractal", "lookahead"])
def test_nan_in_every_unused_key_value_slot_changes_no_token(method, c_layers, monkeypatch):
    """Attention reads every column of the static cache under a mask, and a masked weight of 0 times NaN is NaN: a
    NaN or Inf left in scratch, stale or padded slots must reach no token. Every slot is unused when a run starts.
    Through the C layers and through transformers' modules and torch's attention kernel (what a GPU runs)."""
    tiny_lm = tiny_model(seed=0, cpu=c_layers)
    params = FRACTAL_PAST_LAYER_0 if method == "fractal" else {"policy": "fixed"} if method != "baseline" else None
    clean = [decode.run(tiny_lm, p, method, max_new_tokens=16, fast_path="on", params=params).token_ids
             for p in TINY_PROMPTS]
    made = fastpath.cache_for

    def poisoned(runner, needed):
        cache = made(runner, needed)
        with torch.inference_mode():
            for buffer in (*cache.keys, *cache.values):
                buffer.fill_(float("nan"))
        return cache

    monkeypatch.setattr(fastpath, "cache_for", poisoned)
    assert [decode.run(tiny_lm, p, method, max_new_tokens=16, fast_path="on", params=params).token_ids
            for p in TINY_PROMPTS] == clean


def test_fractal_drafts_on_the_fast_path_are_its_eager_drafts(tiny_lm):
    """The spliced forwards' pieces and compressed passes as programs, the lower passes writing in place after their
    window as the eager path's do (a kept-slot redo reads them there), the guesses read with the step's read: every
    step drafts the tokens the eager path drafts. (Each step its own draft forward: carrying, the fast path's greedy
    steps draft on the device, restarting a broken chain otherwise, `fastpath.SlotSteps`.)"""
    for prompt in TINY_PROMPTS:
        runs = [decode.run(tiny_lm, prompt, "fractal", max_new_tokens=24, fast_path=mode,
                           params={**FRACTAL_PAST_LAYER_0, "carry": False}).steps for mode in ("off", "on")]
        drafts = [[(s.draft_tokens, s.payload.get("origin")) for s in steps] for steps in runs]
        assert drafts[0] == drafts[1] and any(s.draft_tokens for s in runs[0])


@pytest.mark.parametrize("method", ["fractal", "clasp", "selfdraft"])
def test_methods_that_hold_states_are_identical_under_the_overwrite_check_on_the_embedded_model(
        embedded_lm, suite, method):
    rows = [next(r for r in suite if r.category == "code")]
    params = {"layers": "6,14,22", "window": 4, "policy": "fixed"} if method == "fractal" else None
    with fastpath.overwrite_check():
        assert_greedy_identical(embedded_lm, method, [r.encode(embedded_lm.tokenizer) for r in rows], 16,
                                fast_path="on", params=params, min_accepted=0, profile=flat_profile(embedded_lm, True))


@pytest.mark.parametrize("fast_path", ["on", "off"])
def test_dropping_a_model_frees_it_and_its_fast_path(fast_path):
    """A model switch must free the old model, its static cache and every captured graph."""
    lm = tiny_model(seed=5)
    decode.run(lm, TINY_PROMPTS[0], "pld", max_new_tokens=8, fast_path=fast_path)
    model, cache = weakref.ref(lm.model), weakref.ref(lm.runner.static_cache or lm.runner)
    del lm
    gc.collect()
    assert model() is None and cache() is None


def test_a_long_prompt_runs_as_bucketed_chunks_identical_to_the_eager_runner():
    """A 300-token prompt: prefilled as chunks of the largest bucket (no eager [rows, L, C] masks), the
    same logits and the same tokens as the eager path, and no program made outside warm-up."""
    lm = tiny_model(seed=7, vocab=64)
    prompt = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = fastpath.cache_for(lm.runner, 340)
    made = set(cache.programs.by_key)
    recorded = []
    with torch.inference_mode():
        for c in (KVCache(), cache):
            recorder = HiddenRecorder()
            recorded.append((lm.runner.forward(torch.tensor(prompt), torch.arange(300), c, observer=recorder),
                             recorder.row(299)))
    assert torch.allclose(recorded[0][0], recorded[1][0], atol=1e-5)
    assert torch.allclose(recorded[0][1], recorded[1][1], atol=1e-5)  # observers see every row once
    assert set(cache.programs.by_key) == made
    for method in ("baseline", "pld"):
        fast = decode.run(lm, prompt, method, max_new_tokens=24, fast_path="on")
        assert fast.token_ids == baseline_run(lm, prompt, 24).token_ids


def test_warm_up_makes_every_bucket_once_and_pieces_on_demand():
    runner = tiny_model(seed=4).runner
    cache = fastpath.cache_for(runner, 16)
    count = len(cache.programs.by_key)
    # per bucket the whole forward, the same ending in a verify's head, its recording variant and the keeper; at one
    # row plain decoding's chained step, a draft chain's start and each sub-layer alone (what costs times)
    assert fastpath.stats(runner)["programs"] == count == 4 * len(fastpath.BUCKETS) + 2 + 2 * 4
    fastpath.warm_up(cache)
    assert len(cache.programs.by_key) == count  # a second warm-up is free
    standins = tiny_model(seed=9).runner.layers
    fastpath.warm_up(cache, [(standins, range(2, 4)), (None, range(0, 2))])
    assert len(cache.programs.by_key) == count + 2 * len(fastpath.BUCKETS)
    fastpath.warm_up(cache, [(standins, range(2, 4))])
    assert len(cache.programs.by_key) == count + 2 * len(fastpath.BUCKETS)


def test_measuring_a_profile_makes_one_cache_and_only_its_warm_up_programs():
    """On a GPU a program costs a capture (a device synchronisation and an emptied allocator cache): measuring the
    cost profile on the fast path once made 992 on the embedded model (a cache per context, every sub-layer at
    every bucket), which outlasted a whole GPU check. One cache, its warm-up's programs and nothing more."""
    from specgui import costs

    lm = tiny_model(seed=6)
    made = []
    real = fastpath.StaticKVCache.__init__

    def spy(self, *args, **kwargs):
        made.append(self)
        real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpath.StaticKVCache, "__init__", spy)
        costs.measure(lm, True, run=decode.run)
    assert len(made) == 1 and lm.runner.static_cache is made[0]
    layers = lm.runner.num_layers
    # (2: plain decoding's chained step, a draft chain's start)
    assert fastpath.stats(lm.runner)["programs"] == 4 * len(fastpath.BUCKETS) + 2 + 2 * layers


def test_bitsandbytes_targets_never_get_graphs():
    """bitsandbytes' int8 linears read values on the host: auto leaves the fast path off for them."""
    bnb = pytest.importorskip("bitsandbytes")
    lm = tiny_model(seed=2)
    layer = lm.model.model.layers[0].mlp
    q = bnb.nn.Linear8bitLt(layer.up_proj.in_features, layer.up_proj.out_features, bias=False,
                            has_fp16_weights=False)
    layer.up_proj = q
    runner = type(lm.runner)(lm.model)
    assert runner.capturable is False and fastpath.resolve("auto", runner) is False


def test_a_run_never_takes_a_profile_of_the_other_path(tiny_lm):
    from specgui import costs

    eager = costs.profile_for(tiny_lm, False)
    with pytest.raises(SpecGUIError, match="eager"):
        decode.run(tiny_lm, TINY_PROMPTS[0], "baseline", max_new_tokens=4, fast_path="on", profile=eager)


@pytest.mark.parametrize("dtype", [torch.long, torch.float64])
def test_a_programs_control_values_go_through_staging_buffers_of_its_own(dtype):
    """`Program.send`: the host's values land in the program's input, as its dtype, through two staging buffers used
    in turn and made once (no array, tensor or pinned block a launch), each holding what it was last packed with."""
    table = fastpath.program.Programs(tiny_model().runner)
    program = fastpath.Program(lambda x: x * 2, torch.zeros(3, dtype=dtype), table, capturable=False)
    sent = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    for values in sent:
        program.send(values)
        assert program.input.tolist() == list(values) and program().tolist() == [2 * v for v in values]
    assert program.input.dtype == dtype and len(program.staging.arrays) == 2
    assert [a.tolist() for a in program.staging.arrays] == [list(sent[2]), list(sent[1])]

"""Fractal: layer placement, the slot chain rules, the splice's exactness, the compressed copy's quality
and cost, payloads, and the bitsandbytes path (on CPU here; on CUDA where a GPU exists).

Losslessness with the presets is covered for every method by tests/test_lossless.py; here the same
checks run with the settings the presets do not use (separate draft forwards, w != n, explicit layers).
"""

import dataclasses
import random
import statistics

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import CharTokenizer, assert_greedy_identical, assert_sampling_lossless, tiny_model
from specgui import fastpath, methods
from specgui.core import decode
from specgui.core.draft import SlotChain
from specgui.core.events import Prefill
from specgui.core.kvcache import FrozenView, KVCache
from specgui.core.runner import ATTN, MLP, Pass, Runner
from specgui.core.sampling import GREEDY
from specgui.cpu import kernels
from specgui.cpu import layers as cpu_layers
from specgui.errors import SpecGUIError
from specgui.fastpath.slots import standing
from specgui.methods.base import DecodeState
from specgui.methods.fractal.compress import (
    CompressedLayer,
    Fp8Linear,
    Int8WeightOnlyLinear,
    TorchInt8Linear,
    compressed_copy,
)
from specgui.methods.fractal.fractal import (
    Fractal,
    Splice,
    consistent_chain,
    fractal_positions,
    origins,
    per_token_acceptance,
)
from specgui.methods.ngram.pld import NgramIndex
from specgui.model.loading import LoadedModel, ModelSpec

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]


def fractal_params(**overrides):
    return methods.params_for("fractal", "tiny", "cpu", overrides)


# -- placement and chain rules --------------------------------------------------------------------------


def test_positions_default_to_the_papers_quarter_at_a_uniform_gap():
    assert fractal_positions(28, fractal_params(num_fractal=0, first=0.0, layers="")) == [0, 4, 8, 12, 16, 20, 24]
    assert fractal_positions(30, fractal_params(num_fractal=3, first=0.5, layers="")) == [15, 20, 25]
    assert fractal_positions(4, fractal_params(num_fractal=9, first=0.0, layers="")) == [0, 1, 2, 3]  # clamped
    # a deep start moves up where n layers would not fit after it, on any depth of model
    assert fractal_positions(30, fractal_params(num_fractal=2, first=0.9, layers="")) == [27, 28]
    assert fractal_positions(4, fractal_params(num_fractal=2, first=0.9, layers="")) == [2, 3]
    assert fractal_positions(30, fractal_params(layers="12, 3,3")) == [3, 12]


@pytest.mark.parametrize("layers", ["4", "-1", "a,b", ","])
def test_explicit_positions_outside_the_model_are_refused(layers):
    with pytest.raises(SpecGUIError):
        fractal_positions(4, fractal_params(layers=layers))


def test_chain_keeps_slot_predictions_while_slots_hold_what_the_chain_predicts():
    # slot 0 holds the bonus 5, slot 1 holds 6 = slot 0's prediction, slot 2 holds 0 != slot 1's 7
    assert consistent_chain(5, [5, 6, 0, 8], [6, 7, 8, 9]) == [6, 7]
    assert consistent_chain(5, [4, 6], [6, 7]) == []  # slot 0 guessed another token: nothing follows
    assert consistent_chain(5, [5, 6], [6, 7]) == [6, 7]


@pytest.mark.parametrize("seed", range(3))
def test_the_devices_cut_of_a_carried_chain_is_the_hosts(seed):
    """`fastpath.slots.standing`, the fixed-shape chain rule of a carried step on the device, keeps the slots'
    predictions `consistent_chain` keeps, over random small-vocabulary slots (where agreements are frequent)."""
    rng = random.Random(seed)
    for _ in range(200):
        w = rng.randint(1, 5)
        bonus, held, predicted = rng.randint(0, 2), [rng.randint(0, 2) for _ in range(w)], [rng.randint(0, 2)
                                                                                           for _ in range(w)]
        stands = standing(torch.tensor([bonus]), torch.tensor(held), torch.tensor(predicted)).tolist()
        assert stands == sorted(stands, reverse=True)  # a prefix
        assert predicted[: sum(stands)] == consistent_chain(bonus, held, predicted)


@pytest.mark.parametrize(("restart", "held"), [(False, [4, 5, 9]), (True, [4, 5, 1])])
def test_a_carried_step_on_the_device_drafts_verifies_and_accepts_as_the_host_would(tiny_lm, restart, held):
    """One carried step's program (`fastpath.slots.slot_program`) over a hand-set carry: the slots before predicted
    [5, 1, 7] holding `held` after the pending token 4, so the chain [5, 1] stands ([5, 1, 7] where slot 2 held 1;
    none on a restart). Its block is [pending, the chain's 3 tokens, 3 slots] with the slots after the standing chain
    (positions, and the tokens they start from: what followed the text + chain's longest n-gram where it occurred
    before, as `NgramIndex` finds it); the standing rows' verdicts are a plain forward's over the same tokens; what it
    accepts is the greedy rule's over those verdicts, written to the history with the target's own token, and what
    it leaves to carry is its slots' last guesses, the target's predictions at them and whether all that stood was
    accepted."""
    runner, prompt = tiny_lm.runner, PROMPTS[0]  # ...4, 5, 1, 2, 3, 4: the pending token 4
    drafter = methods.create("fractal", runner, "tiny", GREEDY, {"num_fractal": 2, "window": 3, "first": 0.0})
    cache = fastpath.cache_for(runner, 64)
    state = DecodeState(runner, cache, list(prompt), len(prompt), GREEDY, None, 16, static=True)
    c, w, size = len(prompt) - 1, 3, 3
    with torch.inference_mode():
        drafter.setup(state)
        drafter.begin(state)
        runner.forward(np.asarray(prompt[:-1]), np.arange(c), cache)
        cache.carried[: 2 * w + 1] = torch.tensor([*held, 5, 1, 7, 1])
        chain = SlotChain(size, w, (1, 4), restart, drafter.programs[1 + size])
        top, _, accepted, values = fastpath.SlotSteps(cache).launch(chain, list(prompt))
        stood = 0 if restart else len(consistent_chain(4, held, [5, 1, 7]))
        assert values[:1 + size].tolist() == [stood, 5, 1, 7]
        text = prompt + [5, 1, 7][:stood]
        index = NgramIndex(1, 4)
        index.update(text)
        found, _ = index.lookup(text, w)
        starts = found + [text[-1]] * (w - len(found))
        rows = 1 + size + w
        assert cache.tokens[0, :rows].tolist() == [4, 5, 1, 7, *starts]
        positions = cache.inputs_for(fastpath.bucket(rows)).positions[0, :rows].tolist()
        assert positions == [c, c + 1, c + 2, c + 3, *range(c + stood + 1, c + stood + 1 + w)]
        eager = KVCache()
        runner.forward(torch.tensor(prompt[:-1]), torch.arange(c), eager)
        plain = runner.forward(torch.tensor(text[c:]), torch.arange(c, c + 1 + stood), eager)
    best = top.ids[:, 0].long().tolist()
    assert best[: 1 + stood] == plain.argmax(-1).tolist()
    assert torch.allclose(top.packed[: 1 + stood, top.k], plain.max(-1).values, atol=1e-4)  # the top-1 logits
    took = next((j for j in range(stood) if [5, 1, 7][j] != best[j]), stood)
    assert int(accepted[0]) == took
    assert int(cache.cursor) == len(prompt) + took + 1
    assert cache.history[len(prompt) : len(prompt) + took + 1].tolist() == [*[5, 1, 7][:took], best[took]]
    guesses = values[1 + size :].view(2, w)[-1].long().tolist()  # the last fractal layer's
    assert cache.carried[: 2 * w + 1].tolist() == [*guesses, *best[1 + size : 1 + size + w], int(took == stood)]


def test_the_prior_is_the_papers_per_token_acceptance_at_its_own_layer_count():
    """The paper's N + 0.74 accepted per verification was observed at N = 7 (6.74 of 7 drafts, the target's token
    included): about 0.99 a token, which the chain's geometric sum gives back."""
    p = Fractal.paper_acceptance
    assert sum(p**i for i in range(1, 8)) == pytest.approx(6.74, abs=1e-6)
    assert 0.98 < p < 1.0
    assert per_token_acceptance(1.75, 2) == pytest.approx(0.5 * (-1 + 8**0.5), abs=1e-9)  # p + p^2 = 1.75


def test_origin_is_the_fractal_layer_from_which_a_slot_guess_stopped_changing():
    guesses = [[5, 1, 1], [5, 6, 2], [5, 6, 7]]  # slot guesses at fractal layers 0, 10, 20
    # draft [5, 6, 7, 8] starts in slot 0; 8 lies beyond the slots: only the final head proposed it
    assert origins([5, 6, 7, 8], 1, guesses, [0, 10, 20], 30) == [0, 10, 20, 30]
    # a carried chain starts one slot later; 9 was never a slot guess
    assert origins([6, 9], 2, guesses, [0, 10, 20], 30) == [10, 30]


# -- the splice -----------------------------------------------------------------------------------------


def test_splice_changes_only_slot_rows_and_leaves_the_cache_as_found(tiny_lm):
    """Exact rows of a spliced forward equal those of a plain forward over the same tokens."""
    runner = tiny_lm.runner
    drafter = methods.create("fractal", runner, "tiny", GREEDY, {"num_fractal": 2, "window": 3, "first": 0.0})
    prompt = torch.tensor(PROMPTS[0])
    block = torch.tensor([9, 10, 11, 12, 12, 12])  # 3 exact rows, then 3 slots (copies of the anchor)
    c = len(prompt)
    with torch.inference_mode():
        cache = KVCache()
        runner.forward(prompt, torch.arange(c), cache)
        plain = runner.forward(block, torch.arange(c, c + 6), FrozenView(cache, c))
        splice = Splice(drafter.plan, cache, c, exact=3, anchor_position=c + 2)
        spliced = runner.forward(block, torch.arange(c, c + 6), cache, pre_layer=splice)
    assert torch.allclose(spliced[:3], plain[:3], atol=1e-6)
    assert not torch.allclose(spliced[3:], plain[3:], atol=1e-3)  # the slots did change
    assert len(splice.slot_tokens()) == 2 and all(len(g) == 3 for g in splice.slot_tokens())
    assert all(cache.get_seq_length(i) == c + 6 for i in range(runner.num_layers))  # only the main stream wrote


def test_a_lower_pass_that_goes_on_from_the_one_before_is_the_full_pass_bit_for_bit(tiny_lm, monkeypatch):
    """A lower pass whose leading slots hold the tokens the previous one ran takes their states and keys below the
    previous fractal layer (`Splice._kept`): every slot kept, none, and the first kept, against full passes at every
    fractal layer; the forward's logits and the cache's keys and values come out the same."""
    runner = tiny_lm.runner
    drafter = methods.create("fractal", runner, "tiny", GREEDY, {"layers": "1,2,3", "window": 3})
    comp = drafter.plan.compressed
    prompt, block = torch.tensor(PROMPTS[0]), torch.tensor([9, 10, 11, 11, 11])  # 2 exact rows, 3 slots
    c = len(prompt)
    sequence = [[4, 5, 6], [4, 5, 6], [4, 7, 8]]  # the slot guesses at fractal layers 1, 2, 3
    head = comp.logits

    def run(full: bool) -> tuple[torch.Tensor, KVCache, Splice]:
        guesses = iter(sequence)
        monkeypatch.setattr(comp, "logits", lambda h, vocab=None: torch.nn.functional.one_hot(
            torch.tensor(next(guesses)), head(h).shape[-1]).float())
        if full:
            monkeypatch.setattr(Splice, "_kept", lambda self, g: 0)
        cache = KVCache()
        with torch.inference_mode():
            runner.forward(prompt, torch.arange(c), cache)
            splice = Splice(drafter.plan, cache, c, exact=2, anchor_position=c + 1)
            out = runner.forward(block, torch.arange(c, c + 5), cache, pre_layer=splice)
        monkeypatch.undo()
        return out, cache, splice

    kept, kept_cache, splice = run(full=False)
    full, full_cache, _ = run(full=True)
    assert splice.reused == 2 and splice.slot_tokens() == sequence
    assert torch.equal(kept, full)
    for layer in range(runner.num_layers):  # the slots' scratch keys included
        for mine, want in ((kept_cache.keys, full_cache.keys), (kept_cache.values, full_cache.values)):
            assert torch.equal(mine[layer][..., : c + 5, :], want[layer][..., : c + 5, :])


def test_slots_whose_guesses_match_the_tokens_they_start_from_keep_the_targets_own_states(tiny_lm, monkeypatch):
    """Slots that start from tokens (`held`) the fractal layers go on guessing are never run through the copy: their
    rows come out as a plain forward over those tokens computes them; from the first slot guessed otherwise, the
    copy's lower pass replaces the rows as before."""
    runner = tiny_lm.runner
    prompt, exact, held = torch.tensor(PROMPTS[0]), [9, 10], [4, 5, 6]
    c, rows = len(prompt), len(exact) + len(held)

    def run(layers: str, sequence: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, Splice]:
        drafter = methods.create("fractal", runner, "tiny", GREEDY, {"layers": layers, "window": 3})
        comp = drafter.plan.compressed
        head = comp.logits
        guesses = iter(sequence)
        monkeypatch.setattr(comp, "logits", lambda h, vocab=None: torch.nn.functional.one_hot(
            torch.tensor(next(guesses)), head(h).shape[-1]).float())
        cache = KVCache()
        block = torch.tensor(exact + held)
        with torch.inference_mode():
            runner.forward(prompt, torch.arange(c), cache)
            plain = runner.forward(block, torch.arange(c, c + rows), FrozenView(cache, c))
            splice = Splice(drafter.plan, cache, c, exact=len(exact), anchor_position=c + 1, held=held)
            out = runner.forward(block, torch.arange(c, c + rows), cache, pre_layer=splice)
        monkeypatch.undo()
        return out, plain, splice

    out, plain, splice = run("1,2", [held, held])
    assert splice.reused == 2 and torch.allclose(out, plain, atol=1e-6)
    out, plain, splice = run("2", [[4, 7, 8]])  # the first slot kept, the others guessed anew
    assert torch.allclose(out[:3], plain[:3], atol=1e-6)
    assert not torch.allclose(out[3:], plain[3:], atol=1e-3)


def test_a_deep_fractal_layers_pass_is_priced_by_the_rows_each_part_runs(tiny_lm):
    """Layer i's pass runs the forward's rows through the copy's layers i..L-1 and the slots through 0..i-1: of a
    4-layer model, layer 0's pass costs a whole pass over the rows, layer 2's half of one over the rows and half of
    one over the slots (whole passes timed at 3 and 5 rows, here 3 and 5 ms: a whole pass over r rows costs r)."""
    drafter = methods.create("fractal", tiny_lm.runner, "tiny", GREEDY, {"layers": "0,2", "window": 2})
    drafter.pass_rows, drafter.pass_contexts, drafter.pass_ms = (3, 5), (128, 128), [[3.0, 5.0], [3.0, 5.0]]
    state = dataclasses.make_dataclass("State", ["committed"])(committed=100)
    assert drafter._passes_ms(state, 5) == pytest.approx(5.0 + (2 * 5.0 + 2 * 2.0) / 4)


def test_draft_forward_leaves_the_cache_holding_the_committed_prefix(tiny_lm):
    runner = tiny_lm.runner
    drafter = methods.create("fractal", runner, "tiny", GREEDY, {"carry": False, "num_fractal": 2, "window": 2})
    state = DecodeState(runner, KVCache(), [*PROMPTS[1], 3], len(PROMPTS[1]), GREEDY, None, max_new_tokens=20)
    with torch.inference_mode():
        runner.forward(torch.tensor(PROMPTS[1]), torch.arange(state.committed), state.cache)
        drafter.setup(state)
        drafter.begin(state)
        draft = drafter.draft(state)
    assert [state.cache.get_seq_length(i) for i in range(runner.num_layers)] == [state.committed] * runner.num_layers
    assert 1 <= len(draft) <= 3 and draft.extras is None
    assert len(draft.info["origin"]) == len(draft) and draft.info["source"] == "draft forward"


# -- losslessness beyond the presets --------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    {"carry": False, "num_fractal": 2, "window": 2},
    {"carry": True, "num_fractal": 1, "window": 4},
    {"carry": True, "layers": "1,3", "window": 2},
    {"carry": False, "num_fractal": 3, "window": 1, "first": 0.5},
    {"carry": True, "num_fractal": 2, "window": 2, "draft_vocab": 16},  # slot guesses among 16 ids + the text's
])
def test_greedy_identical_with_other_schedules(tiny_lm, params):
    assert_greedy_identical(tiny_lm, "fractal", PROMPTS, max_new_tokens=40, params=params)


def test_sampling_with_separate_draft_forwards_keeps_target_distribution():
    lm = tiny_model(vocab=12, layers=3, hidden=32, init=0.5, seed=1)
    prompt = [5, 3, 8, 1, 0, 11, 7, 2, 9, 4, 6, 10, 5, 3, 8, 1]
    assert_sampling_lossless(lm, "fractal", prompt, runs=1500, params={"carry": False, "num_fractal": 2, "window": 2})


# -- payloads -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("carry", [True, False])
def test_payload_names_layers_origins_and_the_time_split(tiny_lm, carry):
    # fixed sizes: with the cost policy a noisy profile may pause drafting, and no chain is carried then
    params = {"carry": carry, "num_fractal": 2, "window": 2, "first": 0.0, "policy": "fixed"}
    result = decode.run(tiny_lm, PROMPTS[0], "fractal", max_new_tokens=30, params=params)
    prefill = next(e for e in result.events if isinstance(e, Prefill))
    assert prefill.payload["fractal_layers"] == [0, 2]
    assert prefill.payload["backend"] == compressed_copy(tiny_lm.runner)[0].backend  # what "auto" measured cheapest
    sources = set()
    for step in result.steps:
        payload = step.payload
        assert payload["fractal_layers"] == [0, 2]
        assert len(payload["origin"]) == step.drafted
        assert set(payload["origin"]) <= {0, 2, tiny_lm.runner.num_layers}
        if step.drafted:
            sources.add(payload["source"])
        spliced = payload.get("source") == "draft forward" or step.forward_tokens > 1 + step.drafted  # slots rode
        assert spliced == ("cost_ratio" in payload)
        if spliced:
            assert payload["compressed_ms"] > 0 and payload["target_ms"] > 0 and payload["cost_ratio"] > 0
            # the compressed time is the upper passes' (guessing: always run) and the lower ones' (re-embedding:
            # none where every slot kept its tokens, `Splice._kept`)
            assert payload["upper_ms"] > 0 and payload["lower_ms"] >= 0
            assert payload["upper_ms"] + payload["lower_ms"] == pytest.approx(payload["compressed_ms"])
            assert 0 <= payload["slots_started_right"] <= 2 * payload["lower_reused"] + 2
    assert sources == ({"carried", "draft forward"} if carry else {"draft forward"})


# -- the compressed copy --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compressed_layer_computes_what_the_original_does(arch, attn):
    """With uncompressed linears the fused copy equals the transformers layer, sub-layer by sub-layer."""
    lm = tiny_model(arch=arch, attn=attn, seed=2)
    runner = lm.runner
    copies = [CompressedLayer(layer, make=lambda linear: linear) for layer in runner.layers]
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    with torch.inference_mode():
        cache = KVCache()
        runner.forward(ids[:6], torch.arange(6), cache)
        step = Pass(runner, torch.arange(6, 10), FrozenView(cache, 6), None)
        h = runner.embed(ids[6:].view(1, -1))
        for layer in range(runner.num_layers):
            for kind in (ATTN, MLP):
                want = step.run_unit(h, layer, kind)
                got = step.run_unit(h, layer, kind, module=copies[layer])
                assert torch.allclose(got, want, atol=1e-5), (arch, layer, kind, (got - want).abs().max())
                h = want


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("window", ["growing", "frozen", "frozen with live keys past it", "scratch", "tree"])
def test_fused_compressed_pass_computes_what_the_modules_do(skinny_build, arch, window):
    """The int8 copy's layers as C calls (`specgui.cpu.layers`, through each copy's plan) against the same copy's torch
    modules: the pass's output and what it leaves in the cache, over every kind of cache window a Fractal pass uses
    (on the AVX-512 and the AVX2 build)."""
    lm = tiny_model(arch=arch, seed=3)
    runner = lm.runner
    comp, _ = compressed_copy(runner, "int8-weight-only")
    assert comp.fused
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)

    def run() -> tuple[torch.Tensor, KVCache, int]:
        cache = KVCache()
        runner.forward(ids[:8], torch.arange(8), cache)
        if window == "frozen with live keys past it":
            runner.forward(ids[8:10], torch.arange(8, 10), cache)
        view = {"growing": cache, "scratch": FrozenView(cache, 6, scratch=True)}.get(window, FrozenView(cache, 8))
        start = view.get_seq_length(0)
        step = Pass(runner, torch.arange(start, start + 4), view, tree if window == "tree" else None)
        out = comp.run(step, comp.embed(ids[8:].view(1, -1)), range(runner.num_layers))
        return out, cache, max(cache.lengths[0], start + 4)  # the positions holding keys afterwards

    with torch.inference_mode():
        got, got_cache, end = run()
        with cpu_layers.suspended():
            want, want_cache, _ = run()
    if window == "frozen with live keys past it":
        end = 10  # the pass joined a copy of the window and its keys: nothing written into the cache
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert got_cache.lengths == want_cache.lengths
    for layer in range(runner.num_layers):
        for mine, theirs in ((got_cache.keys, want_cache.keys), (got_cache.values, want_cache.values)):
            assert torch.allclose(mine[layer][..., :end, :], theirs[layer][..., :end, :], atol=1e-4), (layer, end)


def test_layers_the_fused_pass_does_not_cover_run_as_modules():
    """q/k norms (Qwen3) have no C form: such a copy keeps torch's modules."""
    if kernels.skinny_library() is None:
        pytest.skip("no C compiler or no AVX2 here: the CPU int8 kernels are not built")
    assert not compressed_copy(tiny_model(arch="qwen3").runner, "int8-weight-only")[0].fused


def compressed_agreement(lm: LoadedModel, ids: list[int], backend: str) -> float:
    """Top-1 agreement of the compressed model with the full model, one position at a time."""
    runner = lm.runner
    comp, _ = compressed_copy(runner, backend)
    ids_t = torch.tensor(ids)
    with torch.inference_mode():
        cache = KVCache()
        full = runner.forward(ids_t, torch.arange(len(ids)), cache).argmax(-1)
        agree = []
        for pos in range(len(ids) // 2, len(ids)):
            step = Pass(runner, torch.tensor([pos]), FrozenView(cache, pos), None)
            h = comp.run(step, comp.embed(ids_t[pos : pos + 1].view(1, 1)), range(runner.num_layers))
            agree.append(int(comp.logits(h[0]).argmax(-1)) == int(full[pos]))
    return sum(agree) / len(agree)


@pytest.mark.parametrize("backend, floor", [("torch-int8", 0.85), ("int8-weight-only", 0.9)])
def test_int8_copy_agrees_with_the_full_model(embedded_lm, suite_sample, backend, floor):
    """Top-1 agreement on the first suite prompt: torch's dynamic int8 (activations quantized too) 91% measured
    with full-range activations, 89% with 7-bit (CPUs without VNNI); int8 weights with fp32 activations 96%."""
    if backend == "int8-weight-only" and "skinny" not in kernels.available_forms():
        pytest.skip("no C compiler or no AVX2 here: the CPU int8-weight-only kernel is not built")
    ids = suite_sample[0][:160]
    assert compressed_agreement(embedded_lm, ids, backend) >= floor


def test_compressed_passes_are_cheaper_than_the_full_stack_on_cpu(embedded_lm, suite_sample):
    """The reason the copy exists: one compressed pass (all layers + LM head) vs the target's layers."""
    # fixed sizes: this measures the mechanism, drafting every step (the cost model may pause it)
    result = decode.run(embedded_lm, suite_sample[1], "fractal", max_new_tokens=32, params={"policy": "fixed"})
    ratios = [s.payload["cost_ratio"] for s in result.steps if "cost_ratio" in s.payload]
    assert len(ratios) >= 5 and statistics.median(ratios) < 0.8, ratios


def test_carried_slots_supply_most_drafts_on_the_embedded_model(embedded_lm, suite_sample):
    result = decode.run(embedded_lm, suite_sample[2], "fractal", max_new_tokens=32,
                        params={"carry": True, "num_fractal": 2, "window": 2, "policy": "fixed"})
    sources = [s.payload.get("source") for s in result.steps if s.drafted]
    assert sources.count("carried") > len(sources) / 2, sources
    # slots start from what the text continues with where it repeats (`Fractal._held`): some of them right
    assert sum(s.payload.get("slots_started_right", 0) for s in result.steps) > 0


def test_bitsandbytes_int8_path_is_lossless_on_cpu(tiny_lm):
    """The CUDA backend's code path; bitsandbytes also runs it on CPU (slowly), so it is checked here too."""
    pytest.importorskip("bitsandbytes")
    assert_greedy_identical(tiny_lm, "fractal", PROMPTS[:2], max_new_tokens=30,
                            params={"backend": "bnb-int8", "num_fractal": 2, "window": 2})


@pytest.mark.parametrize("cls, tolerance", [(Int8WeightOnlyLinear, 0.02), (Fp8Linear, 0.1)])
def test_gpu_linears_approximate_the_original(cls, tolerance):
    """The CUDA backends' linears run here on a CPU: fp8 on torch's kernels (the same arithmetic, slowly),
    int8 weights through the skinny kernel's int8 form where it builds (else torch's)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        want, got = linear(x), cls(linear)(x)
    assert got.shape == want.shape
    assert (got - want).norm() / want.norm() < tolerance


def test_auto_backend_builds_the_cheapest_candidate_that_runs(tiny_lm, monkeypatch):
    from specgui.methods.fractal import compress

    def maker(backend):
        if backend == "fp8":
            raise RuntimeError("no fp8 kernels on this build")  # skipped, not fatal
        return {"torch-int8": TorchInt8Linear, "torch-fp16": compress.TorchFp16Linear}[backend]

    monkeypatch.setattr(compress, "candidates", lambda device: ["fp8", "torch-fp16", "torch-int8"])
    monkeypatch.setattr(compress, "_maker", maker)
    assert compress.cheapest(tiny_lm.runner) in ("torch-fp16", "torch-int8")
    monkeypatch.setattr(compress, "candidates", lambda device: ["fp8"])
    with pytest.raises(SpecGUIError, match="no compression backend runs here"):
        compress.cheapest(tiny_lm.runner)


def test_backends_a_device_cannot_run_are_refused_in_one_line(tiny_lm, monkeypatch):
    for backend, message in (("fp8", "CUDA GPUs"), ("bnb-nf4", "CUDA GPUs"), ("zip", "unknown")):
        with pytest.raises(SpecGUIError, match=message):
            compressed_copy(tiny_lm.runner, backend)
    monkeypatch.setattr(kernels, "skinny_library", lambda: None)  # a CPU without AVX2 or a C compiler
    with pytest.raises(SpecGUIError, match="int8-weight-only backend needs the skinny kernel"):
        compressed_copy(tiny_lm.runner, "int8-weight-only")


# -- CUDA -----------------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="no CUDA GPU here: the bitsandbytes int8 path is measured on a GPU machine")


def cuda_model(config: LlamaConfig, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """A random Llama built directly on the GPU."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return LoadedModel(spec=ModelSpec(name="cuda-llama"), name="cuda-llama", model=model,
                       tokenizer=CharTokenizer(config.vocab_size), runner=Runner(model), stop_ids=frozenset(),
                       max_context=config.max_position_embeddings, load_s=0.0, source="in-process")


@requires_cuda
def test_bnb_int8_on_cuda_is_lossless(tiny_lm):
    pytest.importorskip("bitsandbytes")
    model = tiny_lm.model.__class__(tiny_lm.model.config).cuda().eval()
    model.load_state_dict(tiny_lm.model.state_dict())
    lm = dataclasses.replace(tiny_lm, model=model, runner=Runner(model))
    for carry in (True, False):
        assert_greedy_identical(lm, "fractal", PROMPTS, max_new_tokens=40,
                                params={"backend": "bnb-int8", "carry": carry, "num_fractal": 2, "window": 2})


@requires_cuda
@pytest.mark.parametrize("backend", ["bnb-int8", "int8-weight-only", "fp8", "bnb-nf4"])
@pytest.mark.parametrize("shape", ["1B", "8B"])
def test_compressed_cost_ratio_on_cuda(shape, backend, capsys):
    """Cost ratio, tau and speedup of Fractal on random models with Llama-3.2-1B / Llama-3-8B shapes (fp16)."""
    if backend.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    if backend == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    dims = {"1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
            "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)}
    config = LlamaConfig(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         **dims[shape])
    lm = cuda_model(config, torch.float16)
    prompt = torch.randint(0, config.vocab_size, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    params = {"backend": backend, "policy": "fixed"}  # the cost policy may rightly decline to draft
    decode.run(lm, prompt[:32], "fractal", max_new_tokens=8, params=params)  # builds the copy, warms up kernels
    base = decode.run(lm, prompt, "baseline", max_new_tokens=64)
    got = decode.run(lm, prompt, "fractal", max_new_tokens=64, params=params)
    ratios = [s.payload["cost_ratio"] for s in got.steps if "cost_ratio" in s.payload]
    with capsys.disabled():
        print(f"\n{shape} fp16 {backend} on {torch.cuda.get_device_name()}: cost ratio (median) "
              f"{statistics.median(ratios):.2f}, "
              f"tau {got.summary.tau:.2f}, speedup {got.summary.tokens_per_s / base.summary.tokens_per_s:.2f}x, "
              f"identical {got.token_ids == base.token_ids}")
    assert ratios and all(r > 0 for r in ratios)

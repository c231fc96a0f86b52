"""The draft vocabulary (`specgui.core.vocab`): exact logits on its ids, lossless drafts with it, its price."""

import pytest
import torch

from helpers import assert_greedy_identical, assert_sampling_lossless, tiny_model
from specgui import costs
from specgui.core import decode
from specgui.core import vocab as vocab_module
from specgui.core.runner import SkipPlan
from specgui.core.sampling import probabilities
from specgui.core.vocab import DraftVocab
from specgui.cpu import kernels
from specgui.methods.fractal.compress import Int8WeightOnlyLinear
from specgui.methods.layerskip import drafting as layerskip

LAYER_SKIP = ["clasp", "admg", "swift", "dv"]
TINY_PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]
FEW_IDS = [1, 2, 3, 1, 2, 3, 1, 2]  # the sampling model's prompt: 3 of its 12 ids, so most lie outside a small vocab


@pytest.mark.parametrize("form", ["skinny", "stock"])
def test_subset_logits_are_the_full_heads_on_its_ids_and_minus_infinity_elsewhere(form):
    """A row-prefix of the head's weight is a view, and the skinny kernel sums each output in an order that does not
    depend on how many outputs there are: its ids' logits equal the full head's bit for bit (torch's own product
    blocks by shape, so there only closely)."""
    if form == "skinny" and kernels.skinny_library() is None:
        pytest.skip("the skinny kernel does not build here")
    lm = tiny_model(vocab=300, hidden=64, seed=5)
    kernels.install(lm.model, forced=form)
    runner = lm.runner
    vocab = DraftVocab(runner.lm_head, 100, seen=[250, 120, 7, 250])
    assert len(vocab) == 102 and 120 in vocab and 99 in vocab and 100 not in vocab
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = runner.logits(hidden)
        part = runner.logits(hidden, vocab=vocab)
    ids = torch.tensor([*range(100), 250, 120])
    inside = torch.zeros(300, dtype=torch.bool)
    inside[ids] = True
    if form == "skinny":
        assert torch.equal(part[:, inside], full[:, inside])
    else:
        assert torch.allclose(part[:, inside], full[:, inside], atol=1e-5)
    assert torch.isneginf(part[:, ~inside]).all()
    vocab.add([260, 3, 260])  # emitted text joins it; low ids are in already
    assert len(vocab) == 103 and 260 in vocab
    with torch.inference_mode():
        assert torch.allclose(runner.logits(hidden, vocab=vocab)[:, 260], full[:, 260], atol=1e-5)


def test_no_draft_vocabulary_for_zero_or_the_whole_vocabulary(tiny_lm):
    assert DraftVocab.of(tiny_lm.runner, 0, [1]) is None
    assert DraftVocab.of(tiny_lm.runner, 48, [1]) is None
    assert len(DraftVocab.of(tiny_lm.runner, 16, [1, 30, 30])) == 17


@pytest.mark.parametrize("method", LAYER_SKIP)
def test_greedy_output_is_unchanged_with_a_small_draft_vocabulary(tiny_lm, method):
    """16 of 48 ids plus the prompt's: drafts fall outside often, and the verifier's full head decides."""
    assert_greedy_identical(tiny_lm, method, TINY_PROMPTS, max_new_tokens=40, params={"draft_vocab": 16})


@pytest.fixture(scope="module")
def sampling_lm():
    return tiny_model(vocab=12, layers=3, hidden=32, init=0.5, seed=1)


@pytest.mark.parametrize("method", LAYER_SKIP)
def test_sampling_from_a_draft_vocabulary_keeps_the_target_distribution(sampling_lm, method):
    """The draft samples from the subset's softmax and keeps exactly that (zero outside) as its distribution."""
    assert_sampling_lossless(sampling_lm, method, FEW_IDS, runs=2000, params={"draft_vocab": 2})


def test_the_sampling_test_catches_a_draft_that_keeps_the_full_softmax(sampling_lm, monkeypatch):
    """Negative control: drafts drawn from a subset's softmax while the draft keeps the full softmax as their
    distribution bias the output, and the chi-square test must say so."""
    inside = torch.zeros(12, dtype=torch.bool)
    inside[[0, 1, 2, 3]] = True

    def wrong(logits, sampling, generator):
        drawn = probabilities(logits.masked_fill(~inside, float("-inf")), sampling)
        return int(torch.multinomial(drawn, 1, generator=generator)), probabilities(logits, sampling)

    monkeypatch.setattr(layerskip, "draft_sample", wrong)
    with pytest.raises(AssertionError, match="differs from the target"):
        assert_sampling_lossless(sampling_lm, "clasp", FEW_IDS, runs=2000)


def test_steps_show_the_vocabulary_and_the_rejections_outside_it(tiny_lm):
    result = decode.run(tiny_lm, TINY_PROMPTS[1], "clasp", max_new_tokens=40,
                        params={"policy": "fixed", "draft_vocab": 4})
    shown = [s.payload["vocab"] for s in result.steps if "vocab" in s.payload]
    assert shown and all(v["low_ids"] == 4 and v["size"] >= 4 + len(set(TINY_PROMPTS[1])) for v in shown)
    assert any(v["outside"] for v in shown)  # 4 low ids and the prompt's: the target writes others
    assert shown[-1]["outside_so_far"] == sum(v["outside"] for v in shown)
    sizes = [v["size"] for v in shown]
    assert sizes == sorted(sizes)  # emitted ids join it


def test_a_draft_token_is_priced_with_the_head_it_computes():
    """The cost model takes what the subset head costs off a skip-forward's price, floored at that head."""
    profile = costs.CostProfile(key={}, sizes=[1, 8], contexts=[128], forward=[[40.0, 48.0]], step=41.0,
                                attn=[2.0] * 4, mlp=[4.0] * 4, head=10.0)
    plan = SkipPlan(attn=frozenset({1}), mlp=frozenset({1, 2}))
    assert profile.skip_forward_ms(plan, 128) == 30.0
    assert profile.skip_forward_ms(plan, 128, head=2.0) == 22.0
    everything = SkipPlan(attn=frozenset(range(4)), mlp=frozenset(range(4)))
    assert profile.skip_forward_ms(everything, 128, head=2.0) == 8.0


@pytest.mark.parametrize("fast_path", [False, True])
def test_draft_token_costs_time_and_price_both_heads_at_the_same_skip_sets(tmp_path, monkeypatch, fast_path):
    """`profile`'s draft-token table: per skip share, the same skip set with the full head and the subset head (the
    forwards timed get either), each measured (on the profile's path) and priced by the profile as a draft of that
    skip set is (`skip_forward_ms`, `head_ms`); shares that round to the same count of layers give one row."""
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path))
    lm = tiny_model(vocab=300, layers=10, seed=3)
    profile = costs.profile_for(lm, fast_path=fast_path)
    forward, heads = lm.runner.forward, []

    def recording(*args, **kwargs):
        heads.append((kwargs.get("skip"), kwargs.get("vocab")))
        return forward(*args, **kwargs)

    monkeypatch.setattr(lm.runner, "forward", recording)
    rows = vocab_module.draft_token_costs(profile, lm.runner, 64, shares=(0.2, 0.5, 0.52), repeats=2)
    assert [r["layers"] for r in rows] == [2, 5]
    head = vocab_module.head_ms(profile, lm.runner, 64)
    for r in rows:
        plan = SkipPlan(attn=frozenset(range(9 - r["layers"], 9)), mlp=frozenset(range(9 - r["layers"], 9)))
        assert r["full_priced_ms"] == profile.skip_forward_ms(plan, profile.contexts[0])
        assert r["vocab_priced_ms"] == profile.skip_forward_ms(plan, profile.contexts[0], head)
        assert r["change"] == pytest.approx(r["vocab_ms"] / r["full_ms"] - 1)
        assert r["priced_change"] == pytest.approx(r["vocab_priced_ms"] / r["full_priced_ms"] - 1)
        timed = {(skip, None if v is None else len(v)) for skip, v in heads if skip == plan}
        assert timed == {(plan, None), (plan, 64 + vocab_module.EXTRA_IDS)}  # the full head and the subset's
    assert vocab_module.draft_token_costs(profile, lm.runner, 300) == []  # the whole vocabulary: nothing to compare


def test_a_compressed_heads_rows_are_its_outputs_bit_for_bit():
    """Fractal's slot guesses read the int8 head over a draft vocabulary: its rows through the same kernel."""
    if kernels.skinny_library() is None:
        pytest.skip("the skinny kernel does not build here")
    lm = tiny_model(vocab=300, hidden=64, seed=7)
    head = Int8WeightOnlyLinear(lm.runner.lm_head)
    vocab = DraftVocab(lm.runner.lm_head, 64, seen=[200, 150])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    full, part = head(x).float(), vocab.logits(x, head)
    ids = [*range(64), 200, 150]
    assert torch.equal(part[:, ids], full[:, ids])
    assert torch.isneginf(part[:, [64, 100, 299]]).all()

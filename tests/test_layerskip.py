"""The drafting loop both layer-skip methods share: cache invariant, draft-exit."""

import pytest
import torch

from specgui.kvcache import KVCache
from specgui.methods.base import DecodeState
from specgui.methods.layerskip import ExitThreshold, draft_chain
from specgui.runner import SkipPlan
from specgui.sampling import GREEDY, Sampling


def _state(lm, prompt, sampling=GREEDY):
    state = DecodeState(lm.runner, KVCache(), list(prompt), len(prompt), sampling,
                        None if sampling.greedy else sampling.generator(torch.device("cpu")), max_new_tokens=32)
    with torch.no_grad():
        logits = lm.runner.forward(torch.tensor(prompt), torch.arange(len(prompt)), state.cache)
    state.tokens.append(int(logits[-1].argmax()))
    return state


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0, seed=3)])
def test_draft_chain_leaves_every_layer_at_the_committed_length(tiny_lm, sampling):
    state = _state(tiny_lm, [3, 1, 4, 1, 5, 9, 2, 6], sampling)
    plan = SkipPlan(attn=frozenset({1}), mlp=frozenset({2}))
    with torch.no_grad():
        chain = draft_chain(state, plan, limit=5, threshold=0.0)
    assert len(chain.tokens) == 5 and chain.reason == "limit"
    assert [state.cache.get_seq_length(i) for i in range(4)] == [state.committed] * 4
    assert (chain.probs is None) == sampling.greedy
    if chain.probs is not None:
        assert chain.probs.shape == (5, 48)
        assert torch.allclose(chain.probs.sum(-1), torch.ones(5))


def test_draft_chain_equals_the_skipped_model_run_alone(tiny_lm):
    """Drafting over the shared cache = running the skipped model on [prefix by the full model] + draft."""
    state = _state(tiny_lm, [7, 8, 9, 10, 11])
    plan = SkipPlan(attn=frozenset({2}), mlp=frozenset({2}))
    with torch.no_grad():
        chain = draft_chain(state, plan, limit=4, threshold=0.0)
        cache = KVCache()
        tiny_lm.runner.forward(torch.tensor(state.tokens[:-1]), torch.arange(state.committed), cache)
        expected, token = [], state.pending
        for i in range(4):
            position = torch.tensor([state.committed + i])
            logits = tiny_lm.runner.forward(torch.tensor([token]), position, cache, skip=plan)
            token = int(logits[0].argmax())
            expected.append(token)
    assert chain.tokens == expected


WHOLE_LAYER_1 = SkipPlan(attn=frozenset({1}), mlp=frozenset({1}))


def test_draft_exit_stops_after_the_first_unconfident_token(tiny_lm):
    state = _state(tiny_lm, [1, 2, 3, 4])
    with torch.no_grad():
        chain = draft_chain(state, WHOLE_LAYER_1, limit=6, threshold=0.99)
    # a random tiny model is never 99% sure: the first token is kept (it is already paid for), then stop
    assert len(chain.tokens) == 1 and chain.reason == "threshold" and chain.confidences[0] < 0.99
    with torch.no_grad():
        short = draft_chain(state, WHOLE_LAYER_1, limit=2, threshold=0.0)
    assert short.reason == "limit" and len(short.tokens) == 2


def test_fixed_exit_threshold_never_moves():
    exit = ExitThreshold(0.7)
    for _ in range(20):
        exit.update(0, 4, "threshold")
    assert exit.value == 0.7


def test_adaptive_exit_threshold_follows_acceptance():
    strict, loose = ExitThreshold(0.5, target=0.8, step=0.1), ExitThreshold(0.5, target=0.8, step=0.1)
    for _ in range(20):
        strict.update(1, 4, "threshold")  # 25% accepted: below target, drafts must get more careful
        loose.update(4, 4, "threshold")
    assert strict.value > 0.55 and loose.value < 0.45
    before = strict.value
    strict.update(0, 4, "limit")  # the threshold did not stop this draft: no evidence about it
    assert strict.value == before

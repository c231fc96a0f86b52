"""The drafting loop the layer-skip methods share: cache invariant, draft-exit, chains drafted on the device."""

import pytest
import torch

from helpers import baseline_run, drafting, flat_profile, tiny_model
from specgui import fastpath
from specgui.core import decode
from specgui.core.kvcache import KVCache
from specgui.core.runner import SkipPlan
from specgui.core.sampling import GREEDY, Sampling
from specgui.errors import SpecGUIError
from specgui.methods.base import DecodeState
from specgui.methods.layerskip.drafting import ExitThreshold, UnreadChain, draft_chain
from specgui.tools import dispatch


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


CHAINED = [("admg", {"exit_threshold": 0.2, "max_draft": 4}), ("clasp", {"det": 0.2, "loi": 4, "max_draft": 4})]


@pytest.mark.parametrize(("method", "params"), CHAINED)
def test_on_the_pipelined_fast_path_layer_skip_steps_chain_on_the_device(method, params):
    """Layer-skip chains drafted on the device at the launch (`fastpath.SkipSteps`): pipelined, a step whose plan, size
    and exit threshold are fixed before the verdict before it is read is launched before that read, so the device
    waits for the host at the first step, at CLaSp's searches and the steps recording for them, and where the budget
    leaves no room for a step ahead; serially at every step. Under the overwrite check both give plain decoding's
    tokens, with drafts cut at their exits or not, accepted in part and whole, and the same events."""
    lm = tiny_model(seed=1, init=0.3)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    kwargs = {"max_new_tokens": 32, "fast_path": "on", "params": drafting(method, params),
              "profile": flat_profile(lm, True)}
    runs, waited = {}, {}
    for pipeline in (True, False):
        with fastpath.overwrite_check(), dispatch.counting() as counts:
            runs[pipeline] = result = decode.run(lm, prompt, method, pipeline=pipeline, **kwargs)
        assert result.token_ids == baseline_run(lm, prompt, 32).token_ids
        waited[pipeline] = counts.waited
    steps = runs[True].steps
    assert waited[False] == len(steps)
    searched = sum(s.payload.get("reoptimized", False) for s in steps)  # CLaSp's, and the step recording before each
    assert 1 <= waited[True] <= 3 + 2 * searched < len(steps)
    assert {s.payload["exit"]["reason"] for s in steps if s.drafted} == {"threshold", "limit"}
    assert any(0 < len(s.path) < len(s.draft_tokens) for s in steps)
    assert any(len(s.path) == len(s.draft_tokens) > 0 for s in steps)
    shown = [(s.draft_tokens, s.path, s.emitted, s.payload["exit"]) for s in steps]
    assert shown == [(s.draft_tokens, s.path, s.emitted, s.payload["exit"]) for s in runs[False].steps]


def test_a_device_acceptance_other_than_the_hosts_stops_the_run_with_a_one_line_error(monkeypatch):
    """A chained layer-skip step's tokens are accepted twice, by the device (which the steps chained after it start
    from) and by the host (which emits them): were they ever to differ, the run stops rather than go on from tokens
    the host did not decode. Here the host takes no draft token as standing."""
    lm = tiny_model(seed=1, init=0.3)
    monkeypatch.setattr(UnreadChain, "decide", lambda self, values: ([], [], []))  # nothing stands
    with pytest.raises(SpecGUIError, match="the device accepted"):
        decode.run(lm, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], "admg", max_new_tokens=32, fast_path="on",
                   params=drafting("admg", dict(CHAINED)["admg"]), profile=flat_profile(lm, True))

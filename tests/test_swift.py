"""SWIFT: the optimisation phase follows the code's rules, its score is teacher-forced agreement, the draft tree
adds the runner-ups, and the search carries over generations only when asked.

Losslessness with the presets (greedy on tiny and embedded models, sampling) is in test_lossless.py.
"""

import numpy as np
import pytest
import torch

from helpers import assert_greedy_identical, assert_sampling_lossless, tiny_model
from specgui import methods
from specgui.core import decode
from specgui.core.kvcache import KVCache
from specgui.core.runner import SkipPlan
from specgui.errors import SpecGUIError
from specgui.methods.layerskip.skipsearch import SkipSpace, matchness
from specgui.methods.layerskip.swift import SwiftSearch

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 7, 8, 9, 10]
FAST = {"context_window": 6, "opt_interval": 1, "bayes_interval": 3, "policy": "fixed", "persist": False,
        "skip_ratio": 0.45, "max_score": 1.0,  # the CPU preset skips little: its first proposal may end the search
        "candidates": "1,1,1,1"}


@pytest.fixture(scope="module")
def deep_lm():
    """Eight layers: room for a search space of 12 sub-layers."""
    return tiny_model(layers=8, init=0.3, seed=5)


def _params(**kw):
    return methods.params_for("swift", "tiny", "cpu", {**FAST, **kw})


def test_candidates_must_be_four_counts():
    for bad in ("3,5,8", "a,b,c,d", "0,1,1,1"):
        with pytest.raises(SpecGUIError, match="four comma-separated counts"):
            _params(candidates=bad)


def test_start_set_and_random_proposals_have_the_budget_and_spare_the_first_and_last_layer():
    space = SkipSpace.of(range(1, 9))  # a 10-layer model: layers 1..8 are searchable
    search = SwiftSearch(space, 7, _params(skip_ratio=0.45))
    assert search.best.sum() == 7
    assert {layer for layer, _ in space.units} == set(range(1, 9))
    for _ in range(20):
        x, _ = search.propose()
        assert x.sum() == 7
        search.record(x, 0.1)


def test_search_keeps_only_improvements_and_ends_by_the_codes_rules():
    space = SkipSpace.of(range(1, 5))
    search = SwiftSearch(space, 3, _params(max_score=0.9, max_tolerance_iter=2, max_opt_iter=50))
    x, _ = search.propose()
    assert search.record(x, 0.5) and search.best_score == 0.5 and (search.best == x).all()
    y, _ = search.propose()
    assert not search.record(y, 0.4) and (search.best == x).all()
    assert search.active
    search.record(y, 0.3)
    search.record(y, 0.2)  # a third miss in a row exceeds max_tolerance_iter = 2
    assert not search.active
    done = SwiftSearch(space, 3, _params(max_score=0.9))
    done.record(done.propose()[0], 0.95)  # above max_score: the phase ends at once
    assert not done.active


def test_every_bayes_interval_th_proposal_is_bayesian():
    space = SkipSpace.of(range(1, 7))
    search = SwiftSearch(space, 4, _params(bayes_interval=3))
    kinds = []
    rng = np.random.default_rng(0)
    for _ in range(9):
        x, kind = search.propose()
        kinds.append(kind)
        search.record(x, float(rng.random()) * 0.5)
    assert kinds == ["random", "random", "bayes"] * 3


def test_matchness_is_teacher_forced_agreement_over_the_prompt_cache(tiny_lm):
    """One forward over the window equals the skipped model run token by token after the full model's prompt."""
    plan = SkipPlan(attn=frozenset({1}), mlp=frozenset({2}))
    window = [5, 9, 2, 6, 5, 3, 5, 8]
    cache = KVCache()
    with torch.no_grad():
        tiny_lm.runner.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache)
        right, total = matchness(tiny_lm.runner, cache, len(PROMPT), window, plan)
        assert cache.get_seq_length(0) == len(PROMPT)  # read, never grown
        expected = 0
        for i in range(len(window) - 1):
            logits = tiny_lm.runner.forward(torch.tensor([window[i]]), torch.tensor([len(PROMPT) + i]), cache,
                                            skip=plan)
            expected += int(logits[0].argmax()) == window[i + 1]
    assert (right, total) == (expected, len(window) - 1)


def test_events_show_the_search_and_drafts_use_its_best_set(deep_lm):
    result = decode.run(deep_lm, PROMPT, "swift", max_new_tokens=40, params=FAST)
    generated = [1 + sum(len(s.emitted) for s in result.steps[: i + 1]) for i in range(len(result.steps))]
    scored = [i for i, s in enumerate(result.steps) if "score" in s.payload["search"]]
    assert scored, "no proposal was scored"
    # the first proposal comes on the first step that ends with more than context_window + 1 tokens
    assert generated[scored[0]] > FAST["context_window"] + 1 >= generated[scored[0] - 1]
    bests = [result.steps[i].payload["search"]["best"] for i in scored]
    assert bests == sorted(bests)
    assert {result.steps[i].payload["search"]["kind"] for i in scored} == {"random", "bayes"}
    for step, after in zip(result.steps, result.steps[1:]):
        if "score" in step.payload["search"] and step.payload["search"]["kept"] and after.drafted:
            assert after.payload["skip"] == step.payload["proposal"]  # a kept proposal drafts next


def test_persist_carries_the_search_over_generations(deep_lm):
    first = decode.run(deep_lm, PROMPT, "swift", max_new_tokens=30, params={**FAST, "persist": True})
    second = decode.run(deep_lm, PROMPT, "swift", max_new_tokens=30, params={**FAST, "persist": True})
    fresh = decode.run(deep_lm, PROMPT, "swift", max_new_tokens=30, params={**FAST, "persist": False})
    last = first.steps[-1].payload["search"]["iteration"]
    assert last > 0
    assert second.steps[0].payload["search"]["iteration"] == last
    assert fresh.steps[0].payload["search"]["iteration"] == 0


def test_dynamic_verification_adds_runner_ups_as_siblings(deep_lm):
    params = {**FAST, "candidates": "2,3,3,4", "max_opt_iter": 0}
    results = assert_greedy_identical(deep_lm, "swift", [PROMPT], max_new_tokens=30, params=params)
    drafted = [s for s in results[0].steps if s.drafted]
    assert drafted
    for step in drafted:
        kids: dict[int, list[int]] = {}
        for node, parent in enumerate(step.draft_parents):
            kids.setdefault(parent, []).append(node)
        assert 2 <= len(kids[-1]) <= 4  # the drafted token plus 1-3 runner-ups at the first position
        for children in kids.values():
            assert len({step.draft_tokens[c] for c in children}) == len(children)
            assert all(c not in kids for c in children[1:])  # runner-ups are leaves: only the drafted token goes on
        assert len(step.payload["exit"]["confidences"]) == step.drafted


def test_greedy_identical_with_trees_and_searches(tiny_lm, deep_lm):
    prompts = [PROMPT, [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]
    for lm in (tiny_lm, deep_lm):
        for extra in ({}, {"candidates": "3,5,8,10"}, {"skip_ratio": 0.8, "bayes_interval": 1}):
            assert_greedy_identical(lm, "swift", prompts, max_new_tokens=40, params={**FAST, **extra})


def test_sampling_with_sibling_candidates_keeps_the_target_distribution():
    lm = tiny_model(vocab=12, layers=3, hidden=32, init=0.5, seed=1)
    assert_sampling_lossless(lm, "swift", [5, 3, 8, 1, 0, 11, 7, 2, 9, 4, 6, 10, 5, 3, 8, 1], runs=1500,
                             params={**FAST, "candidates": "2,2,3,3"})

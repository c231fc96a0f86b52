"""Lookahead decoding: the window's mask is the paper's, its guesses are the target's own Jacobi step, the pool
feeds the verification branch.

Losslessness with the presets (greedy on tiny and embedded models, sampling) is in test_lossless.py.
"""

import pytest
import torch

from helpers import assert_greedy_identical, assert_sampling_lossless, tiny_model
from specgui.core import decode
from specgui.methods.ngram.lookahead import window_visibility

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 7, 8, 9, 10]
SMALL = {"window": 3, "ngram": 3, "guesses": 3, "pool_from_prompt": False, "policy": "fixed"}


@pytest.fixture(scope="module")
def peaky_lm():
    """Peaky weights keep argmax decisions far from ties, so a plain forward must agree exactly."""
    return tiny_model(init=0.5, seed=3)


def test_window_mask_is_one_jacobi_trajectory_per_column():
    # W = 3, three levels, two guess nodes before the window: extras are block 0's columns 1-2, then levels 1, 2
    visible = window_visibility(width=3, levels=3, nodes=2)
    assert visible.shape == (2 + 3 + 3, 1 + 2 + 8)
    pending, col = 0, {(0, 1): 3, (0, 2): 4, (1, 0): 5, (1, 1): 6, (1, 2): 7, (2, 0): 8, (2, 1): 9, (2, 2): 10}

    def sees(level, j):
        return {c for c in range(visible.shape[1]) if visible[col[level, j] - 3, c]}

    assert sees(0, 2) == {pending, col[0, 1], col[0, 2]}  # block 0 is causal
    assert sees(1, 0) == {pending, col[1, 0]}
    assert sees(2, 1) == {pending, col[0, 1], col[1, 1], col[2, 1]}  # level 0 up to j, then column j upwards
    assert sees(2, 2) == {pending, col[0, 1], col[0, 2], col[1, 2], col[2, 2]}
    assert not visible[:, 1:3].any()  # never a guess node of the verification branch


@pytest.mark.parametrize("params", [SMALL, {**SMALL, "ngram": 2}, {**SMALL, "window": 1, "ngram": 4},
                                    {**SMALL, "pool_from_prompt": True}])
def test_greedy_identical(tiny_lm, params):
    prompts = [PROMPT, [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]
    assert_greedy_identical(tiny_lm, "lookahead", prompts, max_new_tokens=40, params=params)


def test_no_guess_set_drafts_nothing_and_stays_identical(tiny_lm):
    results = assert_greedy_identical(tiny_lm, "lookahead", [PROMPT], max_new_tokens=20,
                                      params={**SMALL, "guesses": 0}, min_accepted=0)
    assert all(s.drafted == 0 for s in results[0].steps)


def test_window_guesses_are_the_targets_next_tokens_along_each_column(peaky_lm):
    """Once the window is full, the next step's top level is the target's argmax after each column's chain
    [text, level 0 up to column j, column j of the levels above]: the mask and positions are exact."""
    result = decode.run(peaky_lm, PROMPT, "lookahead", max_new_tokens=24, params=SMALL)
    text = [*PROMPT, result.events[1].token]  # everything up to and including the pending token
    checked = 0
    for step, after in zip(result.steps, result.steps[1:]):
        window = step.payload["window"]
        if not step.payload["warmup"] and window and after.payload["window"]:
            for j, guess in enumerate(after.payload["window"][-1]):
                chain = text[:-1] + window[0][: j + 1] + [level[j] for level in window[1:]]
                with torch.no_grad():
                    logits = peaky_lm.model(torch.tensor([chain])).logits[0, -1]
                assert int(logits.argmax()) == guess
                checked += 1
        text += list(step.emitted)
    assert checked >= 3 * 10


def test_warm_up_fills_the_levels_then_the_pool_feeds_verification(peaky_lm):
    params = {"window": 4, "ngram": 4, "guesses": 4, "pool_from_prompt": False, "policy": "fixed"}
    result = decode.run(peaky_lm, PROMPT, "lookahead", max_new_tokens=40, params=params)
    windows = [s.payload["window"] for s in result.steps]
    assert [len(w) for w in windows[:3]] == [1, 2, 3]  # N - 1 = 3 levels after N - 2 = 2 warm-up forwards
    assert [len(w[0]) for w in windows[:3]] == [6, 5, 4]  # each a column shorter, W = 4 wide once filled
    assert all(len(level) == 4 for w in windows[2:] for level in w if w)
    assert [s.payload["harvested"] for s in result.steps[:3]] == [0, 0, 4]
    assert result.steps[-1].payload["cache_sizes"]["pool"] > 0
    hits = [s for s in result.steps if "hit" in s.payload]
    assert hits and all(s.payload["candidates"][s.payload["hit"]["candidate"]]["source"] == "pool" for s in hits)
    assert all(s.forward_tokens == 1 + s.drafted + 3 + 4 + 4 for s in result.steps[2:-1])


def test_pool_from_prompt_verifies_prompt_ngrams_from_the_first_step(tiny_lm):
    result = decode.run(tiny_lm, PROMPT, "lookahead", max_new_tokens=8, params={**SMALL, "pool_from_prompt": True})
    assert result.events[1].payload["cache_sizes"]["pool"] > 0


def test_sampling_with_a_small_window_keeps_the_target_distribution():
    lm = tiny_model(vocab=12, layers=3, hidden=32, init=0.5, seed=1)
    assert_sampling_lossless(lm, "lookahead", [5, 3, 8, 1, 0, 11, 7, 2, 9, 4, 6, 10, 5, 3, 8, 1], runs=1500,
                             params={"window": 2, "ngram": 2, "guesses": 4, "pool_from_prompt": True})

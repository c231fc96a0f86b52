"""Every registered method is lossless: greedy output equals baseline token for token (tiny random models
and the embedded SmolLM2, fp32), and sampled output follows the target distribution (chi-square).

The method list comes from the registry, so a new method is tested here the moment it registers. Each
runs with its own presets (configs/<method>.yaml): presets must work on any model size.
"""

import pytest

from helpers import assert_greedy_identical, assert_sampling_lossless, tiny_model
from specgui import methods

SPECULATIVE = [name for name in methods.names() if name != "baseline"]

# Prompts with repeats (so n-gram drafters find matches) and without.
TINY_PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]
ALL_TOKENS = [5, 3, 8, 1, 0, 11, 7, 2, 9, 4, 6, 10, 5, 3, 8, 1]  # every token of a 12-token vocab occurs


@pytest.fixture(scope="module")
def sampling_lm():
    """Small vocabulary, peaky enough that 2000 samples of (t2, t3) give a powerful chi-square test."""
    return tiny_model(vocab=12, layers=3, hidden=32, init=0.5, seed=1)


@pytest.mark.parametrize("method", SPECULATIVE)
def test_greedy_identical_on_tiny_llama(tiny_lm, method):
    assert_greedy_identical(tiny_lm, method, TINY_PROMPTS, max_new_tokens=40)


@pytest.mark.parametrize("method", SPECULATIVE)
def test_sampling_keeps_target_distribution(sampling_lm, method):
    assert_sampling_lossless(sampling_lm, method, ALL_TOKENS, runs=2000)


@pytest.mark.parametrize("method", SPECULATIVE)
def test_sampling_with_top_k_top_p_keeps_target_distribution(sampling_lm, method):
    assert_sampling_lossless(sampling_lm, method, ALL_TOKENS, runs=1500, temperature=0.7, top_k=8, top_p=0.9)


# After the tiny models' tests: this file runs first on one worker while the other loads the embedded model
# and measures its cost profile, which these tests would otherwise wait for.
@pytest.mark.parametrize("method", SPECULATIVE)
def test_greedy_identical_on_embedded_model(embedded_lm, suite_sample, method):
    """One prompt per suite category, 48 new tokens each (the full suite runs in `bench`)."""
    assert_greedy_identical(embedded_lm, method, suite_sample, max_new_tokens=48)


def test_baseline_is_reproducible_with_a_seed(sampling_lm):
    from specgui.core import decode
    from specgui.core.sampling import Sampling

    a = decode.run(sampling_lm, ALL_TOKENS, "baseline", max_new_tokens=8, sampling=Sampling(1.0, seed=7))
    b = decode.run(sampling_lm, ALL_TOKENS, "baseline", max_new_tokens=8, sampling=Sampling(1.0, seed=7))
    assert a.token_ids == b.token_ids

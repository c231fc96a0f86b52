"""The verifier on hand-built tensors: greedy paths, and speculative sampling reproducing the target."""

import pytest
import torch
from scipy import stats

from specgui.core.draft import Draft
from specgui.core.sampling import Sampling, probabilities
from specgui.core.verify import verify

GREEDY = Sampling()
V = 6


def _logits(*rows):
    """Rows of logits with one clear winner each: row i prefers token rows[i]."""
    out = torch.full((len(rows), V), -5.0)
    for i, token in enumerate(rows):
        out[i, token] = 5.0
    return out


def test_greedy_chain_accepts_longest_agreeing_prefix_and_corrects():
    draft = Draft(tokens=[2, 3, 4])
    verdict = verify(_logits(2, 3, 1, 0), draft, GREEDY, None)  # target wants 2, 3, then 1 (not 4)
    assert verdict.path == [0, 1] and verdict.token == 1 and verdict.corrected


def test_greedy_chain_fully_accepted_gets_a_bonus_token():
    verdict = verify(_logits(2, 3, 5), Draft(tokens=[2, 3]), GREEDY, None)
    assert verdict.path == [0, 1] and verdict.token == 5 and not verdict.corrected


def test_empty_draft_is_plain_decoding():
    verdict = verify(_logits(4), Draft(), GREEDY, None)
    assert verdict.path == [] and verdict.token == 4 and not verdict.corrected


def test_greedy_tree_follows_the_matching_branch():
    # root children: node 0 (token 1) and node 1 (token 2); node 2 (token 3) under node 1
    draft = Draft(tokens=[1, 2, 3], parents=[-1, -1, 1])
    logits = _logits(2, 0, 3, 4)  # rows: pending, node0, node1, node2
    verdict = verify(logits, draft, GREEDY, None)
    assert verdict.path == [1, 2] and verdict.token == 4


def test_draft_tree_geometry():
    draft = Draft(tokens=[1, 2, 3, 4], parents=[-1, 0, -1, 2])
    assert draft.depths() == [1, 2, 1, 2]
    assert draft.children()[-1] == (0, 2)
    assert Draft(tokens=[5, 6, 7, 8], parents=[-1, 0, -1, 2]).children() is draft.children()  # made once a shape
    vis = draft.visibility()
    assert vis[4].tolist() == [True, False, False, True, True]  # node 3 sees pending, node 2, itself
    assert not draft.is_chain and Draft(tokens=[5, 6]).is_chain
    with pytest.raises(ValueError):
        Draft(tokens=[1, 2], parents=[-1, 1])


def _sample_many(target, draft_builder, n=20000, sampling=None):
    """Distribution of the first emitted token over n trials (the accepted first node, or the own token)."""
    sampling = sampling or Sampling(temperature=1.0)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V)
    for _ in range(n):
        draft = draft_builder(gen)
        verdict = verify(target, draft, sampling, gen)
        first = draft.tokens[verdict.path[0]] if verdict.path else verdict.token
        counts[first] += 1
    return counts


def _chi2_p(counts, probs):
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token the target gives probability 0"
    return stats.chisquare(counts[keep].numpy(), (probs[keep] * counts.sum()).numpy()).pvalue


TARGET = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, -3.0], [0.0] * V])
DRAFT_Q = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])  # deliberately unlike the target


def _model_draft(gen):
    token = int(torch.multinomial(DRAFT_Q, 1, generator=gen))
    return Draft(tokens=[token], probs=DRAFT_Q.view(1, V))


def test_speculative_sampling_reproduces_the_target_distribution():
    p = probabilities(TARGET[0], Sampling(temperature=1.0))
    assert _chi2_p(_sample_many(TARGET, _model_draft), p) > 1e-3


def test_the_statistical_check_catches_a_biased_verifier():
    """Negative control: the classic bug of resampling from p (not the residual max(p - q, 0)) after a
    rejection biases the output, and the same chi-square check notices. That is what makes the test
    above able to fail. (Treating a sampled draft as one-hot would *not* be a bug: it is lossless.)"""
    p = probabilities(TARGET[0], Sampling(temperature=1.0))
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(V)
    for _ in range(20000):
        x = int(torch.multinomial(DRAFT_Q, 1, generator=gen))
        if torch.rand((), generator=gen) < p[x] / DRAFT_Q[x]:
            counts[x] += 1
        else:
            counts[int(torch.multinomial(p, 1, generator=gen))] += 1
    assert _chi2_p(counts, p) < 1e-6


def test_several_one_hot_candidates_per_node_stay_lossless():
    """n-gram candidates (one-hot, several siblings, a repeated token) with top-k/top-p filtering."""
    sampling = Sampling(temperature=0.8, top_k=5, top_p=0.95)

    def candidates(gen):
        return Draft(tokens=[1, 0, 1, 3], parents=[-1, -1, -1, -1])

    target = torch.cat([TARGET[:1], torch.zeros(4, V)])  # rows: pending + 4 candidate nodes
    p = probabilities(target[0], sampling)
    assert _chi2_p(_sample_many(target, candidates, sampling=sampling), p) > 1e-3


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    k2 = probabilities(logits, Sampling(temperature=1.0, top_k=2))
    assert (k2[2:] == 0).all() and torch.isclose(k2.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)  # [0.644, 0.237, 0.087, 0.032]
    p80 = probabilities(logits, Sampling(temperature=1.0, top_p=0.8))
    assert (p80 > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p80[:2], full[:2] / full[:2].sum())
    assert probabilities(logits, Sampling(temperature=1.0, top_p=0.5)).tolist() == [1.0, 0.0, 0.0, 0.0]

"""The small Bayesian optimiser: the GP fits what it saw, UCB suggestions find a hidden set faster than chance."""

import numpy as np
import pytest

from specgui.methods.layerskip.bayesopt import BayesOpt, GaussianProcess, candidate_pool, neighbours


def test_gp_interpolates_its_points_and_is_unsure_far_from_them():
    rng = np.random.default_rng(0)
    x = (rng.random((30, 12)) < 0.3).astype(np.uint8)
    weights = rng.normal(size=12)
    y = x @ weights
    gp = GaussianProcess(noise=1e-4)
    gp.fit(x, y)
    mean, std = gp.predict(x)
    assert np.abs(mean - y).max() < 0.05 * y.std()
    far = 1 - x[:5]  # every bit flipped
    assert std.max() < gp.predict(far)[1].min()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ucb_search_finds_a_hidden_set_that_random_search_misses(seed):
    dims = 24
    rng = np.random.default_rng(seed)
    target = (rng.random(dims) < 0.3).astype(np.uint8)

    def objective(x):
        return -float(np.abs(x.astype(int) - target).sum())  # 0 only at the hidden set

    def sample(n):
        return (rng.random((n, dims)) < rng.uniform(0, 0.7, (n, 1))).astype(np.uint8)

    opt = BayesOpt(dims)
    for x in sample(8):
        opt.register(x, objective(x))
    for _ in range(40):
        x = opt.suggest(candidate_pool(opt, sample, rng, random_count=256, around_best=4, per_best=32, keep_size=False))
        opt.register(x, objective(x))
    assert max(opt.ys) == 0.0 and (opt.best(1)[0] == target).all()
    assert max(objective(x) for x in sample(48)) < 0.0  # as many random sets never hit it


def test_suggest_skips_evaluated_sets():
    opt = BayesOpt(3)
    a, b = np.array([1, 0, 0], dtype=np.uint8), np.array([0, 1, 0], dtype=np.uint8)
    opt.register(a, 1.0)
    opt.register(b, 0.5)
    assert opt.suggest(np.stack([a, b])) is None
    c = np.array([1, 1, 0], dtype=np.uint8)
    assert (opt.suggest(np.stack([a, c, b])) == c).all()


def test_gp_training_set_keeps_the_best_and_the_latest_past_the_cap():
    opt = BayesOpt(4, max_points=8)
    for i in range(20):
        opt.register(np.array([i % 2, i % 3 == 0, i % 5 == 0, 1], dtype=np.uint8), 100.0 if i == 3 else float(i % 7))
    rows = opt._training_rows()
    assert len(rows) <= 8 and 3 in rows and {16, 17, 18, 19} <= set(rows)


def test_neighbours_move_one_element():
    rng = np.random.default_rng(0)
    x = np.array([1, 1, 0, 0, 0, 1], dtype=np.uint8)
    swaps = neighbours(x, rng, 20, keep_size=True)
    assert (swaps.sum(1) == 3).all() and (np.abs(swaps.astype(int) - x).sum(1) == 2).all()
    flips = neighbours(x, rng, 20, keep_size=False)
    assert (np.abs(flips.astype(int) - x).sum(1) == 1).all()

"""A small Bayesian optimiser over binary vectors: a Gaussian process with an upper-confidence-bound pick.

SWIFT and Draft & Verify both search skip sets with the `bayes_opt` package (a Gaussian process over the
box [0, 1]^d, a UCB acquisition maximised by random sampling plus L-BFGS, the suggestion rounded back to a
set). That package is not a dependency here, so this module is our own, smaller version, specialised to
what the methods search: 0/1 vectors over sub-layers.

  * `GaussianProcess`: Matern-5/2 kernel on the Euclidean distance between 0/1 vectors (the square root
    of their Hamming distance), targets standardised, a fixed noise term (`bayes_opt`'s alpha, 1e-2 in
    both papers' code), solved by Cholesky in float64 with numpy (host work: on a GPU host it never touches the
    device, and on a CPU `specgui.tools.dispatch` does not count it as device work either). The length scale is the one
    of a small grid that maximises the marginal likelihood, refitted every `refit_every` observations (the package
    fits it by L-BFGS every time). Past `max_points` observations it is fitted on the best half and the
    most recent half of them, so that a 1000-step search stays cheap.
  * `BayesOpt.suggest`: scores caller-supplied candidate vectors by UCB (mean + kappa x std) and returns
    the best one not evaluated yet. Candidates are discrete (random sets, plus one-move neighbours of the
    best sets seen), so no rounding of a continuous optimum is needed; the ASD paper notes that rounding
    made the original get stuck revisiting points.

It is a plain GP with a grid-fitted length scale and a sampled acquisition maximiser: no claim beyond that.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

LENGTH_GRID = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)  # times sqrt(d): from "a few flips matter" to "smooth"


def matern52(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    """Matern-5/2 kernel matrix [len(a), len(b)] between rows of 0/1 (or real) vectors."""
    r = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1), 0.0)) / length
    s5 = math.sqrt(5.0) * r
    return (1.0 + s5 + 5.0 / 3.0 * r * r) * np.exp(-s5)


class GaussianProcess:
    """GP regression on standardised targets; `fit` then `predict` mean and standard deviation (float64, CPU)."""

    def __init__(self, noise: float = 1e-2) -> None:
        self.noise = noise
        self.length: float | None = None

    def fit(self, x: np.ndarray, y: np.ndarray, *, choose_length: bool = True) -> None:
        self.x = np.asarray(x, dtype=np.float64)
        self.mean, self.scale = float(y.mean()), float(y.std()) or 1.0
        self.y = np.asarray((y - self.mean) / self.scale, dtype=np.float64)
        if choose_length or self.length is None:
            base = math.sqrt(max(1, x.shape[1]))
            self.length = max((base * g for g in LENGTH_GRID), key=self._log_likelihood)
        self._factor(self.length)

    def _factor(self, length: float) -> None:
        k = matern52(self.x, self.x, length) + self.noise * np.eye(len(self.x))
        self.chol = np.linalg.cholesky(k)
        self.alpha = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, self.y))

    def _log_likelihood(self, length: float) -> float:
        self._factor(length)
        return float(-0.5 * self.y @ self.alpha - np.log(np.diagonal(self.chol)).sum())

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation at rows of `x`, in the targets' own units."""
        k = matern52(np.asarray(x, dtype=np.float64), self.x, self.length)
        mean = k @ self.alpha
        v = np.linalg.solve(self.chol, k.T)
        var = np.maximum(1.0 - (v * v).sum(0), 1e-12)  # k(x, x) = 1 for this kernel
        return mean * self.scale + self.mean, np.sqrt(var) * self.scale


class BayesOpt:
    """Observations of an objective over 0/1 vectors, and UCB suggestions for the next one to try."""

    def __init__(self, dims: int, *, kappa: float = 2.5, noise: float = 1e-2, refit_every: int = 16,
                 max_points: int = 256) -> None:
        self.dims = dims
        self.kappa = kappa
        self.gp = GaussianProcess(noise)
        self.refit_every = refit_every
        self.max_points = max_points
        self.xs: list[np.ndarray] = []
        self.ys: list[float] = []
        self.seen: set[bytes] = set()
        self._fitted_at = 0

    def __len__(self) -> int:
        return len(self.ys)

    def register(self, x: np.ndarray, y: float) -> None:
        x = np.asarray(x, dtype=np.uint8)
        self.xs.append(x)
        self.ys.append(float(y))
        self.seen.add(x.tobytes())

    def evaluated(self, x: np.ndarray) -> bool:
        return np.asarray(x, dtype=np.uint8).tobytes() in self.seen

    def _training_rows(self) -> list[int]:
        """Every observation, or past `max_points` the best half and the most recent half of them: a GP's cost
        grows with the cube of its points, and a long search needs its good region and its latest steps."""
        n = len(self.ys)
        if n <= self.max_points:
            return list(range(n))
        half = self.max_points // 2
        best = np.argsort(self.ys)[::-1][:half].tolist()
        return sorted(set(best) | set(range(n - (self.max_points - half), n)))

    def best(self, k: int = 1) -> list[np.ndarray]:
        """The k best vectors observed, best first."""
        order = np.argsort(self.ys)[::-1][:k]
        return [self.xs[i] for i in order]

    def suggest(self, candidates: np.ndarray) -> np.ndarray | None:
        """The unevaluated candidate row with the highest UCB; None if every candidate was evaluated."""
        fresh = np.array([not self.evaluated(c) for c in candidates], dtype=bool)
        if not fresh.any():
            return None
        candidates = candidates[fresh]
        if len(self.ys) < 2:
            return candidates[0]
        refit = len(self.ys) - self._fitted_at >= self.refit_every or self.gp.length is None
        rows = self._training_rows()
        self.gp.fit(np.stack([self.xs[i] for i in rows]), np.array([self.ys[i] for i in rows]), choose_length=refit)
        if refit:
            self._fitted_at = len(self.ys)
        mean, std = self.gp.predict(candidates)
        return candidates[int(np.argmax(mean + self.kappa * std))]


def neighbours(x: np.ndarray, rng: np.random.Generator, count: int, *, keep_size: bool) -> np.ndarray:
    """`count` one-move neighbours of a 0/1 vector: swap a 1 with a 0 (`keep_size`), or flip one bit."""
    out = np.repeat(x[None].astype(np.uint8), count, axis=0)
    ones, zeros = np.flatnonzero(x), np.flatnonzero(x == 0)
    for row in out:
        if keep_size and len(ones) and len(zeros):
            row[rng.choice(ones)], row[rng.choice(zeros)] = 0, 1
        elif not keep_size:
            i = rng.integers(len(x))
            row[i] = 1 - row[i]
    return out


def candidate_pool(opt: BayesOpt, sample: Callable[[int], np.ndarray], rng: np.random.Generator, *,
                   random_count: int, around_best: int, per_best: int, keep_size: bool) -> np.ndarray:
    """Random vectors from `sample`, plus one-move neighbours of the best few observed."""
    parts = [sample(random_count)]
    for x in opt.best(around_best):
        parts.append(neighbours(x, rng, per_best, keep_size=keep_size))
    return np.concatenate(parts).astype(np.uint8)

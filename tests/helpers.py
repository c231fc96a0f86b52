"""Shared test helpers: tiny in-process models, and the losslessness checks every method must pass.

`assert_greedy_identical` and `assert_sampling_lossless` are what "lossless" means in this project;
each method's tests call them with the method's name (and parameters that make it draft a lot).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy import stats

from specgui import costs, fastpath, methods
from specgui.core import decode
from specgui.core.runner import Runner
from specgui.core.sampling import Sampling
from specgui.fastpath import compiled
from specgui.model.loading import LoadedModel
from specgui.model.tiny import CharTokenizer, tiny_model  # noqa: F401  (the tests' models)

# compiled programs on a CPU: inductor's C++ backend builds its kernels with the machine's compiler
needs_inductor = pytest.mark.skipif(compiled.available("cpu") is not None,
                                    reason="inductor's CPU backend needs a C++ compiler")

# checks of the CUDA graphs and the device's own clock: they skip themselves where no GPU is (CI)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

# One short prompt per suite category: for checks of what a suite run lays out, not of the suite's prompts
SHORT_PROMPTS = Path(__file__).resolve().parent / "data" / "short-prompts.jsonl"


def rounding_bound(length: int, magnitude: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """How far apart two computations of one sum of `length` products may land when they add in different orders
    (another BLAS blocking, another row count, another thread split), element-wise: each lies within
    gamma_n * sum|terms| of the exact sum, gamma_n = n*u / (1 - n*u) with u fp32's unit roundoff (Higham, *Accuracy
    and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5), so the two within twice that. `magnitude` is
    sum|terms| or a bound on it; a result stored in a narrower `dtype` adds one rounding of it on either side."""
    u = torch.finfo(torch.float32).eps / 2
    gamma = length * u / (1 - length * u)
    magnitude = torch.as_tensor(magnitude, dtype=torch.float64)
    return 2 * gamma * magnitude + 2 * (torch.finfo(dtype).eps / 2) * magnitude * (dtype != torch.float32)


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, length: int, magnitude: torch.Tensor | float) -> None:
    """`got` and `want` differ by no more than `rounding_bound` allows (a tolerance derived from the arithmetic, not
    a number that happened to pass on one CPU)."""
    gap = (got.double() - want.double()).abs()
    bound = rounding_bound(length, magnitude, got.dtype)
    assert bool((gap <= bound).all()), f"off by {float((gap - bound).max()):.3g} past the rounding bound"


def product_magnitude(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_k |x[i, k] * weight[j, k]| for every output [i, j] of `x @ weight.T`: the scale of its rounding."""
    return x.double().abs() @ weight.double().abs().T


_BASELINES: dict[tuple[int, tuple[int, ...], int], decode.Result] = {}


def baseline_run(lm: LoadedModel, ids: list[int], max_new_tokens: int) -> decode.Result:
    """Greedy baseline for a prompt, computed once per model, prompt and length (every method compares to it)."""
    key = (id(lm.model), tuple(ids), max_new_tokens)
    if key not in _BASELINES:
        _BASELINES[key] = decode.run(lm, ids, "baseline", max_new_tokens=max_new_tokens, fast_path="off")
    return _BASELINES[key]


drafting = methods.fixed  # (the tests' name)
flat_profile = costs.flat_profile  # (the tests' name)


def assert_greedy_identical(lm: LoadedModel, method: str, prompts: list[list[int]], max_new_tokens: int,
                            params: dict[str, Any] | None = None, min_accepted: int = 1,
                            fast_path: str = "auto", profile: costs.CostProfile | None = None) -> list:
    """`method` (on `fast_path`, priced by `profile` if given) must reproduce the eager baseline's greedy tokens
    exactly, and must actually have drafted."""
    params = drafting(method, params)
    accepted = 0
    results = []
    for ids in prompts:
        base = baseline_run(lm, ids, max_new_tokens)
        got = decode.run(lm, ids, method, max_new_tokens=max_new_tokens, params=params, fast_path=fast_path,
                         profile=profile)
        if got.token_ids != base.token_ids:
            pos = next(i for i, (a, b) in enumerate(zip([*got.token_ids, -1], [*base.token_ids, -1])) if a != b)
            raise AssertionError(f"{method} diverged from baseline at token {pos} "
                                 f"(baseline margin {base.margins[pos]:.3g}) on prompt {ids[:8]}...")
        accepted += got.summary.accepted
        results.append(got)
    assert accepted >= min_accepted, f"{method} accepted only {accepted} draft tokens: the test proves nothing"
    return results


def exact_pair_distribution(lm: LoadedModel, prompt: list[int], sampling: Sampling) -> torch.Tensor:
    """P(t2, t3) [V, V] of the 2nd and 3rd sampled tokens under the target alone, by enumeration."""
    from specgui.core.sampling import probabilities

    vocab = lm.model.config.vocab_size
    with torch.no_grad():
        base = torch.tensor(prompt)
        p1 = probabilities(lm.model(base[None]).logits[0, -1], sampling)  # [V]
        seqs = torch.tensor(list(itertools.product(range(vocab), repeat=2)))  # [(t1, t2)]
        batch = torch.cat([base.expand(len(seqs), -1), seqs], dim=1)
        logits = lm.model(batch).logits  # [V*V, T, V]
        p2 = probabilities(logits[:, -2], sampling)[:: vocab]  # P(t2 | t1): one row per t1
        p3 = probabilities(logits[:, -1], sampling).view(vocab, vocab, vocab)  # P(t3 | t1, t2)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [t1, t2, t3]
    return joint.sum(0)


def assert_sampling_lossless(lm: LoadedModel, method: str, prompt: list[int], *, runs: int = 2000,
                             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                             params: dict[str, Any] | None = None, alpha: float = 1e-3) -> dict[str, int]:
    """Chi-square test: the method's (t2, t3) frequencies match the target's exact distribution.

    t1 comes from the prompt forward; t2 and t3 come from speculative steps, so this tests the verifier
    with whatever the method drafts. Each run asks for 4 tokens, so that the first step can draft two (a
    Fractal restart drafts its own forward's token and a slot's after it: at a depth of one it would not
    draft). Fails (with p < alpha) if the method biases the output; also fails if the method never drafted
    or never saw a rejection, because then nothing was tested.
    """
    params = drafting(method, params)
    vocab = lm.model.config.vocab_size
    counts = torch.zeros(vocab, vocab)
    seen = {"drafted": 0, "accepted": 0, "rejected_steps": 0}
    # the draft sizes are fixed, so no price decides anything: a hand-made profile, which learns and saves nothing
    # (a measured one saved what each of the thousands of runs taught it, a third of a run's time)
    profile = flat_profile(lm, fastpath.resolve("auto", lm.runner))
    for seed in range(runs):
        sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        result = decode.run(lm, prompt, method, max_new_tokens=4, sampling=sampling, params=params, profile=profile)
        t = result.token_ids
        counts[t[1], t[2]] += 1
        for step in result.steps:
            seen["drafted"] += step.drafted
            seen["accepted"] += step.accepted
            seen["rejected_steps"] += int(step.corrected)
    expected = exact_pair_distribution(lm, prompt, Sampling(temperature=temperature, top_p=top_p, top_k=top_k))
    observed, expect = _merge_small_cells(counts.flatten(), expected.flatten() * runs)
    chi2, p_value = stats.chisquare(observed.numpy(), expect.numpy())
    assert seen["accepted"] > runs // 20 and seen["rejected_steps"] > runs // 20, f"too little drafting to test: {seen}"
    assert p_value > alpha, f"{method}: output distribution differs from the target (chi2={chi2:.1f}, p={p_value:.2e})"
    return seen


def _merge_small_cells(observed: torch.Tensor, expected: torch.Tensor, minimum: float = 5.0):
    """Pool cells with expected count < minimum into one, as the chi-square approximation needs."""
    small = expected < minimum
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] < minimum:
        obs, exp = obs[:-1], exp[:-1]
    scale = obs.sum() / exp.sum()
    assert math.isclose(float(scale), 1.0, rel_tol=0.05), "pooled cells dropped too much mass"
    return obs, exp * scale


def on_cuda(lm: LoadedModel, dtype: torch.dtype = torch.float32, device: str = "cuda") -> LoadedModel:
    """`lm` (an in-process model) moved to the GPU (`device`), with a runner of its own there."""
    model = lm.model.to(device, dtype)
    return LoadedModel(spec=lm.spec, name=lm.name, model=model, tokenizer=lm.tokenizer, runner=Runner(model),
                       stop_ids=lm.stop_ids, max_context=lm.max_context, load_s=0.0, source="in-process")

"""The verifier: which draft tokens the target keeps, and the token it adds itself.

One rule serves chains and trees, model drafts and n-gram drafts. Walk down from the pending token;
at each node the target's distribution p decides among the node's children, in the drafter's order:

  greedy:   follow the child equal to argmax p; if none, emit argmax p (a correction).
  sampling: accept child x with probability min(1, p(x) / q(x)); on rejection replace p by
            norm(max(p - q, 0)) and try the next child; if all are rejected, sample from p.

q is the draft distribution of the child (one-hot for n-gram drafts, where max(p - q, 0) simply
removes x). This is speculative sampling (Leviathan et al. 2023; Chen et al. 2023) extended to
several candidates per node as in SpecInfer; each node's output is distributed exactly as p.
A fully accepted path ends with a bonus token drawn from p at its leaf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgui.draft import Draft
from specgui.sampling import Sampling, probabilities


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted nodes, root to leaf
    token: int  # verifier's own token
    corrected: bool  # True when the own token replaced a rejected draft token


def verify(logits: torch.Tensor, draft: Draft, sampling: Sampling, generator: torch.Generator | None) -> Verdict:
    """Decide a draft against target `logits` [1 + N, V] (row 0: the pending token, row i + 1: node i)."""
    children = draft.children()
    if sampling.greedy:
        return _greedy(logits, draft, children)
    return _sample(logits, draft, children, sampling, generator)


def _greedy(logits: torch.Tensor, draft: Draft, children: dict[int, list[int]]) -> Verdict:
    best = logits.argmax(-1).tolist()
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        match = next((c for c in children[node] if draft.tokens[c] == want), None)
        if match is None:
            return Verdict(path, want, corrected=bool(children[node]))
        path.append(match)
        node = match


def _sample(
    logits: torch.Tensor,
    draft: Draft,
    children: dict[int, list[int]],
    sampling: Sampling,
    generator: torch.Generator | None,
) -> Verdict:
    path: list[int] = []
    node = -1
    while True:
        p = probabilities(logits[node + 1], sampling)
        accepted = None
        for child in children[node]:
            token = draft.tokens[child]
            q = _draft_probs(draft, child, p)
            ratio = p[token] / q[token] if q[token] > 0 else torch.zeros(())
            u = torch.rand((), generator=generator, device=p.device)
            if u < ratio:
                accepted = child
                break
            residual = (p - q).clamp_min(0)
            total = residual.sum()
            if total <= 0:  # p <= q everywhere means p == q: rejection had probability 0
                continue
            p = residual / total
        if accepted is None:
            token = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, token, corrected=bool(children[node]))
        path.append(accepted)
        node = accepted


def _draft_probs(draft: Draft, node: int, like: torch.Tensor) -> torch.Tensor:
    if draft.probs is not None:
        return draft.probs[node].to(like.device, torch.float32)
    onehot = torch.zeros_like(like)
    onehot[draft.tokens[node]] = 1.0
    return onehot

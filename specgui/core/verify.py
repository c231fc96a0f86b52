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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specgui.core.draft import Draft, Rider
from specgui.core.kvcache import read_together
from specgui.core.runner import VERIFY_TOP, Top, top_of
from specgui.core.sampling import Sampling, probabilities


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted nodes, root to leaf
    token: int  # verifier's own token
    corrected: bool  # True when the own token replaced a rejected draft token
    margins: list[float] = field(default_factory=list)  # target top-1 minus top-2 logit: pending row, then the path's
    extra_tokens: list[int] | None = None  # the target's argmax at each extra row whose logits came back


def verify(logits: torch.Tensor | Top, draft: Draft, sampling: Sampling, generator: torch.Generator | None,
           extra_logits: torch.Tensor | None = None, before_read: Callable[[], None] | None = None,
           riders: Sequence[Rider] = (), extra_rows: Sequence[int] | None = None) -> Verdict:
    """Decide a draft against target `logits` [1 + N, V] (row 0: the pending token, row i + 1: node i), or, under
    greedy decoding, against their `Top` (what the fast path's program computes: `Runner.forward(top=)`). With
    `extra_rows`, `logits` is the `Top` of the whole verify block and the extras' choices are its rows past the tree's
    at those offsets, read in the same piece (no join).

    Under greedy decoding the step reads the device once: the target's choice and margin of every row, the choice
    at every row of `extra_logits`, an `unread` draft's nodes and the `riders`' values travel in one tensor
    (`before_read` is called just before, where the decode loop marks its clock), and the walk down the tree runs on
    the host over that read. Sampling reads as it goes (the acceptance test draws per child)."""
    if not sampling.greedy and isinstance(logits, Top):
        raise TypeError("sampling verifies against logits: a Top keeps only the likeliest ids")
    target = logits if isinstance(logits, Top) else top_of(logits, VERIFY_TOP)
    extra = None if extra_logits is None else top_of(extra_logits, VERIFY_TOP)
    parts = [target.packed]
    if extra is not None and len(extra):
        parts.append(extra.ids[:, 0])
    if draft.unread is not None:
        parts.append(draft.unread.packed())
    parts += [rider.device.reshape(-1).float() for rider in riders]
    if before_read is not None:
        before_read()
    values = read_together(parts)
    end = len(values)
    for rider in reversed(riders):
        start = end - rider.device.numel()
        rider.values, end = values[start:end], start
    # from here on host work the device waits for: rows are read as the walk asks (a tree's rows are many, its path
    # a few), and the tree's shape is made once (`Draft.children`)
    rows, width = len(target), target.packed.shape[1]

    def best(row: int) -> int:
        return int(values[row * width])

    extras = len(extra) if extra is not None else 0
    done = rows * width
    extra_tokens = [int(v) for v in values[done : done + extras]] if extra is not None else None
    if extra_rows is not None:
        extra_tokens = [best(1 + len(draft) + r) for r in extra_rows]
    if draft.unread is not None:
        draft.settle(values[done + extras : end])
    children = draft.children()
    path, token, corrected = (_greedy(best, draft, children) if sampling.greedy
                              else _sample(logits, draft, children, sampling, generator))
    kept = [values[draft.block_row(node) * width + width - 1] for node in [-1, *path]]  # the rows' margins
    return Verdict(path, token, corrected, kept, extra_tokens)


def _greedy(best: Callable[[int], int], draft: Draft, children: Mapping[int, Sequence[int]]
            ) -> tuple[list[int], int, bool]:
    path: list[int] = []
    node = -1
    while True:
        want = best(draft.block_row(node))
        match = next((c for c in children[node] if draft.tokens[c] == want), None)
        if match is None:
            return path, want, bool(children[node])
        path.append(match)
        node = match


def _sample(
    logits: torch.Tensor,
    draft: Draft,
    children: Mapping[int, Sequence[int]],
    sampling: Sampling,
    generator: torch.Generator | None,
) -> tuple[list[int], int, bool]:
    path: list[int] = []
    node = -1
    while True:
        p = probabilities(logits[draft.block_row(node)], sampling)
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
            return path, token, bool(children[node])
        path.append(accepted)
        node = accepted


def _draft_probs(draft: Draft, node: int, like: torch.Tensor) -> torch.Tensor:
    if draft.probs is not None:
        return draft.probs[node].to(like.device, torch.float32)
    onehot = torch.zeros_like(like)
    onehot[draft.tokens[node]] = 1.0
    return onehot

"""`swift`: SWIFT (Xia et al. 2024), on-the-fly self-speculative decoding: the skip set is searched while decoding.

SWIFT runs in two phases (hemingkx/SWIFT, `swift_optimization` and `swift_draft`):

  * optimisation: every `opt_interval` verify steps, once `context_window` + 1 tokens have been generated,
    it proposes a skip set of k = skip_ratio x 2(L - 2) sub-layers (the first and last layer always run):
    a random k-subset, or, every `bayes_interval`-th proposal, a Bayesian-optimisation suggestion from
    every (set, score) seen so far. The score is the matchness: the skipped model, teacher-forced over the
    request's first `context_window` + 1 generated tokens (the prompt's keys are the full model's), predicts
    each next token in one forward. A proposal that beats the best score so far becomes the drafting set,
    otherwise drafting keeps the best. The phase ends when the best score passes `max_score`, after
    `max_opt_iter` proposals, or after `max_tolerance_iter` proposals in a row without an improvement.
  * acceleration: the target drafts with the chosen set. Confidence-aware: a draft stops after a token
    whose top-1 probability is below `exit_threshold`, and at each draft position the verifier also
    tries the draft's runner-up tokens as siblings of the drafted one, more of them where the draft was
    less sure ("dynamic verification": `candidates` a,b,c,d tokens at top-1 probability above 0.95,
    above 0.8, above 0.5, else; 1,1,1,1 verifies the chain alone).

SWIFT optimises over a task's stream of requests: the code keeps one optimiser and its statistics across
all prompts. With `persist` the search state (best set and score, the observations, the counters) is kept
per model and setting in this process, so later generations continue the search or, once it has ended,
only accelerate; without it each generation starts afresh. Either way a generation scores proposals on
its own text: the search follows the current context.

Where this differs from the code, and why:
  * The Bayesian step is `bayesopt` (our Gaussian process and UCB, kappa 2.5 and noise 1e-2 as in the
    code), maximised over k-subsets directly (random ones and one-swap neighbours of the best sets)
    instead of over the box [0, 1]^d with the top-k coordinates taken afterwards.
  * The starting set is the code's every-other-layer interleave trimmed to the budget (k/2 evenly spaced
    whole layers) so that it has as many sub-layers as every proposal.
  * The draft length comes from the cost model (`policy: cost`, shared by every method; `max_draft` is the
    most), which pauses drafting where no draft is predicted to pay; the optimisation goes on through
    pauses that a probe may end, since that phase is SWIFT's own cost, but not while no draft could pay even
    at the prior's acceptance (`Sizing.hopeless`): there a proposal's scoring forward buys nothing (SmolLM2-135M
    on a CPU, where the scoring forwards cost more than SWIFT's drafts saved). A
    verify is priced with the siblings it carried lately.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specgui.core.draft import Draft, Outcome, Unread
from specgui.core.runner import Runner
from specgui.errors import SpecGUIError
from specgui.fastpath import CHAIN_NODES
from specgui.methods.base import DecodeState, register
from specgui.methods.layerskip.bayesopt import BayesOpt, candidate_pool
from specgui.methods.layerskip.drafting import Chain, ExitThreshold, LayerSkipDrafter, LayerSkipParams, UnreadChain
from specgui.methods.layerskip.skipsearch import SkipSpace, matchness
from specgui.methods.params import param

CONFIDENCE_STEPS = (0.95, 0.8, 0.5)  # dynamic verification: width by the draft's top-1 probability


def parse_widths(text: str) -> tuple[int, int, int, int]:
    """'3,5,8,10' -> (3, 5, 8, 10): candidates per draft position, from the surest draft to the least sure."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if len(widths) != 4 or any(not 1 <= w <= CHAIN_NODES for w in widths):  # a chained draft's ids a position
        raise SpecGUIError(f"swift.candidates must be four comma-separated counts from 1 to {CHAIN_NODES}, "
                           f"got {text!r}")
    return widths  # type: ignore[return-value]


@dataclass(frozen=True)
class SwiftParams(LayerSkipParams):
    skip_ratio: float = param(low=0.0, high=0.95, help="share of the 2(L - 2) sub-layers between the first and last "
                                                       "layer that a skip set leaves out")
    context_window: int = param(low=1, high=512, help="generated tokens each proposal is scored on (and how many "
                                                      "come before the first proposal)")
    opt_interval: int = param(low=1, high=64, help="verify steps between proposals during the optimisation phase")
    bayes_interval: int = param(low=1, high=1024, help="every n-th proposal is a Bayesian suggestion, the rest random")
    max_opt_iter: int = param(low=0, high=100000, help="proposals before the optimisation phase ends")
    max_tolerance_iter: int = param(low=1, high=100000, help="proposals in a row without improvement that end it")
    max_score: float = param(low=0.0, high=1.0, help="matchness at which the optimisation phase ends early")
    exit_threshold: float = param(low=0.0, high=1.0, help="a draft stops after a token whose top-1 probability is "
                                                          "below this (confidence-aware early stop)")
    candidates: str = param(help="tokens verified per draft position by the draft's top-1 probability (> 0.95, "
                                 "> 0.8, > 0.5, else); 1,1,1,1 verifies the chain only")
    persist: bool = param(help="carry the search across generations on the same model, as SWIFT does over a "
                               "stream of requests")

    def __post_init__(self) -> None:
        parse_widths(self.candidates)


class SwiftSearch:
    """SWIFT's optimisation phase over one model: proposals, their matchness, the best set so far."""

    def __init__(self, space: SkipSpace, size: int, params: SwiftParams) -> None:
        self.space, self.size, self.params = space, size, params
        self.rng = np.random.default_rng(1)  # the code seeds its optimiser with random_state=1
        self.opt = BayesOpt(len(space), kappa=2.5, noise=1e-2)
        self.best = self._start()
        self.best_score = 0.0  # the code's origin_score: any measured proposal beats the unmeasured start
        self.iteration = 0
        self.tolerance = 0
        self.active = params.max_opt_iter > 0 and size > 0

    def _start(self) -> np.ndarray:
        """k/2 evenly spaced whole layers (plus one attention when k is odd): SWIFT's interleave, sized to k."""
        layers = sorted({layer for layer, _ in self.space.units})
        whole = self.size // 2
        picked = [layers[round(i * (len(layers) - 1) / max(1, whole - 1))] for i in range(whole)] if whole else []
        x = np.zeros(len(self.space), dtype=np.uint8)
        for i, (layer, _) in enumerate(self.space.units):
            if layer in picked:
                x[i] = 1
        spare = [i for i, (layer, _) in enumerate(self.space.units) if not x[i]]
        x[spare[: self.size - int(x.sum())]] = 1
        return x

    def propose(self) -> tuple[np.ndarray, str]:
        if (self.iteration + 1) % self.params.bayes_interval == 0 and len(self.opt) >= 2:
            pool = candidate_pool(self.opt, lambda n: self.space.random_subsets(self.rng, n, self.size), self.rng,
                                  random_count=256, around_best=4, per_best=32, keep_size=True)
            suggestion = self.opt.suggest(pool)
            if suggestion is not None:
                return suggestion, "bayes"
        return self.space.random_subsets(self.rng, 1, self.size)[0], "random"

    def record(self, x: np.ndarray, score: float) -> bool:
        """Register a scored proposal; True when it became the best set. Ends the phase by SWIFT's rules."""
        self.opt.register(x, score)
        kept = score > self.best_score
        if kept:
            self.best, self.best_score, self.tolerance = x, score, 0
            if score > self.params.max_score:
                self.active = False
        else:
            self.tolerance += 1
        self.iteration += 1
        if self.tolerance > self.params.max_tolerance_iter or self.iteration > self.params.max_opt_iter:
            self.active = False
        return kept


# runner -> setting -> search: SWIFT's optimiser outlives a request (see the module docstring, `persist`)
_SEARCHES: weakref.WeakKeyDictionary[Runner, dict[tuple, SwiftSearch]] = weakref.WeakKeyDictionary()


@register
class Swift(LayerSkipDrafter):
    name = "swift"
    title = "SWIFT"
    summary = "Searches the skip set while decoding (random + Bayesian search on its own output), drafts confidently."
    Params = SwiftParams
    pauses_plainly = False  # its search runs forwards of its own between steps, paused or not
    chains = False  # its trees carry siblings, which a chain drafted at the launch does not

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        p = self.params
        layers = self.runner.num_layers
        space = SkipSpace.of(range(1, layers - 1) if layers > 2 else range(layers))
        size = min(len(space), max(1, int(len(space) * p.skip_ratio)))  # tiny models: at least one sub-layer
        key = (size, p.context_window, p.opt_interval, p.bayes_interval, p.max_opt_iter, p.max_tolerance_iter,
               p.max_score)
        if p.persist:
            searches = _SEARCHES.setdefault(self.runner, {})
            self.search = searches.get(key) or searches.setdefault(key, SwiftSearch(space, size, p))
        else:
            self.search = SwiftSearch(space, size, p)
        self.widths = parse_widths(p.candidates)
        self.alternatives = max(self.widths) - 1
        self.plan = space.plan(self.search.best)
        state.adopt(self.plan, nodes=self.alternatives + 1)
        self.search_ms = 0.0
        self.width = 1.0  # verified nodes per chain position lately (dynamic verification's siblings)
        return None

    def rows(self, k: int) -> int:
        return round(k * self.width)


    def unread_proposal(self, chain: UnreadChain) -> Draft:
        """The widest tree dynamic verification can make (every chain position with all its runner-ups), each
        sibling standing where its position's confidence allows that many (`Unread`, decided on the host once
        read): the verify carries them all."""
        k, spare = chain.size, self.alternatives
        spine = [i * (spare + 1) for i in range(k)]
        parents = [spine[i - 1] if i else -1 for i in range(k) for _ in range(spare + 1)]

        def decide(values: list[float]) -> tuple[list[int], list[int], list[float]]:
            kept: list[int] = []
            tokens: list[int] = []
            confidences: list[float] = []
            for i, (ids, probs) in enumerate(chain.standing(values)):
                width = self.widths[sum(probs[0] <= step for step in CONFIDENCE_STEPS)]
                kept += range(i * (spare + 1), i * (spare + 1) + width)
                tokens += ids[:width]
                confidences += probs[:width]
            return kept, tokens, confidences

        self.width = 0.8 * self.width + 0.2 * (spare + 1)
        ids = None if chain.placed else chain.top.ids[:, : spare + 1]
        return Draft(parents=parents, unread=Unread(len(parents), ids, chain.top.packed, decide, spine))

    def make_exit(self) -> ExitThreshold:
        return ExitThreshold(self.params.exit_threshold)

    def proposal(self, chain: Chain) -> dict[str, Any]:
        """The chain plus each position's runner-up tokens as sibling leaves (dynamic verification)."""
        tokens: list[int] = []
        parents: list[int] = []
        confidences: list[float] = []
        rows: list[tuple[int, int | None]] = []  # (chain position, sibling token or None for the chain token)
        parent = -1
        for i, (token, confidence) in enumerate(zip(chain.tokens, chain.confidences)):
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            confidences.append(confidence)
            rows.append((i, None))
            width = self.widths[sum(confidence <= step for step in CONFIDENCE_STEPS)]
            for alt, prob in (chain.alternatives[i] if i < len(chain.alternatives) else [])[: width - 1]:
                tokens.append(alt)
                parents.append(parent)
                confidences.append(prob)
                rows.append((i, alt))
            parent = node
        if chain.tokens:
            self.width = 0.8 * self.width + 0.2 * len(tokens) / len(chain.tokens)
        probs = None
        if chain.probs is not None:  # siblings are chosen, not sampled: one-hot, which keeps sampling exact
            probs = torch.stack([chain.probs[i] if alt is None else _one_hot(chain.probs[i], alt) for i, alt in rows])
        return {"tokens": tokens, "parents": parents, "probs": probs, "confidences": confidences}

    def learn(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        search, p = self.search, self.params
        payload: dict[str, Any] = {}
        hopeless = self.sizing_plan is not None and self.sizing_plan.hopeless
        due = (not outcome.prefill and search.active and not hopeless and state.generated > p.context_window + 1
               and state.step % p.opt_interval == 0 and state.max_depth > 0)
        if due:
            start = time.perf_counter()
            x, kind = search.propose()
            window = state.tokens[state.prompt_len : state.prompt_len + p.context_window + 1]
            right, total = matchness(self.runner, state.cache, state.prompt_len, window, search.space.plan(x),
                                     self.vocab)
            score = right / total
            kept = search.record(x, score)
            self.plan = search.space.plan(search.best)
            self.search_ms = (time.perf_counter() - start) * 1000  # (the plan's capture is no part of the search)
            state.adopt(self.plan, nodes=self.alternatives + 1)
            payload.update(search_ms=self.search_ms, proposal=search.space.plan(x).to_dict())
            payload["search"] = {"phase": "optimizing" if search.active else "done", "iteration": search.iteration,
                                 "kind": kind, "score": score, "best": search.best_score, "kept": kept}
        else:
            payload["search"] = {"phase": "optimizing" if search.active else "done", "iteration": search.iteration,
                                 "best": search.best_score}
        if outcome.prefill:
            payload["skip"] = self.plan.to_dict()
        return payload


def _one_hot(like: torch.Tensor, token: int) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[token] = 1.0
    return out

"""Layer-skip self-speculation: the draft model is the target itself with some sub-layers left out.

`clasp` and `admg` differ only in how they choose the skip set; everything else lives here:

  * `draft_chain`: the skipped model drafts autoregressively, one token per forward, over the SAME
    KV cache (the prefix keys are the full model's; the draft's own keys are cropped afterwards), and
    stops after a token whose top-1 probability falls below the draft-exit threshold.
  * `ExitThreshold`: that threshold, fixed (CLaSp's DET) or adaptive (Draft & Verify, section 3.4).
  * `BackOff`: a draft forward costs most of a full forward unless many layers are skipped (on a CPU,
    skipping 10 of SmolLM2's 30 layers still costs 0.72 of a forward), so drafting only pays while
    acceptance is high. The back-off measures what drafting actually gains and pauses it, for
    exponentially longer stretches, while it loses; one probe step after each pause decides again.
  * `LayerSkipDrafter`: the drafter both methods subclass; they set `self.plan` and add payload.

Sampling stays lossless because every draft token carries the distribution it was sampled from
(`Draft.probs`, processed exactly like the target's by `specgui.sampling.probabilities`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from specgui.draft import Draft, Outcome
from specgui.methods.base import DecodeState, Drafter
from specgui.params import param
from specgui.runner import Observer, SkipPlan
from specgui.sampling import probabilities


@dataclass
class Chain:
    """A skipped-model draft: tokens, their draft distributions (sampling only), why it stopped."""

    tokens: list[int]
    probs: torch.Tensor | None  # [N, V]
    confidences: list[float]  # top-1 probability of the draft distribution at each token
    reason: str  # "threshold", "max" (draft length limit), "budget" (end of the generation) or "paused"
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: runners-up (token, prob)


def draft_chain(state: DecodeState, plan: SkipPlan, limit: int, max_draft: int, threshold: float,
                alternatives: int = 0) -> Chain:
    """Draft up to `limit` tokens with `plan`'s sub-layers skipped; leaves the cache as it found it.

    With `alternatives` > 0, each position also records that many runner-up tokens of its draft
    distribution with their probabilities, most likely first (SWIFT's dynamic verification turns them into
    sibling candidates).
    """
    runner, start, sampling = state.runner, state.committed, state.sampling
    tokens: list[int] = []
    dists: list[torch.Tensor] = []
    confidences: list[float] = []
    others: list[list[tuple[int, float]]] = []
    token, reason = state.pending, ("max" if limit >= max_draft else "budget")
    for i in range(limit):
        logits = runner.forward(torch.tensor([token]), torch.tensor([start + i]), state.cache, skip=plan)[0]
        if sampling.greedy:
            probs = logits.softmax(-1)
            token = int(probs.argmax())
        else:
            probs = probabilities(logits, sampling)
            token = int(torch.multinomial(probs, 1, generator=state.generator))
            dists.append(probs)
        tokens.append(token)
        confidences.append(float(probs.max()))
        if alternatives > 0:
            top = probs.topk(min(alternatives + 1, probs.numel()))
            ranked = zip(top.indices.tolist(), top.values.tolist())
            others.append([(t, p) for t, p in ranked if t != token][:alternatives])
        if confidences[-1] < threshold:
            reason = "threshold"
            break
    state.cache.crop(start)  # the draft's own keys go; the verify forward writes the real ones
    return Chain(tokens, torch.stack(dists) if dists else None, confidences, reason, others)


class ExitThreshold:
    """The draft-exit threshold on the draft's top-1 probability.

    Fixed when `target` is None (CLaSp's DET). Otherwise Draft & Verify's adaptive rule: an EMA of
    the per-draft acceptance rate (beta1) is compared with `target`; the threshold moves by `step`
    towards stricter when acceptance is below target and looser above, smoothed by beta2. A draft that
    stopped for another reason than the threshold says nothing about it and leaves it unchanged.
    """

    BETA1, BETA2 = 0.5, 0.9  # Draft & Verify's smoothing constants

    def __init__(self, start: float, target: float | None = None, step: float = 0.0) -> None:
        self.value = start
        self.target = target
        self.step = step
        self.acceptance: float | None = None

    def update(self, accepted: int, drafted: int, reason: str) -> None:
        if self.target is None or drafted == 0:
            return
        rate = accepted / drafted
        self.acceptance = rate if self.acceptance is None else self.BETA1 * self.acceptance + (1 - self.BETA1) * rate
        if reason != "threshold":
            return
        moved = self.value + (self.step if self.acceptance <= self.target else -self.step)
        self.value = min(1.0, max(0.0, self.BETA2 * self.value + (1 - self.BETA2) * moved))


class BackOff:
    """Decides, step by step, whether to draft at all, from the time drafting measurably saves.

    Each drafted step's gain is (tokens it emitted x the time of a plain step) / (time it took: draft
    + verify + the drafter's amortized overhead); the gain over the last `window` drafted steps below 1
    means drafting loses, and drafting pauses for `pause` steps. Each pause is GROWTH times the
    previous (at most `max_pause`); each step that wins divides it again. After a pause the window is
    empty, so one probe step decides whether drafting resumes. A failed probe costs most of a
    forward, so pauses grow fast: where drafting never wins, 64 steps hold 4 probes (6 with doubling).
    The plain step time is measured on paused steps (a verify forward of the pending token alone);
    until there is one, the step's own verify time stands in for it, which is close wherever a verify
    of a few tokens costs about one token.
    """

    GROWTH = 4

    def __init__(self, window: int, max_pause: int) -> None:
        self.history: deque[tuple[float, float]] = deque(maxlen=window)  # (plain-time equivalent, spent)
        self.max_pause = max_pause
        self.pause = 1
        self.left = 0
        self.plain_ms: float | None = None
        self.gain: float | None = None

    def drafting(self) -> bool:
        """Whether this step drafts; call once per step."""
        if self.left > 0:
            self.left -= 1
            return False
        return True

    def plain_step(self, verify_ms: float) -> None:
        self.plain_ms = verify_ms if self.plain_ms is None else 0.8 * self.plain_ms + 0.2 * verify_ms

    def drafted_step(self, tokens: int, verify_ms: float, spent_ms: float) -> None:
        self.history.append((tokens * (self.plain_ms or verify_ms), spent_ms))
        self.gain = sum(saved for saved, _ in self.history) / max(1e-9, sum(spent for _, spent in self.history))
        if self.gain >= 1.0:
            self.pause = max(1, self.pause // self.GROWTH)
        elif self.max_pause > 0:
            self.left = min(self.pause, self.max_pause)
            self.pause = min(self.GROWTH * self.pause, self.max_pause)
            self.history.clear()

    @property
    def paused(self) -> bool:
        return self.left > 0


@dataclass(frozen=True)
class LayerSkipParams:
    """Drafting tunables every layer-skip method shares (each method adds its own)."""

    max_draft: int = param(low=1, high=32, help="most draft tokens per step (K)")
    backoff_window: int = param(low=1, high=64, help="drafted steps over which the back-off measures the gain")
    max_pause: int = param(low=0, high=256, help="longest pause (steps without drafting) when drafting loses "
                                                 "time; 0 never pauses")


@dataclass(frozen=True)
class AdaptiveExitParams(LayerSkipParams):
    """Draft & Verify's adaptive draft-exit (section 3.4), for the methods that use it (`dv`, `admg`)."""

    exit_threshold: float = param(low=0.0, high=1.0, help="initial draft-exit threshold on the draft's top-1 "
                                                          "probability")
    target_acceptance: float = param(low=0.0, high=1.0, help="acceptance rate the adaptive exit steers towards")
    exit_step: float = param(low=0.0, high=1.0, help="how far the exit threshold moves per step (before smoothing)")


def adaptive_exit(params: AdaptiveExitParams) -> ExitThreshold:
    """The adaptive exit threshold that `params` describe."""
    return ExitThreshold(params.exit_threshold, target=params.target_acceptance, step=params.exit_step)


class LayerSkipDrafter(Drafter):
    """Drafts with `self.plan` skipped; subclasses choose the plan in `begin` / `learn`."""

    def begin(self, state: DecodeState) -> Observer | None:
        self.plan = SkipPlan()
        self.exit = self.make_exit()
        self.backoff = BackOff(self.params.backoff_window, self.params.max_pause)
        self.chain: Chain | None = None
        return None

    def make_exit(self) -> ExitThreshold:
        raise NotImplementedError

    def overhead_ms(self) -> float:
        """Drafting work outside the draft loop, per drafted step (CLaSp's amortized DP)."""
        return 0.0

    def draft(self, state: DecodeState) -> Draft:
        limit = min(self.params.max_draft, state.max_depth)
        drafting = self.backoff.drafting() and limit > 0
        self.chain = (draft_chain(state, self.plan, limit, self.params.max_draft, self.exit.value, self.alternatives)
                      if drafting else None)
        shown = self.chain or Chain([], None, [], "paused" if limit > 0 else "budget")
        skipped = self.plan if drafting else SkipPlan()  # a paused step skipped nothing: it drafted nothing
        fields = self.proposal(shown)
        confidences = fields.pop("confidences", shown.confidences)
        info = {"skip": skipped.to_dict(), "draft_len": limit if drafting else 0,
                "exit": {"threshold": self.exit.value, "confidences": confidences, "reason": shown.reason}}
        return Draft(**fields, observer=self.observer(drafting), info=info)

    alternatives = 0  # runner-up tokens `draft_chain` records per position (for `proposal`)

    def proposal(self, chain: Chain) -> dict[str, Any]:
        """The `Draft` fields (tokens, parents, probs) built from the chain, plus "confidences" (the draft
        probability of each node, for the inspector) when they differ from the chain's: the chain itself here."""
        return {"tokens": chain.tokens, "probs": chain.probs}

    def observer(self, drafting: bool) -> Observer | None:
        """An observer for this step's verify forward (CLaSp records hidden states); None by default."""
        return None

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        payload: dict[str, Any] = {}
        if not outcome.prefill:
            if self.chain is None:
                self.backoff.plain_step(outcome.verify_ms)
            else:
                self.exit.update(outcome.accepted, len(self.chain.tokens), self.chain.reason)
                self.backoff.drafted_step(1 + outcome.accepted, outcome.verify_ms,
                                          outcome.draft_ms + outcome.verify_ms + self.overhead_ms())
                payload["gain"] = self.backoff.gain
        payload.update(self.learn(state, outcome))
        return payload

    def learn(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        """Method-specific update after a verify (or the prefill); returns extra payload."""
        return {}

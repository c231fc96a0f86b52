"""Layer-skip self-speculation: the draft model is the target itself with some sub-layers left out.

`clasp` and `admg` differ only in how they choose the skip set; everything else lives here:

  * `draft_chain`: the skipped model drafts autoregressively, one token per forward, over the SAME
    KV cache (the prefix keys are the full model's; the draft's own keys are cropped afterwards), and
    stops after a token whose top-1 probability falls below the draft-exit threshold.
  * `ExitThreshold`: that threshold, fixed (CLaSp's DET) or adaptive (Draft & Verify, section 3.4).
  * `LayerSkipDrafter`: the drafter both methods subclass; they set `self.plan` and add payload. How
    many tokens it drafts is the cost model's call (`specgui.methods.policy`): a draft token costs a
    forward with the plan's sub-layers skipped, which is most of a full forward unless many layers are
    skipped (on a CPU, skipping 10 of SmolLM2's 30 layers still costs 0.72 of one), so drafting pays only
    where acceptance is high and the verify of the draft is cheap. Where no length pays, it pauses.

Sampling stays lossless because every draft token carries the distribution it was sampled from
(`Draft.probs`, processed exactly like the target's by `specgui.core.sampling.probabilities`).

With `draft_vocab` > 0 a draft forward computes the LM head over a draft vocabulary only (`specgui.core.vocab`): the
`draft_vocab` lowest ids plus the prompt's and the output's. Its exit confidence (CLaSp's DET, Draft & Verify's
adaptive exit, SWIFT's widths) is the top-1 probability of the subset's softmax, re-derived on the subset: a
subset's softmax puts more on its top token than the full one does when the full vocabulary's mass outside it is
not negligible, so a draft may run a token further than it would with the full head before it exits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specgui import fastpath
from specgui.core.draft import Draft, Outcome, SkipChain, Unread
from specgui.core.runner import Observer, SkipPlan, Top, top_of
from specgui.core.sampling import Sampling, probabilities
from specgui.core.vocab import DraftVocab, head_ms
from specgui.methods.base import DecodeState, Drafter
from specgui.methods.params import param
from specgui.methods.policy import SizedParams, Sizing


@dataclass
class Chain:
    """A skipped-model draft: tokens, their draft distributions (sampling only), why it stopped."""

    tokens: list[int]
    probs: torch.Tensor | None  # [N, V]
    confidences: list[float]  # top-1 probability of the draft distribution at each token
    reason: str  # "threshold", "limit" (the size drafted for), "budget" (end of the generation) or "paused"
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: runners-up (token, prob)


@dataclass
class UnreadChain:
    """A chain drafted on the device (`DecodeState.unread`): `size` tokens whatever their confidence, as the draft
    head's verdicts (a `Top` of `k` ids a row, a row per chain position, its token first, then the runners-up, with
    their draft probabilities), and the exit threshold that decides, once they are read, which tokens stand. `top` is
    where the host's launch left them (None: a chain the device drafts at the step's launch, `SkipChain`)."""

    size: int
    k: int
    threshold: float
    placed: bool  # whether the nodes' ids already sit where the verify reads them (`fastpath.chain`)
    top: Top | None = None

    def standing(self, values: list[float]) -> Iterator[tuple[list[int], list[float]]]:
        """The read `values` of the chain's packed `Top`, per chain position that stands (every token before it reached
        the threshold: `draft_chain`'s exit), in order: (ids, their draft probabilities). Read as they are visited:
        the rows past the exit are not."""
        k, width = self.k, 3 * self.k + 1
        for i in range(self.size):
            row = values[i * width : (i + 1) * width]
            probs = row[2 * k : 3 * k]
            yield [int(v) for v in row[:k]], probs
            if probs[0] < self.threshold:
                return

    def decide(self, values: list[float]) -> tuple[list[int], list[int], list[float]]:
        """`Unread.decide` for the chain itself: the tokens that stand, their draft probabilities."""
        rows = list(self.standing(values))
        return list(range(len(rows))), [ids[0] for ids, _ in rows], [probs[0] for _, probs in rows]


def draft_unread(state: DecodeState, plan: SkipPlan, limit: int, threshold: float, alternatives: int = 0,
                 vocab: DraftVocab | None = None) -> UnreadChain:
    """`draft_chain` under greedy decoding without reading the device: each token feeds the next forward where it
    lies, and the exit is applied to the values once read (`UnreadChain.decide`) instead of stopping the loop. It
    drafts past the exit (on a GPU a one-row forward costs a replay, a read would stall the host every token); the
    tokens that stand are those `draft_chain` drafts. With the full head the whole chain is the plan's chained
    program replayed (`fastpath.chain`: nothing on the host between tokens); a draft vocabulary's head runs
    after each pass's program."""
    start, top = state.committed, max(2, alternatives + 1)
    placed = vocab is None and isinstance(state.cache, fastpath.StaticKVCache)
    if placed:
        packed = fastpath.chain(state.cache, plan, state.pending, start, limit, nodes=alternatives + 1)
    else:
        token: torch.Tensor | np.ndarray = np.array([state.pending])
        parts = []
        for i in range(limit):
            got = state.runner.forward(token, np.array([start + i]), state.cache, skip=plan, vocab=vocab, top=top)
            parts.append(got.packed)
            token = got.ids[:, 0].long()
        packed = torch.cat(parts)
    state.cache.crop(start)
    return UnreadChain(limit, top, threshold, placed, Top(packed, top))


def draft_sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
                 ) -> tuple[int, torch.Tensor]:
    """A sampled draft token and the distribution it was drawn from, which the draft keeps as its `probs`: the
    same tensor, so that what the verifier divides by is what the token came from (a draft vocabulary's logits are
    -inf outside it, so its distribution is zero there)."""
    probs = probabilities(logits, sampling)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def draft_chain(state: DecodeState, plan: SkipPlan, limit: int, threshold: float, alternatives: int = 0,
                vocab: DraftVocab | None = None) -> Chain:
    """Draft up to `limit` tokens with `plan`'s sub-layers skipped (the head over `vocab` where given); leaves the
    cache as it found it.

    With `alternatives` > 0, each position also records that many runner-up tokens of its draft
    distribution with their probabilities, most likely first (SWIFT's dynamic verification turns them into
    sibling candidates).
    """
    runner, start, sampling = state.runner, state.committed, state.sampling
    tokens: list[int] = []
    dists: list[torch.Tensor] = []
    confidences: list[float] = []
    others: list[list[tuple[int, float]]] = []
    token, reason = state.pending, "limit"
    for i in range(limit):
        logits = runner.forward(torch.tensor([token]), torch.tensor([start + i]), state.cache, skip=plan,
                                vocab=vocab)[0]
        if sampling.greedy:  # the head's verdict as `draft_unread` and the verify read it (`top_of`)
            best = top_of(logits[None], alternatives + 1)
            ranked = list(zip(best.ids[0].long().tolist(), best.probs[0].tolist()))
            token, confidence = ranked[0]
        else:
            token, probs = draft_sample(logits, sampling, state.generator)
            dists.append(probs)
            confidence, ranked = float(probs.max()), []
            if alternatives > 0:
                top = probs.topk(min(alternatives + 1, probs.numel()))
                ranked = list(zip(top.indices.tolist(), top.values.tolist()))
        tokens.append(token)
        confidences.append(confidence)
        if alternatives > 0:
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


@dataclass(frozen=True)
class LayerSkipParams(SizedParams):
    """Drafting tunables every layer-skip method shares (each method adds its own)."""

    max_draft: int = param(low=1, high=32, help="most draft tokens per step (K); the cost model may draft fewer")
    draft_vocab: int = param(low=0, high=1 << 20, help="ids a draft's LM head scores: the lowest this many plus the "
                                                       "prompt's and the output's (0: the whole vocabulary)")


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
    """Drafts with `self.plan` skipped; subclasses choose the plan in `begin` / `learn`.

    On the device's path (`DecodeState.unread`) a chain drafted with the whole vocabulary's head, whose verify nobody
    observes, is drafted on the device at the step's launch (`SkipChain`, `fastpath.SkipSteps`): from the token the
    step before left there, so that, pipelined, a step whose plan, size and exit threshold are fixed before the verdict
    before it is read is launched before that read (`ahead`). What a draft is made of is fixed beside the forward
    before (`after_launch`) in either loop: its size (`DraftPolicy.plan_ahead`) and its exit threshold, which an
    adaptive exit (`ExitThreshold`) moves with each verdict, so that there a step's threshold is the one the verdicts
    up to the step before last made (a step late), and both loops draft alike."""

    pauses_plainly = True
    chains = True  # whether its chains may be drafted on the device at the launch (SWIFT's trees carry siblings)

    def setup(self, state: DecodeState) -> None:
        """The draft vocabulary's head priced before decoding (`vocab.head_ms`: a first-use timing, saved with the
        profile), where the drafts compute one; where they may be drafted at the launch, the programs of those steps
        made (`fastpath.skips.warm_up`: a plan's own are made as it is adopted)."""
        typical = DraftVocab.typical(self.runner, self.params.draft_vocab)
        priced = state.profile is not None and typical is not None
        self.head_price = head_ms(state.profile, self.runner, self.params.draft_vocab) if priced else None
        if state.unread and self.chains and typical is None:
            fastpath.skips.warm_up(state.cache, range(1, self.params.max_draft + 1))

    def begin(self, state: DecodeState) -> Observer | None:
        self.plan = SkipPlan()
        self.exit = self.make_exit()
        self.policy = self.sizing(state, range(1, self.params.max_draft + 1))
        self.sizing_plan: Sizing | None = None  # the policy's plan of the latest step
        self.chain: Chain | None = None
        self.unread: Draft | None = None  # the latest draft, where it was drafted unread (`DecodeState.unread`)
        self.priced: tuple[SkipPlan, float] | None = None  # a draft token's price, made ahead (`after_launch`)
        self.threshold = self.exit.value  # the device's path: the exit threshold of the next draft (`after_launch`)
        self.drafted_with = self.exit.value  # the exit threshold of the latest unread draft
        self.vocab = DraftVocab.of(state.runner, self.params.draft_vocab, state.tokens)
        self.missed = 0  # rejections whose target token lay outside the draft vocabulary
        return None

    def make_exit(self) -> ExitThreshold:
        raise NotImplementedError


    def token_ms(self, state: DecodeState) -> float:
        """The predicted ms of one draft token (a forward with the plan skipped, its head over the draft vocabulary)."""
        if state.profile is None:
            return 1.0
        head = None if self.vocab is None else self.head_price
        return state.profile.skip_forward_ms(self.plan, state.committed, head)

    def overhead_ms(self) -> float:
        """Drafting work outside the draft loop, per drafted step (CLaSp's amortized skip-set search)."""
        return 0.0

    def prepare(self, state: DecodeState, plan: Sizing) -> tuple[float, dict[str, Any]]:
        """Work before this step's draft, once the policy has chosen to draft (`plan`): its predicted ms and
        payload. CLaSp searches its skip set here when one is due; nothing by default."""
        return 0.0, {}

    def _pricing(self, state: DecodeState, token_ms: float | None = None) -> tuple[Callable[[int], float], float]:
        """The policy's prices (`policy.Pricing`): what a step drafting k costs (a draft token at `token_ms`, where
        priced already), and plain decoding's step."""
        token_ms = self.token_ms(state) if token_ms is None else token_ms
        overhead_ms = self.overhead_ms()
        return (lambda k: state.step_ms(k * token_ms + overhead_ms, 1 + self.rows(k))), state.plain_ms()

    def draft(self, state: DecodeState) -> Draft:
        depth = min(self.params.max_draft, state.max_depth)
        # (on the device's path the plan was chosen ahead, `after_launch`: priced only where chosen now)
        sizing = self.policy.sized(state.unread, functools.partial(self._pricing, state), max(0, depth))
        self.sizing_plan = sizing
        drafting = sizing.size > 0
        prepared_ms, prepared = self.prepare(state, sizing) if drafting else (0.0, {})
        skipped = self.plan if drafting else SkipPlan()  # a paused step skipped nothing: it drafted nothing
        info: dict[str, Any] = {"skip": skipped, "draft_len": sizing.size, "plan": sizing, **prepared}
        self.chain, self.unread = None, None
        if drafting and state.unread:  # the tokens are read with the verdict; `observe` completes the payload
            self.drafted_with = threshold = self.threshold
            observer = self.observer()
            at_launch = self._at_launch(state) and observer is None
            draft = self.unread_proposal(
                UnreadChain(sizing.size, max(2, self.alternatives + 1), threshold, True) if at_launch
                else draft_unread(state, self.plan, sizing.size, threshold, self.alternatives, self.vocab))
            if at_launch:  # drafted on the device at the launch, from the token the step before left there
                draft.device_draft = SkipChain(self.plan, sizing.size, threshold)
            priced, self.priced = self.priced, None  # a draft token's price, made beside the forward before
            token_ms = priced[1] if priced is not None and priced[0] is self.plan else self.token_ms(state)
            draft.observer, draft.info, draft.cost_ms = observer, info, sizing.size * token_ms
            draft.cost_ms += prepared_ms
            self.unread = draft
            return draft
        self.chain = (draft_chain(state, self.plan, sizing.size, self.exit.value, self.alternatives, self.vocab)
                      if drafting else None)
        shown = self.chain or Chain([], None, [], "paused" if depth > 0 else "budget")
        fields = self.proposal(shown)
        confidences = fields.pop("confidences", shown.confidences)
        info["exit"] = {"threshold": self.exit.value, "confidences": confidences, "reason": shown.reason}
        cost = len(shown.tokens) * self.token_ms(state) + prepared_ms
        return Draft(**fields, observer=self.observer(), info=info, cost_ms=cost)

    def after_launch(self, state: DecodeState) -> None:
        """On the device's path (`DecodeState.unread`) what the next draft is made of is fixed here, beside this step's
        forward, not between this step's read and the next draft's launch, where the device would wait for it: its
        plan (`DraftPolicy.plan_ahead`, priced at every size; the next step has the room this one leaves whatever it
        emits) and its exit threshold (the one the verdicts read so far made); and the price of a draft token, for
        the draft's cost, while the plan skips what it skips now."""
        if state.unread:
            self.priced = self.plan, self.token_ms(state)
            self.threshold = self.exit.value
            emits = 1 + (self.sizing_plan.size if self.sizing_plan is not None else 0)  # this step's most
            self.policy.plan_ahead(*self._pricing(state, self.priced[1]),
                                   max(0, min(self.params.max_draft, state.max_depth - emits)))

    def ahead(self, state: DecodeState) -> Draft | None:
        """A paused step (plain); or, where chains are drafted at the launch and the next step's plan, size and
        threshold are fixed already (`after_launch`) with no work of its own before its draft (`ready_ahead`), the
        next step's chain, made on the device from what this step leaves there."""
        promise = super().ahead(state)
        planned = self.policy.next
        if promise is not None or planned is None or not self._at_launch(state):
            return promise
        ready = planned[0].size > 0 and self.ready_ahead()
        return Draft(device_draft=SkipChain(self.plan, planned[0].size, self.threshold)) if ready else None

    def _at_launch(self, state: DecodeState) -> bool:
        """Whether this run's chains may be drafted on the device at the launch (`SkipChain`, where no observer
        watches the step's verify): on the device's path, with the whole vocabulary's head, nothing riding along."""
        return self.chains and self.vocab is None and state.unread and not state.riders

    def ready_ahead(self) -> bool:
        """Whether the next step drafts with the plan standing now, nothing to prepare before its draft and no
        observer of its verify (CLaSp's search and the step before it, ADMG's first adoption): true here."""
        return True

    def unread_proposal(self, chain: UnreadChain) -> Draft:
        """The fixed-shape draft an `UnreadChain` verifies as (`proposal`'s counterpart): the chain itself here."""
        k = chain.size
        ids = None if chain.placed else chain.top.ids[:, 0]
        values = None if chain.top is None else chain.top.packed
        return Draft(unread=Unread(k, ids, values, chain.decide, list(range(k))))

    def settled_chain(self, draft: Draft) -> Chain:
        """The `Chain` a read-as-you-go draft would have made, from an unread draft the step's read settled."""
        tokens = [draft.tokens[i] for i in draft.spine]
        confidences = [draft.confidences[i] for i in draft.spine]
        threshold = self.drafted_with
        reason = "threshold" if confidences and confidences[-1] < threshold else "limit"
        self.exit_payload = {"threshold": threshold, "confidences": draft.confidences, "reason": reason}
        return Chain(tokens, None, confidences, reason)

    alternatives = 0  # runner-up tokens `draft_chain` records per position (for `proposal`)

    def rows(self, k: int) -> int:
        """Draft nodes a verify carries for a chain of k tokens (a chain: k; SWIFT adds siblings)."""
        return k

    def proposal(self, chain: Chain) -> dict[str, Any]:
        """The `Draft` fields (tokens, parents, probs) built from the chain, plus "confidences" (the draft
        probability of each node, for the inspector) when they differ from the chain's: the chain itself here."""
        return {"tokens": chain.tokens, "probs": chain.probs}

    def observer(self) -> Observer | None:
        """An observer for this step's verify forward (CLaSp records hidden states); None by default."""
        return None

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        payload = {}
        if not outcome.prefill and self.unread is not None:
            self.chain = self.settled_chain(self.unread)
            payload["exit"] = self.exit_payload
        if self.vocab is not None:
            payload["vocab"] = self.vocab_payload(outcome)
        if not outcome.prefill and self.chain is not None:
            self.exit.update(outcome.accepted, len(self.chain.tokens), self.chain.reason)
            # sized by chain length: the path's depth counts (a tree's siblings share their chain position)
            # (on the device's path folded in when the next plan is chosen, beside the next forward)
            self.policy.learn(range(len(outcome.path)), len(self.chain.tokens),
                              exhausted=self.chain.reason == "threshold", later=state.unread)
        return {**payload, **self.learn(state, outcome)}

    def vocab_payload(self, outcome: Outcome) -> dict[str, Any]:
        """The draft vocabulary for the inspector: its size, whether this step's rejection was of a token outside it
        (the draft could not have proposed what the target wrote) and how many were so far; then the emitted ids
        join it."""
        rejected = not outcome.prefill and self.chain is not None and outcome.accepted < len(self.chain.tokens)
        outside = rejected and outcome.token not in self.vocab
        self.missed += outside
        shown = {"size": len(self.vocab), "low_ids": self.vocab.size, "outside": outside, "outside_so_far": self.missed}
        self.vocab.add(outcome.emitted)
        return shown

    def learn(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        """Method-specific update after a verify (or the prefill); returns extra payload."""
        return {}

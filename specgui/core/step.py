"""One decoding step's parts, each a method of the run they share (`Run`): draft, launch, read, accept, observe, event.

`decode`'s two drivers call the same parts, each in its own order: serially a step whole before the next;
pipelined, a step's launch before the step before's event goes out (and, where the device can draft it, before the
step before's read), so that on a GPU the host's work on a step runs beside the device's forward instead of delaying
its launch (`decode.generate` says what each times).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specgui.core import launch as launching
from specgui.core.clock import Captures, Clock
from specgui.core.draft import Draft, Outcome
from specgui.core.events import Prefill, Step
from specgui.core.runner import SkipPlan
from specgui.core.text import Detokenizer, pieces_in_context
from specgui.core.verify import Verdict, verify
from specgui.costs import CostProfile
from specgui.methods.base import DecodeState, Drafter
from specgui.methods.policy import Sizing
from specgui.model.loading import LoadedModel


@dataclass(frozen=True)
class Prices:
    """A step's prices, for its event and the cost model: a plain step's, the step's own and its verify's."""

    plain_ms: float
    predicted_ms: float
    verify_ms: float
    chained_plain: bool  # a plain step launched ahead, chained: the cost model learns it as one


@dataclass
class Decoded:
    """A step decoded and observed whose event has not gone out: what the event and the cost model's `learn` need."""

    index: int
    context: list[int]  # the tokens before the step's draft, its pieces' context
    draft: Draft
    verdict: Verdict
    emitted: list[int]
    rows: int  # the verify forward's
    timed: Callable[[], list[float]]  # the step's draft and verify ms, read when its event is built (`Clock.spans`)
    capture_ms: float  # programs captured within them (`Captures`)
    observe_ms: float  # the method's observe, less what it captured
    observe_capture_ms: float  # programs its observe captured, where its own time counts them (serially)
    payload: dict[str, Any]
    prices: Prices


class Run:
    """A run's decoding state and the parts of a step, in the order a serial step calls them."""

    def __init__(self, lm: LoadedModel, method: str, state: DecodeState, drafter: Drafter, profile: CostProfile,
                 detok: Detokenizer, pipeline: bool, should_stop: Callable[[], bool] | None) -> None:
        self.lm, self.method, self.state, self.drafter, self.profile = lm, method, state, drafter, profile
        self.detok, self.pipeline, self.should_stop = detok, pipeline, should_stop
        self.generator = state.generator
        self.clock = Clock(state.runner.device)  # (made after the drafter's setup: no setup is timed)
        self.captures = Captures(state.cache)  # (captures before the clock started are no run's)
        self.chains: launching.Chains | None = None  # (made after the prefill: `prefill`)
        self.steps: list[Step] = []
        self.stop: str | None = None
        self.halted = False  # pipelined: should_stop said so before a step to be launched ahead
        self.last_end: Any = None  # pipelined: the clock's mark behind the step before's forward
        self.away: list[float] = []  # when the latest event's presentation began

    def prefill(self, prompt_ids: list[int]) -> Prefill:
        """The prompt forward: it gives the first token (the pending one), which the drafter observes."""
        state, clock = self.state, self.clock
        n = len(prompt_ids)
        logits = state.runner.forward(np.asarray(prompt_ids, dtype=np.int64), np.arange(n), state.cache,
                                      observer=self.drafter.begin(state), logits_rows=slice(n - 1, n))
        verdict = verify(logits, Draft(), state.sampling, self.generator, before_read=clock.mark, riders=state.riders)
        state.riders = []
        first = verdict.token
        state.tokens.append(first)
        [prefill_ms] = clock.discount(clock.read(synced=True), self.captures.take())
        started = time.perf_counter()
        payload = self.drafter.observe(state, Outcome(path=[], token=first, emitted=[first], extra_tokens=None,
                                                      prefill=True))
        # the clock stops: building events (detokenizing) is presentation
        [overhead_ms] = clock.discount([clock.host(started)], self.captures.take())
        self.stop = stop_reason(self.lm, state, [first])
        # plain steps chain on the device where the fast path reads greedy verdicts, pipelined (`PlainSteps`); prompt
        # lookup's, layer-skip and carried steps run there wherever it reads greedy verdicts, chained where pipelined
        self.chains = launching.Chains(state.cache, self.pipeline) if state.unread else None
        state.chains = self.chains is not None and self.pipeline
        return Prefill(prompt_tokens=n, token=first, piece=self.detok.push(first), margin=verdict.margins[0],
                       ms=prefill_ms, overhead_ms=overhead_ms, payload=payload)

    def cancelled(self) -> bool:
        """Polled before each step's draft (`should_stop`)."""
        return self.should_stop is not None and self.should_stop()

    def draft(self) -> tuple[list[int], Draft]:
        """1. draft: the method proposes a tree (maybe with ride-along tokens); and the context its pieces read in."""
        return self.state.tokens[-4:], self.drafter.draft(self.state)

    def launch(self, draft: Draft) -> launching.Launched:
        """2. launch: one target forward over the pending token, the tree and any extras, its phase marked (and,
        pipelined, the mark behind it kept: verify_ms ends with the forward, not what runs beside it)."""
        self.clock.mark()
        launched = launching.launch(self.state, draft, self.chains)
        if self.pipeline:
            self.clock.mark()
            launched.end = self.clock.marks[-1]
        return launched

    def launch_ahead(self, launched: launching.Launched, rows: int) -> launching.Launched | None:
        """Pipelined: the step after, launched now, before this one is read, where the device can make its draft
        whatever this one's verdict (`Drafter.ahead`: chains of one kind, with room after this step's most);
        `should_stop` polled for it now, once. None: the next step waits for this one's read."""
        state = self.state
        promise = (self.drafter.ahead(state) if launched.chained and state.chains
                   and state.generated + rows + 1 <= state.max_new_tokens else None)
        if promise is None or type(promise.device_draft) is not launched.kind:
            return None
        if promise.device_draft is None and not launching.plain(state, promise):
            return None  # (a plain step chains only where its forward needs nothing of the host)
        if self.cancelled():
            self.halted = True  # (the run stops before the step it would have been)
            return None
        ahead = launching.launch(state, promise, self.chains, ahead=True)
        ahead.end, ahead.ahead, ahead.promise = self.clock.device.mark(), True, promise
        return ahead

    def price(self, draft: Draft, launched: launching.Launched, rows: int) -> Prices:
        """The step's prices (beside the forward: the draft priced its own), from what the cost model learnt before the
        step before's `learn` (pipelined), as the draft's were."""
        plain_ms = self.state.plain_ms()
        chained_plain = launched.ahead and rows == 1
        predicted_ms = plain_ms if chained_plain else self.state.step_ms(draft.cost_ms, rows)
        return Prices(plain_ms, predicted_ms, self.profile.verify_ms(rows, self.state.committed), chained_plain)

    def read(self, launched: launching.Launched, draft: Draft) -> Verdict:
        """3. read the verdict (serially, the clock's mark just before it), with what the device drafted at the
        launch (checked against the host's draft) and what the drafter asked to read along (`DecodeState.ride`)."""
        state = self.state
        riders = launched.riders(draft)
        verdict = verify(launched.logits, draft, state.sampling, self.generator, launched.extra_logits,
                         extra_rows=launched.extra_rows, riders=state.riders + riders,
                         before_read=launched.wait if self.pipeline else functools.partial(launched.wait, self.clock))
        state.riders = []
        launched.check(draft, verdict, riders)
        return verdict

    def accept(self, launched: launching.Launched, draft: Draft, verdict: Verdict) -> list[int]:
        """4. accept and commit: the accepted path plus the verifier's own token, cut at a stop token or the budget;
        the cache keeps the pending token and the accepted nodes' keys as the launch's kind does (`commit`)."""
        state = self.state
        emitted, self.stop = cut(self.lm, state, [draft.tokens[i] for i in verdict.path] + [verdict.token])
        launched.commit(state, draft, verdict, emitted)
        state.tokens.extend(emitted)
        return emitted

    def timed(self, launched: launching.Launched) -> tuple[Callable[[], list[float]], float]:
        """The step's phase marks, taken now (read with its event, behind the next launch: marked before the verdict's
        read, they wait for nothing; a step launched ahead: the device's time since the forward before it ended), and
        the ms of programs captured since the step before's were (pipelined: its observe's included)."""
        clock = self.clock
        timed = (functools.partial(clock.since, self.last_end, launched.end) if launched.ahead
                 else functools.partial(clock.spans, clock.take()))
        self.last_end = launched.end
        return timed, self.captures.take()

    def observe(self, context: list[int], draft: Draft, verdict: Verdict, emitted: list[int], rows: int,
                launched: launching.Launched, prices: Prices) -> Decoded:
        """5. observe: the method learns from the verdict, before it drafts again (timed on the host: serially counted
        apart, with what it captures; pipelined inside the next step's span, which leaves its captures out, unless
        the run ends here). Its time excludes what it captured either way."""
        state, clock = self.state, self.clock
        timed, capture_ms = self.timed(launched)
        started = time.perf_counter()
        priced = prices.predicted_ms / prices.plain_ms if prices.plain_ms > 0 else 0.0
        outcome = Outcome(path=verdict.path, token=verdict.token, emitted=emitted, extra_tokens=verdict.extra_tokens,
                          priced=priced)
        payload = {**draft.info, **self.drafter.observe(state, outcome)}
        counted = not self.pipeline or self.stop is not None or self.halted  # (the run ends after this step)
        observe_ms = clock.host(started, counted)
        if counted:  # its captures are this step's
            captured = self.captures.take()
            [observe_ms] = clock.discount([observe_ms], captured)
        else:  # they stay for the next step, whose span holds them
            observe_ms, captured = max(0.0, observe_ms - self.captures.pending()), 0.0
        state.step += 1
        return Decoded(state.step, context, draft, verdict, emitted, rows, timed, capture_ms, observe_ms, captured,
                       payload, prices)

    def event(self, decoded: Decoded, counted: bool = True) -> Step:
        """6. event: the cost model learns what the step cost against what it priced (timed, with the step's observe,
        as its overhead; `counted` as `Clock.host`), then the step's text and Step (presentation: not timed; the
        generator is away from here until the consumer hands back, `presented`)."""
        started = time.perf_counter()
        draft, verdict, emitted, prices = decoded.draft, decoded.verdict, decoded.emitted, decoded.prices
        draft_ms, verify_ms = self.clock.discount(decoded.timed(), decoded.capture_ms)
        if not (decoded.capture_ms or decoded.observe_capture_ms):  # (a step that captured is no step's price)
            self.profile.learn(self.method, decoded.rows, draft_ms + verify_ms, draft.cost_ms, prices.verify_ms,
                               draft_ms=draft_ms, chained=prices.chained_plain)
        overhead_ms = decoded.observe_ms + self.clock.host(started, counted)
        self.away.append(time.perf_counter())
        lm = self.lm
        step = Step(
            index=decoded.index, draft_tokens=tuple(draft.tokens), draft_parents=tuple(draft.parents),
            draft_pieces=tuple(draft_pieces(lm, decoded.context, draft)), path=tuple(verdict.path),
            token=verdict.token, corrected=verdict.corrected, emitted=tuple(emitted),
            emitted_pieces=tuple(self.detok.push(t) for t in emitted), margins=tuple(verdict.margins[: len(emitted)]),
            forward_tokens=decoded.rows, draft_ms=draft_ms, verify_ms=verify_ms, overhead_ms=overhead_ms,
            payload=accounts(decoded.payload), predicted_ms=prices.predicted_ms, plain_ms=prices.plain_ms,
            capture_ms=decoded.capture_ms + decoded.observe_capture_ms,
        )
        self.steps.append(step)
        return step

    def presented(self) -> None:
        """The consumer handed back after the latest event: the clock leaves its presentation out (`Clock.away`)."""
        self.clock.away(self.away.pop())


def accounts(payload: dict[str, Any]) -> dict[str, Any]:
    """A step's payload as its event shows it: the plans a draft's `info` holds (the policy's `Sizing`, a
    `SkipPlan`) as their accounts (`to_dict`), written here, with the event, behind the next launch, not where the
    drafter drafted, between a verdict's read and the next launch, where a GPU waits for the host."""
    return {key: value.to_dict() if isinstance(value, Sizing | SkipPlan) else value for key, value in payload.items()}


def cut(lm: LoadedModel, state: DecodeState, emitted: list[int]) -> tuple[list[int], str | None]:
    """A step's tokens trimmed at the first stop token or at the token budget, and why the run stops (None: it goes
    on)."""
    for i, token in enumerate(emitted):
        if token in lm.stop_ids:
            return emitted[: i + 1], "eos"
    room = state.max_new_tokens - state.generated
    if len(emitted) >= room:
        return emitted[:room], "length"
    return emitted, None


def stop_reason(lm: LoadedModel, state: DecodeState, emitted: list[int]) -> str | None:
    if emitted[-1] in lm.stop_ids:
        return "eos"
    return "length" if state.generated >= state.max_new_tokens else None


def draft_pieces(lm: LoadedModel, context: list[int], draft: Draft) -> list[str]:
    """Each draft token's text, read after its own ancestors."""
    return pieces_in_context(lm.tokenizer, [(context + [draft.tokens[a] for a in draft.path_to(i)[:-1]], token)
                                            for i, token in enumerate(draft.tokens)])

"""The decode loop: one loop for every method, yielding events.

    setup:   the method's one-time work (D&V's search, first-use timings), before the clock starts
    prefill: the prompt forward gives the first token (the pending token; its keys are not cached)
    repeat:  1. draft    the method proposes a token tree (maybe with ride-along tokens)
             2. launch   one target forward over [pending] + tree (+ extras); the drafter learns what the next draft
                         does without (`after_launch`); and where the device can make the next step's draft whatever
                         this one's verdict (`ahead`: a plain step, a prompt lookup, a layer-skip or carried chain),
                         its forward too, chained on the device (`fastpath.PlainSteps`, `LookupSteps`, `SkipSteps`,
                         `SlotSteps`)
             3. event    the step before's: the cost model learns it, its text is built, its Step goes out
             4. read     the verifier reads the forward's verdict
             5. accept   the verifier keeps a path and adds its own token
             6. crop     the cache keeps the pending token and the accepted path only
             7. observe  the method learns from the verdict (the next draft needs it)
    end:     3. event    the last step's, then the Summary

That is the pipelined loop (`pipeline=True`, the default): a step's event waits for the next step's forward to be
launched, so that on a GPU building and handing it out (and the consumer's time with it) overlaps the device's forward
instead of delaying its launch. Serially (`pipeline=False`, kept for comparison) a step's event goes out right after
its observe, before the next step's draft. Either way events go out one a step, in order, with the same content, and
a run that stops launches nothing past its last step, but for a chained step after a stop token (unread when it was
launched; its keys are past the end).

Pipelined, on the fast path and greedy, plain steps (plain decoding's, and a paused method's while its pause is known
ahead), prompt lookup's, layer-skip chains and Fractal's carried chains chain on the device: step t + 1 is launched
before step t is read, its token (and its lookup's n-gram, its draft chain, its carried slots) what step t's program
left on the device, and step t's verdict comes back through a pinned host row and an event, so that the device never
waits for the host's work on a step. Such a step is drafted at its turn on the host, as any step (a prompt lookup's
draft checked against the device's when the step is read; a layer-skip or carried chain's tokens read with the
verdict, as any unread draft's, and the device's acceptance checked against the host's), so events are unchanged.

Timing covers only the time spent inside this generator: whatever a consumer does between events
(rendering, printing) never counts against a method. On CUDA no phase boundary synchronises: the clock's marks are
events the device records, read once the verdict has been. Pipelined, a step's time runs from the end of the forward
before it to the end of its own (`_Clock.since`): on a GPU the device's time, so whatever the host did between the two
forwards (the read, accepting, the observe before, the draft, the launch) counts where the device waited for it, and
not where it ran beside a forward; on a CPU the host's time less the stretches the generator was away. (Counted from
the draft's start, a step left out the read and the observe before it: on an H200 0.2 ms of prompt lookup's 2 ms
steps, a tenth of its time, uncounted.)
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import NoneType
from typing import Any

import numpy as np
import torch

from specgui import compiled, costs, fastpath, kvcache, methods
from specgui.costs import CostProfile
from specgui.draft import Draft, Lookup, Outcome, Rider, SkipChain, SlotChain
from specgui.errors import SpecGUIError
from specgui.events import Event, Prefill, Start, Step, Summary, summarize
from specgui.loading import LoadedModel
from specgui.methods.base import DecodeState
from specgui.methods.policy import Plan
from specgui.runner import VERIFY_TOP, SkipPlan, Top
from specgui.sampling import GREEDY, Sampling
from specgui.text import Detokenizer, pieces_in_context
from specgui.verify import Verdict, verify


@dataclass
class Result:
    """A finished run, collected from its events."""

    events: list[Event]

    @property
    def summary(self) -> Summary:
        return self.events[-1]

    @property
    def token_ids(self) -> list[int]:
        return list(self.summary.token_ids)

    @property
    def steps(self) -> list[Step]:
        return [e for e in self.events if isinstance(e, Step)]

    @property
    def margins(self) -> list[float]:
        """Target top-1 minus top-2 logit for every generated token, in order."""
        prefill = next(e for e in self.events if isinstance(e, Prefill))
        return [prefill.margin] + [m for s in self.steps for m in s.margins]


class _Clock:
    """Time spent inside the generator, phase by phase.

    `resume()` starts a step's first phase, `mark()` ends a phase on the device's clock, `read()` returns the ms of
    the phases marked since (a step's: `take()` its marks after its verdict's read, `spans()` them with its event,
    behind the next launch, where the host's work does not delay a GPU). On a GPU the marks are CUDA events: nothing
    stalls between drafting and the verify forward, and a step's phases are read after its one read of the device
    (`verify`'s), which its last mark precedes on the device's stream (reading them then waits for nothing).
    Host-only work (a drafter's `observe`, the cost model's `learn`) is timed on the host (`host`). Nothing else
    counts: building events and handing them out (presentation, and the consumer's time), nor accepting and cropping
    after the verdict's read.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = costs.DeviceClock(device)
        self.total = 0.0
        self.marks = [self.device.mark()]
        self.gaps: list[tuple[float, float]] = []  # (from, to) host seconds the generator was away, off CUDA

    def mark(self, wait: bool = False) -> None:
        """End a phase; with `wait`, on a GPU, wait until the device has reached the mark (the read that follows reads
        host memory a copy of the device's fills, behind it)."""
        self.marks.append(self.device.mark())
        if wait and self.device.cuda:
            self.marks[-1].synchronize()

    def read(self, synced: bool = False) -> list[float]:
        if self.device.cuda and not synced:
            self.marks[-1].synchronize()
        return self.spans(self.take())

    def take(self) -> list[Any]:
        """The phases' marks so far, to be read later (`spans`); counting goes on from the last."""
        marks, self.marks = self.marks, self.marks[-1:]
        return marks

    def spans(self, marks: list[Any]) -> list[float]:
        """The ms of the phases between `marks` (`take`n, the last of them reached on the device), counted in the
        total. Read in the order they were taken: the stretches the generator was away are let go as read past."""
        ms = [self._ms(a, b) for a, b in itertools.pairwise(marks)]
        self.total += sum(ms) / 1000
        return ms

    def host(self, started: float, counted: bool = True) -> float:
        """The ms since `started` (`time.perf_counter`), counted in the total unless a chained step's forward is in
        flight meanwhile (`since` counts that stretch whole)."""
        ms = (time.perf_counter() - started) * 1000
        self.total += ms / 1000 if counted else 0.0
        return ms

    def discount(self, ms: list[float], capture_ms: float) -> list[float]:
        """Phases' `ms` less `capture_ms` of programs captured within them (taken from the first phases first), and
        the total less it: a capture inside a step (a plan adopted) is a one-time cost no step is priced by."""
        left, out = capture_ms, []
        for phase in ms:
            cut = min(phase, left)
            out.append(phase - cut)
            left -= cut
        self.total -= (capture_ms - left) / 1000
        return out

    def resume(self, since: Any = None) -> None:
        """Start counting again after a pause (the gap was the consumer's time, or what the clock leaves out); or,
        pipelined, `since` a mark behind the forward before (`since`'s span: the host's whole work between them)."""
        if since is None:
            self.marks, self.gaps = [self.device.mark()], []
        else:
            self.marks = [since]

    def away(self, started: float) -> None:
        """The generator was away since `started` (building an event's text, and the consumer's time with it)."""
        if not self.device.cuda:
            self.gaps.append((started, time.perf_counter()))

    def since(self, start: Any, end: Any) -> list[float]:
        """A chained step's phases (no draft, and the span from the mark behind the forward before it to the mark
        behind its own), counted in the total."""
        return [0.0, *self.spans([start, end])]

    def _ms(self, start: Any, end: Any) -> float:
        """The ms between two marks: on a GPU the device's, whatever the host did meanwhile; elsewhere, where the
        marks are the host's own, less the stretches the generator was away (`away`) between them."""
        ms = self.device.ms(start, end)
        if not self.device.cuda:
            ms -= sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.gaps) * 1000
            self.gaps = [(a, b) for a, b in self.gaps if b > end]
        return ms


@dataclass
class _Launched:
    """A step's target forward, launched: what reading its verdict needs."""

    logits: torch.Tensor | Top
    extra_logits: torch.Tensor | None = None
    extra_rows: list[int] | None = None
    chained: bool = False  # a step chained on the device (`fastpath.PlainSteps`, `LookupSteps`, ...)
    kind: type = NoneType  # a chained step's: its draft's `device_draft` kind (a plain step's: NoneType)
    ready: Any = None  # a chained step's CUDA event: its verdict is on the host behind it
    end: Any = None  # pipelined: the clock's mark right behind its forward
    ahead: bool = False  # launched before the step before it was read
    promise: Draft | None = None  # launched ahead: the draft the drafter promised (`Drafter.ahead`)
    drafted: torch.Tensor | None = None  # what the device made at the launch that the read checks: a prompt
    # lookup's ids (`fastpath.lookup.check`), how many tokens a skip or slot chain's acceptance took (`cursor.check`)
    nodes: torch.Tensor | None = None  # a skip chain's Tops, a slot chain's tokens: its nodes' values (`OnDevice`)

    def wait(self, clock: _Clock | None = None) -> None:
        """Before the verdict's read: a chained step's copy to the host has landed (not the forwards launched since).
        Serially the `clock`'s mark comes first (the step's phases end just before its read): on a GPU waiting for it
        waits for the copy too, but the wait is the event's own, whatever the clock's device (a CPU's clock waits for
        nothing)."""
        if clock is not None:
            clock.mark(wait=self.ready is not None)
        if self.ready is not None:
            self.ready.synchronize()


class _Captures:
    """The programs a run captures while its steps are timed (a plan adopted inside a step: SWIFT's search, CLaSp's
    re-optimisation; a program first used): the ms since the last `take`, which the step they fell in leaves out of
    its time (`_Clock.discount`), and the cost model out of what it learns."""

    def __init__(self, cache: Any) -> None:
        self.table = cache.programs if isinstance(cache, fastpath.StaticKVCache) else None
        self.at = self.table.capture_s if self.table is not None else 0.0

    def take(self) -> float:
        if self.table is None:
            return 0.0
        before, self.at = self.at, self.table.capture_s
        return (self.at - before) * 1000


@dataclass
class _Decoded:
    """A step decoded and observed whose event has not gone out: what the event and the cost model's `learn` need."""

    index: int
    context: list[int]  # the tokens before the step's draft, its pieces' context
    draft: Draft
    verdict: Verdict
    emitted: list[int]
    rows: int  # the verify forward's
    timed: Callable[[], list[float]]  # the step's draft and verify ms, read when its event is built (`_Clock.spans`)
    capture_ms: float  # programs captured within them (`_Captures`)
    observe_ms: float
    payload: dict[str, Any]
    predicted_ms: float
    plain_ms: float
    priced_verify_ms: float
    ahead: bool  # a plain step launched ahead, chained: the cost model learns it as one


def generate(
    lm: LoadedModel,
    prompt_ids: list[int],
    method: str = "baseline",
    *,
    max_new_tokens: int = 128,
    sampling: Sampling = GREEDY,
    params: dict[str, Any] | None = None,
    prompt_text: str = "",
    should_stop: Callable[[], bool] | None = None,
    fast_path: str = "auto",
    compile: str | None = None,
    profile: CostProfile | None = None,
    pipeline: bool = True,
) -> Iterator[Event]:
    """Decode with `method`, yielding Start, Prefill, one Step per cycle, then Summary.

    `fast_path` ("auto": on a CUDA GPU, "on", "off") runs every forward in static shapes over a
    fixed-capacity cache, as CUDA graph replays on a GPU (`specgui.fastpath`); the tokens are the same.
    `compile` ("auto": on a CUDA GPU, "on", "off"; None: as the runner was last told) makes those programs run
    inductor's kernels (`specgui.compiled`): the same tokens as plain decoding on the same path.
    `profile` is the cost model methods size their drafts by and steps are priced with (default: the
    model's on this path, measured on first use, before any timing starts).
    `pipeline`: a step's event (and the cost model's `learn` of it) waits until the next step's forward is launched,
    and goes out while it runs; else (serial) before the next step begins. The same tokens and events, timings aside;
    `should_stop` is polled before each step's draft either way (pipelined, the step before's event is then still
    to go out: it does, before the Summary). With a measured profile a pipelined step's draft is sized by what the
    cost model learnt up to the step before the last (serial: the last).

    The timings (each ms of the generator's own time; draft and verify, and serially overhead, sum to the Summary's
    `wall_s`):
    `draft_ms` from the step's start (polling `should_stop`) to the draft's end, serially; pipelined from the end of
    the forward before (the host's whole work between the two forwards; 0 for a step launched ahead, its
    `verify_ms` the span from forward to forward); `verify_ms` from there to just before the verdict's read,
    serially, and pipelined to the forward's launch returning (on a GPU both end where the device finished the
    forward); `overhead_ms` the drafter's `observe` and the cost model's `learn`, timed on the host where each runs:
    serially counted apart, pipelined inside the next step's span (or beside a forward), so shown, not added. The
    step's text and event and the consumer's time are in none of them; serially, neither are accepting and cropping
    after the read.
    """
    _check_request(lm, prompt_ids, max_new_tokens)
    runner = lm.runner
    if compile is not None:
        runner.compile_mode = compiled.checked(compile)
    drafter = methods.create(method, runner, lm.name, sampling, params)
    generator = None if sampling.greedy else sampling.generator(runner.head_device)
    static = fastpath.resolve(fast_path, runner)
    profile = profile or costs.profile_for(lm, static, run=run)
    if profile.key.get("fast_path") != static:
        raise SpecGUIError(f"the cost profile was measured on the {'fast' if profile.key.get('fast_path') else 'eager'}"
                           f" path, this run takes the {'fast' if static else 'eager'} one")
    cache = fastpath.cache_for(runner, len(prompt_ids) + max_new_tokens) if static else kvcache.KVCache()
    if static and drafter.pieces():
        fastpath.warm_up(cache, drafter.pieces())  # before the clock starts: no capture is ever timed
    state = DecodeState(runner, cache, list(prompt_ids), len(prompt_ids), sampling, generator, max_new_tokens,
                        profile, tokenizer=lm.tokenizer, method=method, model=lm.name, static=static)
    detok = Detokenizer(lm.tokenizer, prompt_ids)
    yield Start(method=method, model=lm.name, device=str(runner.device), num_layers=runner.num_layers,
                params=_params_dict(drafter.params), sampling=sampling.to_dict(), max_new_tokens=max_new_tokens,
                prompt_ids=tuple(prompt_ids), prompt_text=prompt_text, fast_path=static,
                compiled=static and cache.programs.compiled, costs=profile.curve())

    with torch.inference_mode():
        drafter.setup(state)  # one-time work (a skip-set search, first-use timings): before the clock starts
        clock = _Clock(runner.device)
        captures = _Captures(state.cache)  # (captures before the clock started are no run's)
        # prefill: the prompt forward yields the first new token
        n = len(prompt_ids)
        logits = runner.forward(np.asarray(prompt_ids, dtype=np.int64), np.arange(n), state.cache,
                                observer=drafter.begin(state), logits_rows=slice(n - 1, n))
        verdict = verify(logits, Draft(), sampling, generator, before_read=clock.mark, riders=state.riders)
        state.riders = []
        first = verdict.token
        state.tokens.append(first)
        [prefill_ms] = clock.discount(clock.read(synced=True), captures.take())
        started = time.perf_counter()
        payload = drafter.observe(state, Outcome(path=[], token=first, emitted=[first], extra_tokens=None,
                                                 prefill=True))
        [overhead_ms] = clock.discount([clock.host(started)], captures.take())  # the clock stops: building events
        #    (detokenizing) is presentation
        prefill = Prefill(prompt_tokens=n, token=first, piece=detok.push(first), margin=verdict.margins[0],
                          ms=prefill_ms, overhead_ms=overhead_ms, payload=payload)
        yield prefill

        steps: list[Step] = []
        away: list[float] = []  # when the latest event's presentation began

        def event(decoded: _Decoded, counted: bool = True) -> Step:
            """3. event: the cost model learns what the step cost against what it priced (timed, with the step's
            observe, as its overhead; `counted` as `_Clock.host`), then the step's text and Step (presentation: not
            timed; the generator is away from here until the consumer hands back)."""
            started = time.perf_counter()
            draft, verdict, emitted = decoded.draft, decoded.verdict, decoded.emitted
            draft_ms, verify_ms = clock.discount(decoded.timed(), decoded.capture_ms)
            if not decoded.capture_ms:  # (a step that captured is no step's price)
                profile.learn(method, decoded.rows, draft_ms + verify_ms, draft.cost_ms, decoded.priced_verify_ms,
                              draft_ms=draft_ms, chained=decoded.ahead)
            overhead_ms = decoded.observe_ms + clock.host(started, counted)
            away.append(time.perf_counter())
            step = Step(
                index=decoded.index, draft_tokens=tuple(draft.tokens), draft_parents=tuple(draft.parents),
                draft_pieces=tuple(_draft_pieces(lm, decoded.context, draft)), path=tuple(verdict.path),
                token=verdict.token, corrected=verdict.corrected, emitted=tuple(emitted),
                emitted_pieces=tuple(detok.push(t) for t in emitted), margins=tuple(verdict.margins[: len(emitted)]),
                forward_tokens=decoded.rows, draft_ms=draft_ms, verify_ms=verify_ms, overhead_ms=overhead_ms,
                payload=_accounts(decoded.payload), predicted_ms=decoded.predicted_ms, plain_ms=decoded.plain_ms,
                capture_ms=decoded.capture_ms,
            )
            steps.append(step)
            return step

        # plain steps chain on the device where the fast path reads greedy verdicts, pipelined (`fastpath.PlainSteps`);
        # prompt lookup's steps run there wherever it reads greedy verdicts, chained where pipelined
        chains = _Chains(state.cache, pipeline) if state.unread else None
        state.chains = chains is not None and pipeline
        stop = _stop_reason(lm, state, [first])
        done: _Decoded | None = None  # the step before, decoded and observed, its event not yet out
        ahead: _Launched | None = None  # this step, launched chained before the step before was read
        last_end: Any = None  # pipelined: the clock's mark behind the step before's forward
        halted = False  # should_stop said so before a step to be launched ahead: the run stops before it
        while done is not None or stop is None:
            if done is not None and (stop is not None or not pipeline):
                yield event(done)  # 3. event, serially or after the last step: nothing is launched before it
                clock.away(away.pop())
                done = None
                continue
            if ahead is None:
                clock.resume(since=last_end)  # pipelined, the step's time runs from the forward before
                if halted or (should_stop is not None and should_stop()):
                    stop = "cancelled"
                    continue
            context = state.tokens[-4:]
            # 1. draft (a step launched ahead drafts now, as any step, what its drafter promised: nothing, or a lookup)
            draft = drafter.draft(state)
            made = draft.device_draft  # a draft the device makes at the launch verifies its size's rows, found or not
            rows = 1 + len(draft) + (len(draft.extras.tokens) if draft.extras else 0) if made is None else made.rows
            # 2. launch: one target forward over the pending token, the tree and any extras
            if ahead is not None:
                if not _kept(state, ahead.promise, draft):
                    raise SpecGUIError(f"{method} promised a step ahead it did not draft")
                launched, ahead = ahead, None
            else:
                clock.mark()
                launched = _launch(state, draft, chains)
                if pipeline:
                    clock.mark()  # verify_ms ends with the forward (on a GPU the device's), not what runs beside it
                    launched.end = clock.marks[-1]
            drafter.after_launch(state)  # what the drafter learns beside the forward
            #    and the step after, where the device can make its draft whatever this one's verdict: chained on the
            #    device, launched before this one is read
            promise = (drafter.ahead(state) if launched.chained and state.chains  # (room after this step's most)
                       and state.generated + rows + 1 <= state.max_new_tokens else None)
            if promise is not None and type(promise.device_draft) is launched.kind:  # chains of one kind
                halted = should_stop is not None and should_stop()  # polled before the step, as ever: once
                if not halted:
                    ahead = _launch(state, promise, chains, ahead=True)
                    ahead.end, ahead.ahead, ahead.promise = clock.device.mark(), True, promise
            #    the step's prices, for its event and the cost model (beside the forward: the draft priced its own),
            #    from what the cost model learnt before the step before's `learn` below, as the draft's were
            plain_ms = state.plain_ms()
            chained_plain = launched.ahead and rows == 1  # learnt as a chained plain step
            predicted_ms = plain_ms if chained_plain else state.step_ms(draft.cost_ms, rows)
            priced_verify_ms = profile.verify_ms(rows, state.committed)
            if done is not None:
                yield event(done, counted=False)  # 3. event, pipelined: the step before's, beside this forward
                clock.away(away.pop())
            # 4. read the verdict (serially, the clock's mark just before it), with what the device drafted at the
            #    launch: a prompt lookup's ids (checked against the host's draft), a skip chain's nodes (the draft's)
            drafted = [] if launched.drafted is None else [Rider(launched.drafted)]
            if launched.nodes is not None:
                draft.on_device.values = launched.nodes
            verdict = verify(launched.logits, draft, sampling, generator, launched.extra_logits,
                             extra_rows=launched.extra_rows, riders=state.riders + drafted,
                             before_read=launched.wait if pipeline else functools.partial(launched.wait, clock))
            state.riders = []
            if launched.kind is Lookup:
                fastpath.lookup.check(drafted[0].values, draft.tokens)
            elif launched.kind in (SkipChain, SlotChain):
                fastpath.cursor.check(drafted[0].values, verdict.path)
            # 5. accept: the accepted path plus the verifier's own token, cut at a stop token or the budget
            emitted = [draft.tokens[i] for i in verdict.path] + [verdict.token]
            emitted, stop = _cut(lm, state, emitted)
            # 6. crop: keep the pending token and the accepted nodes' keys, drop the rest (a chained plain step's one
            #    key stays as its launch left the cache: a crop now would cut the key of the step launched after it; a
            #    chained lookup's chain leaves its accepted keys in place, and the cache holds them)
            if launched.drafted is not None:
                state.cache.lengths = [state.committed + len(emitted)] * len(state.cache.lengths)
            elif not launched.chained:
                state.cache.keep(state.committed, [0] + [draft.block_row(i) for i in verdict.path])
            state.tokens.extend(emitted)
            #    (its phases' times are read with its event, behind the next launch: the marks are taken now; marked
            #    before the verdict's read, they wait for nothing. A step launched ahead: the device's time since the
            #    forward before it ended)
            timed = (functools.partial(clock.since, last_end, launched.end) if launched.ahead
                     else functools.partial(clock.spans, clock.take()))
            capture_ms = captures.take()  # (pipelined: since the step before's read, its observe's included)
            last_end = launched.end
            # 7. observe: the method learns from the verdict, before it drafts again
            started = time.perf_counter()
            priced = predicted_ms / plain_ms if plain_ms > 0 else 0.0
            outcome = Outcome(path=verdict.path, token=verdict.token, emitted=emitted,
                              extra_tokens=verdict.extra_tokens, priced=priced)
            payload = {**draft.info, **drafter.observe(state, outcome)}
            counted = not pipeline or stop is not None  # else in the next step's span, with what it captures
            observe_ms = clock.host(started, counted)
            if counted:
                [observe_ms] = clock.discount([observe_ms], captures.take())
            state.step += 1
            done = _Decoded(state.step, context, draft, verdict, emitted, rows, timed, capture_ms, observe_ms,
                            payload, predicted_ms, plain_ms, priced_verify_ms, chained_plain)

        generated = tuple(state.tokens[state.prompt_len :])
        text = lm.tokenizer.decode(list(generated), skip_special_tokens=True)
        summary = summarize(steps, prefill, wall_s=clock.total, stop=stop, token_ids=generated, text=text)
        profile.keep_learnt()  # what this run's steps taught the calibration, for the next process's first run
        yield summary


def run(lm: LoadedModel, prompt_ids: list[int], method: str = "baseline", **kwargs: Any) -> Result:
    """`generate` to the end, collecting the events."""
    return Result(list(generate(lm, prompt_ids, method, **kwargs)))


costs.use_decoder(run)  # the cost model times plain steps with this loop without importing it


def _plain(state: DecodeState, draft: Draft) -> bool:
    """Whether a step is plain decoding's: nothing drafted, nothing observed or brought along by its forward."""
    return (not len(draft) and draft.extras is None and draft.observer is None and draft.device_draft is None
            and not state.riders)


def _kept(state: DecodeState, promise: Draft, draft: Draft) -> bool:
    """Whether a step launched ahead was drafted as promised: a plain step, or the same draft made on the device."""
    return draft.device_draft == promise.device_draft if promise.device_draft is not None else _plain(state, draft)


class _Chains:
    """A run's steps chained on the device, made as its steps first want them: plain ones, pipelined
    (`fastpath.PlainSteps`), prompt lookup's (`fastpath.LookupSteps`), layer-skip ones (`fastpath.SkipSteps`) and
    carried ones (`fastpath.SlotSteps`)."""

    def __init__(self, cache: fastpath.StaticKVCache, pipeline: bool) -> None:
        self.cache, self.pipeline = cache, pipeline
        self.plain: fastpath.PlainSteps | None = None
        self.lookups: dict[tuple[int, int], fastpath.LookupSteps] = {}
        self.skips: fastpath.SkipSteps | None = None
        self.slots: fastpath.SlotSteps | None = None

    def plain_steps(self) -> fastpath.PlainSteps:
        if self.plain is None:
            self.plain = fastpath.PlainSteps(self.cache)
        return self.plain

    def lookup_steps(self, ngrams: tuple[int, int]) -> fastpath.LookupSteps:
        if ngrams not in self.lookups:
            self.lookups[ngrams] = fastpath.LookupSteps(self.cache, ngrams)
        return self.lookups[ngrams]

    def skip_steps(self) -> fastpath.SkipSteps:
        if self.skips is None:
            self.skips = fastpath.SkipSteps(self.cache)
        return self.skips

    def slot_steps(self) -> fastpath.SlotSteps:
        if self.slots is None:
            self.slots = fastpath.SlotSteps(self.cache)
        return self.slots


def _launch(state: DecodeState, draft: Draft, chains: _Chains | None, ahead: bool = False) -> _Launched:
    """2. launch: the step's target forward, chained on the device where it can be: a draft made there
    (`Draft.device_draft`: a prompt lookup, a skip chain, a carried chain), or, pipelined, a plain step (at the
    pending token's position, its id the host's, or, for a step launched `ahead`, the one the step before leaves
    there, as a lookup finds its n-gram in what that step left)."""
    made, tokens = draft.device_draft, None if ahead else state.tokens
    if made is not None and chains is None:
        raise SpecGUIError("a draft made on the device needs the fast path under greedy decoding")
    if isinstance(made, SkipChain):
        top, ready, accepted, nodes = chains.skip_steps().launch(made, tokens)
        return _Launched(top, chained=True, kind=SkipChain, ready=ready, drafted=accepted, nodes=nodes)
    if isinstance(made, SlotChain):  # the slots' predictions come back as the extras' choices
        top, ready, accepted, nodes = chains.slot_steps().launch(made, tokens)
        return _Launched(top, extra_rows=list(range(made.window)), chained=True, kind=SlotChain, ready=ready,
                         drafted=accepted, nodes=nodes)
    if made is not None and (made.size or chains.pipeline):  # (serially a lookup of nothing is a plain step)
        top, ready, drafted = chains.lookup_steps(made.ngrams).launch(made.size, tokens)
        return _Launched(top, chained=True, kind=Lookup, ready=ready, drafted=drafted)
    if chains is None or not chains.pipeline or not _plain(state, draft):
        return _Launched(*_verify_forward(state, draft))
    top, ready = chains.plain_steps().launch(state.committed + ahead, None if ahead else state.pending)
    return _Launched(top, chained=True, ready=ready)


def _verify_forward(state: DecodeState, draft: Draft
                    ) -> tuple[torch.Tensor | Top, torch.Tensor | None, list[int] | None]:
    """Logits [1 + N, V] for the pending token and the tree nodes, and [E, V] for the extras if wanted. Under greedy
    decoding instead the `Top` of the whole block (`Runner.forward(top=)`, computed in the program), and the rows past
    the tree's whose choices the extras want (read with the rest in one piece, picked on the host)."""
    c = state.committed
    tokens = [state.pending, *draft.tokens]
    positions = [c] + [c + d for d in draft.depths()]
    extras = draft.extras
    visibility = None if draft.is_chain else draft.visibility()
    if extras is not None:
        visibility = extras.block(draft)
        tokens += extras.tokens
        positions += extras.positions
    n = 1 + len(draft)
    want = extras is not None and extras.want_logits
    greedy = state.sampling.greedy
    rows: torch.Tensor | slice = slice(None) if want else slice(0, n)
    if want and extras.logit_rows is not None and not greedy:
        rows = torch.from_numpy(np.concatenate([np.arange(n), n + np.asarray(extras.logit_rows, dtype=np.int64)]))
    ids = np.asarray(tokens, dtype=np.int64)  # host values stay numpy: they ride in the pass's one upload
    on_device = draft.on_device
    if on_device is not None:  # the nodes stay on the device, after the pending token, before any extras
        ids = np.concatenate([ids[:1], np.full(on_device.nodes, -1), ids[1:]])  # -1: the id already in place
        if on_device.tokens is not None:
            state.cache.place(1, on_device.tokens)
    logits = state.runner.forward(
        ids, np.asarray(positions, dtype=np.int64), state.cache, visibility=visibility, logits_rows=rows,
        observer=draft.observer, pre_layer=extras.pre_layer if extras else None,
        top=VERIFY_TOP if greedy else 0,  # greedy reads the head's verdict, computed in the program
    )
    if greedy:
        if not want:
            return logits, None, None
        return logits, None, extras.logit_rows if extras.logit_rows is not None else list(range(len(extras.tokens)))
    return logits[:n], (logits[n:] if want else None), None


def _accounts(payload: dict[str, Any]) -> dict[str, Any]:
    """A step's payload as its event shows it: the plans a draft's `info` holds (the policy's sizing `Plan`, a
    `SkipPlan`) as their accounts (`to_dict`), written here, with the event, behind the next launch, not where the
    drafter drafted, between a verdict's read and the next launch, where a GPU waits for the host."""
    return {key: value.to_dict() if isinstance(value, Plan | SkipPlan) else value for key, value in payload.items()}


def _cut(lm: LoadedModel, state: DecodeState, emitted: list[int]) -> tuple[list[int], str | None]:
    """Trim a step's tokens at the first stop token or at the token budget."""
    for i, token in enumerate(emitted):
        if token in lm.stop_ids:
            return emitted[: i + 1], "eos"
    room = state.max_new_tokens - state.generated
    if len(emitted) >= room:
        return emitted[:room], "length"
    return emitted, None


def _stop_reason(lm: LoadedModel, state: DecodeState, emitted: list[int]) -> str | None:
    if emitted[-1] in lm.stop_ids:
        return "eos"
    return "length" if state.generated >= state.max_new_tokens else None


def _draft_pieces(lm: LoadedModel, context: list[int], draft: Draft) -> list[str]:
    """Each draft token's text, read after its own ancestors."""
    return pieces_in_context(lm.tokenizer, [(context + [draft.tokens[a] for a in draft.path_to(i)[:-1]], token)
                                            for i, token in enumerate(draft.tokens)])


def _params_dict(params: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(params) if dataclasses.is_dataclass(params) else {}


def _check_request(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise SpecGUIError("the prompt is empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecGUIError(f"max new tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) + max_new_tokens > lm.max_context:
        raise SpecGUIError(
            f"prompt ({len(prompt_ids)} tokens) + max new tokens ({max_new_tokens}) exceeds the model's "
            f"context of {lm.max_context} tokens: shorten the prompt or ask for fewer tokens"
        )

"""The decode loop: one loop for every method, yielding events.

    setup:   the method's one-time work (D&V's search, first-use timings), before the clock starts
    prefill: the prompt forward gives the first token (the pending token; its keys are not cached)
    repeat:  1. draft    the method proposes a token tree (maybe with ride-along tokens)
             2. launch   one target forward over [pending] + tree (+ extras), on the host's draft or chained on the
                         device (`launch`); the drafter learns what the next draft does without (`after_launch`)
             3. read     the verifier reads the forward's verdict
             4. accept   the verifier keeps a path and adds its own token; the cache commits it (`Launched.commit`)
             5. observe  the method learns from the verdict (the next draft needs it)
             6. event    the cost model learns the step, its text is built, its Step goes out
    end:     the Summary

The parts are the methods of `step.Run`; two drivers call them. Serially (`_serial`, `pipeline=False`) each step is
whole before the next. Pipelined (`_pipelined`, the default) a step's event waits until the next step's forward is
launched, so that on a GPU building and handing it out (and the consumer's time with it) overlaps the device's
forward instead of delaying its launch; and where the device can make the next step's draft whatever this one's
verdict (`Drafter.ahead`: a plain step, a prompt lookup, a layer-skip or carried chain) that step is launched before
this one is read, chained on the device, its verdict coming back through a pinned host row and an event. Either way
events go out one a step, in order, with the same content, and a run that stops launches nothing past its last
step, but for a chained step after a stop token (unread when it was launched; its keys are past the end).

Timing covers only the time spent inside this generator (`clock`): whatever a consumer does between events never
counts against a method. Pipelined, a step's time runs from the end of the forward before to the end of its own: on
a GPU the device's time, so the host's work between two forwards counts where the device waited for it, and not
where it ran beside a forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specgui import costs, fastpath, methods
from specgui.core import kvcache
from specgui.core.events import Event, Prefill, Start, Step, Summary, summarize
from specgui.core.launch import kept
from specgui.core.sampling import GREEDY, Sampling
from specgui.core.step import Run
from specgui.core.text import Detokenizer
from specgui.costs import CostProfile
from specgui.errors import SpecGUIError
from specgui.fastpath import compiled
from specgui.methods.base import DecodeState
from specgui.model.loading import LoadedModel


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
    inductor's kernels (`specgui.fastpath.compiled`): the same tokens as plain decoding on the same path.
    `profile` is the cost model methods size their drafts by and steps are priced with (default: the
    model's on this path, measured on first use, before any timing starts).
    `pipeline`: a step's event (and the cost model's `learn` of it) waits until the next step's forward is launched,
    and goes out while it runs; else (serial) before the next step begins. The same tokens and events, timings aside;
    `should_stop` is polled before each step's draft either way, and for a step launched ahead before the step
    before's read (pipelined, the step before's event is then still to go out: it does, before the Summary). With a
    measured profile a pipelined step's draft is sized by what the cost model learnt up to the step before the last
    (serial: the last).

    The timings (each ms of the generator's own time; draft and verify, and serially overhead, sum to the Summary's
    `wall_s`):
    `draft_ms` from the step's start (polling `should_stop`) to the draft's end, serially; pipelined from the end of
    the forward before (the host's whole work between the two forwards; 0 for a step launched ahead, its
    `verify_ms` the span from forward to forward); `verify_ms` from there to just before the verdict's read,
    serially, and pipelined to the forward's launch returning (on a GPU both end where the device finished the
    forward); `overhead_ms` the drafter's `observe` and the cost model's `learn`, timed on the host where each runs:
    serially counted apart, pipelined inside the next step's span (or beside a forward), so shown, not added. The
    step's text and event and the consumer's time are in none of them; serially, neither are accepting and cropping
    after the read. `capture_ms`: programs captured inside the step (a plan adopted), left out of all of them and of
    what the cost model learns.
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
    params_shown = dataclasses.asdict(drafter.params) if dataclasses.is_dataclass(drafter.params) else {}
    yield Start(method=method, model=lm.name, device=str(runner.device), num_layers=runner.num_layers,
                params=params_shown, sampling=sampling.to_dict(), max_new_tokens=max_new_tokens,
                prompt_ids=tuple(prompt_ids), prompt_text=prompt_text, fast_path=static,
                compiled=static and cache.programs.compiled, costs=profile.curve())
    with torch.inference_mode():
        drafter.setup(state)  # one-time work (a skip-set search, first-use timings): before the clock starts
        decoding = Run(lm, method, state, drafter, profile, Detokenizer(lm.tokenizer, prompt_ids), pipeline,
                       should_stop)
        prefill = decoding.prefill(prompt_ids)
        yield prefill
        yield from (_pipelined(decoding) if pipeline else _serial(decoding))
        generated = tuple(state.tokens[state.prompt_len :])
        text = lm.tokenizer.decode(list(generated), skip_special_tokens=True)
        summary = summarize(decoding.steps, prefill, wall_s=decoding.clock.total, stop=decoding.stop,
                            token_ids=generated,
                            text=text)
        profile.keep_learnt()  # what this run's steps taught the calibration, for the next process's first run
        yield summary


def _serial(run: Run) -> Iterator[Step]:
    """Each step whole, its event out before the next step's draft."""
    while run.stop is None:
        run.clock.resume()
        if run.cancelled():
            run.stop = "cancelled"
            break
        context, draft = run.draft()  # 1. draft
        rows = draft.verify_rows()
        launched = run.launch(draft)  # 2. launch
        run.drafter.after_launch(run.state)  # (what the drafter learns beside the forward)
        prices = run.price(draft, launched, rows)
        verdict = run.read(launched, draft)  # 3. read
        emitted = run.accept(launched, draft, verdict)  # 4. accept and commit
        decoded = run.observe(context, draft, verdict, emitted, rows, launched, prices)  # 5. observe
        yield run.event(decoded)  # 6. event
        run.presented()


def _pipelined(run: Run) -> Iterator[Step]:
    """The same parts, a step's event held until the next step's forward is launched (it goes out beside that
    forward), and a step chained on the device launched before the step before it is read (`Run.launch_ahead`):
    on a GPU the host's work on a step runs beside a forward instead of delaying its launch."""
    done = None  # the step before, decoded and observed, its event not yet out
    ahead = None  # this step, launched chained before the step before was read
    while done is not None or run.stop is None:
        if done is not None and run.stop is not None:
            yield run.event(done)  # the last step's event: nothing is launched before it
            run.presented()
            done = None
            continue
        if ahead is None:
            run.clock.resume(since=run.last_end)  # the step's time runs from the forward before
            if run.halted or run.cancelled():
                run.stop = "cancelled"
                continue
        context, draft = run.draft()  # 1. draft (a step launched ahead drafts now what its drafter promised)
        rows = draft.verify_rows()
        if ahead is not None:  # 2. launch, or the launch made ahead
            if not kept(run.state, ahead.promise, draft):
                raise SpecGUIError(f"{run.method} promised a step ahead it did not draft")
            launched, ahead = ahead, None
        else:
            launched = run.launch(draft)
        run.drafter.after_launch(run.state)  # (what the drafter learns beside the forward)
        ahead = run.launch_ahead(launched, rows)  # the step after, where the device can make its draft now
        prices = run.price(draft, launched, rows)
        if done is not None:
            yield run.event(done, counted=False)  # the step before's event, beside this forward
            run.presented()
        verdict = run.read(launched, draft)  # 3. read
        emitted = run.accept(launched, draft, verdict)  # 4. accept and commit
        done = run.observe(context, draft, verdict, emitted, rows, launched, prices)  # 5. observe


def run(lm: LoadedModel, prompt_ids: list[int], method: str = "baseline", **kwargs: Any) -> Result:
    """`generate` to the end, collecting the events."""
    return Result(list(generate(lm, prompt_ids, method, **kwargs)))


costs.use_decoder(run)  # the cost model times plain steps with this loop without importing it


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

"""The run controller: one shared model, decoding apart from rendering, fair timing, replays.

- `DEVICE` is the one thread that ever touches a model (loading, decoding, the Compare suite). Besides
  serialising runs, this matters for speed on CPU: once a second thread has run OpenMP work, libgomp
  sees more threads than cores and stops spin-waiting, and small matmuls in the other thread fall to
  about single-core speed (a small verify matmul takes about twice as long). So the
  page's threads only render, and the model's work stays on one long-lived thread.
- `ModelStore` loads a model once and shares it; `busy` is held for a whole live run (method and
  baseline), so no other run slips in between or shares the device.
- `Worker` runs `decode.generate` on `DEVICE` and hands events over through a queue; the page drains
  it in batches every few hundred milliseconds. The core's clock only counts time inside the
  generator, and the generator never waits for the page, so rendering cannot slow a method down. The
  decode goes through `hosting.gpu` (a ZeroGPU slice on Spaces, a no-op elsewhere), and the submitting
  request's context travels to `DEVICE` with it.
- `live` runs the method and a fresh baseline, `repeats` times, and yields `Tick`s: side by side where each run
  has a cache of its own (the eager path, a CPU's default: `side_by_side`, a step of each in turn, so that both meet
  the machine's same moments), else one after the other (the fast path's one static cache). Both are priced by
  one cost profile, checked first (`costs.lookup`: a couple of plain steps against the saved profile's); a stale
  one still prices the run, which is not held up, with a notice, and is measured again once the run is over.
  Baseline's events come from `BaselineCache` (same model, prompt ids and settings) only when the visitor asks.
  `replay` yields recorded events at the recorded pace: the race after a live run, or a trace file where no model
  can be loaded.
"""

from __future__ import annotations

import contextvars
import dataclasses
import gc
import itertools
import math
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from specgui import costs, fastpath
from specgui.core import decode, progress
from specgui.core.events import Event, Prefill, Start, Step, Summary
from specgui.core.sampling import Sampling
from specgui.core.text import Messages, encode_prompt
from specgui.costs import CostProfile, Drift
from specgui.errors import SpecGUIError
from specgui.model import hosting
from specgui.model.loading import EMBEDDED, LoadedModel, ModelSpec, load
from specgui.model.loading import check as check_spec

METHOD, BASELINE = "method", "baseline"  # the two panes
DEVICE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specgui-device")  # see the module docstring
FRAME_S = 0.5  # how often the page takes a batch of events: each frame costs CPU the decode could use
CALIBRATION_TOKENS = 16  # tokens of each preset decoded at start (`calibrate`)
MAX_REPLAY_S = 20 * 60  # a replay holds the model's queue slot: no trace may make it wait longer


@dataclass
class Tick:
    """Something for the page to show: events for one pane, or a status line."""

    pane: str = METHOD
    events: list[Event] = field(default_factory=list)
    cached_at: float | None = None  # baseline's events came from the cache (recorded then)
    status: str = ""
    note: str = ""  # something about the whole run the final status must repeat (a cut budget)
    repeat: int = 0  # which of the alternating method / baseline pairs these events belong to


@dataclass(frozen=True)
class RunRequest:
    """Everything one live run needs, as the page collected it."""

    method: str
    prompt: str | Messages
    max_new_tokens: int
    sampling: Sampling
    params: dict[str, Any] = field(default_factory=dict)
    model: str = EMBEDDED
    prompt_text: str = ""
    repeats: int = 1  # method / baseline pairs, run in turn
    reuse_baseline: bool = False  # take baseline's events from the cache when it holds them
    fast_path: str = "auto"  # static cache + bucketed forwards (+ CUDA graphs): auto = on a GPU (`specgui.fastpath`)
    compile: str = "auto"  # the fast path's programs as inductor's kernels: auto = on a GPU (`fastpath.compiled`)


class ModelStore:
    """One loaded model at a time, shared by every handler (loading another name replaces it).

    Another name is checked first (`check`, by default `loading.check`: the config only) and the held model
    freed only then, so a bad name keeps it; freeing before the new weights arrive keeps peak memory at one
    model.
    """

    def __init__(self, loader: Callable[[ModelSpec], LoadedModel] = load,
                 check: Callable[[ModelSpec], None] = check_spec) -> None:
        self._loader = loader
        self._check = check
        self._lm: LoadedModel | None = None
        self._load_lock = threading.Lock()
        self.busy = threading.Lock()  # held while decoding: runs never overlap on the device

    @property
    def current(self) -> LoadedModel | None:
        return self._lm

    def holds(self, name: str) -> bool:
        return self._lm is not None and self._lm.spec.name == (name.strip() or EMBEDDED)

    def get(self, name: str) -> LoadedModel:
        with self._load_lock:
            if not self.holds(name):
                spec = ModelSpec(name=name.strip() or EMBEDDED)
                self._check(spec)
                self._lm = None
                gc.collect()  # free the old weights before the new ones arrive
                self._lm = DEVICE.submit(self._loader, spec).result()
            return self._lm


class BaselineCache:
    """Finished baseline runs by (model, device, prompt ids, settings); past `size`, the least recently used goes."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._runs: OrderedDict[tuple, tuple[list[Event], float]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(lm: LoadedModel, ids: list[int], sampling: Sampling, max_new_tokens: int, fast_path: str = "auto",
            compile: str = "auto") -> tuple:
        return (lm.name, str(lm.device), tuple(ids), tuple(sorted(sampling.to_dict().items())), max_new_tokens,
                fast_path, compile)

    def get(self, key: tuple) -> tuple[list[Event], float] | None:
        with self._lock:
            if key in self._runs:
                self._runs.move_to_end(key)
                return self._runs[key]
            return None

    def put(self, key: tuple, events: list[Event]) -> None:
        """Keep a finished run (a stopped one is not a baseline)."""
        if not events or not isinstance(events[-1], Summary) or events[-1].stop == "cancelled":
            return
        with self._lock:
            self._runs[key] = (list(events), time.time())
            self._runs.move_to_end(key)
            while len(self._runs) > self.size:
                self._runs.popitem(last=False)


_DONE = object()
EventSource = Callable[[Callable[[], bool]], Iterator[Event]]  # should_stop -> events
PairSource = Callable[[Callable[[], bool]], Iterator[tuple[str, Event]]]  # should_stop -> (pane, event)


class Worker:
    """Consumes an event source on the device thread; `batches` hands the events over in groups.

    The source gets a `should_stop` that turns true when the user's `stop` flag is set or when the
    consumer goes away (`close`), so a run never outlives the page that asked for it.
    """

    def __init__(self, source: EventSource, stop: threading.Event) -> None:
        self._source = source
        self._stop = stop
        self._cancel = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.events: list[Event] = []
        # gradio's request context (which ZeroGPU's scheduler reads) does not cross threads by itself
        self._future: Future = DEVICE.submit(contextvars.copy_context().run, self._run)

    def _should_stop(self) -> bool:
        return self._stop.is_set() or self._cancel.is_set()

    def _run(self) -> None:
        try:
            for event in self._source(self._should_stop):
                self._queue.put(event)
        except BaseException as exc:  # re-raised in the consumer's thread, where the page can report it
            self._queue.put(exc)
        finally:
            self._queue.put(_DONE)

    def batches(self, interval: float = FRAME_S, prefills: int = 0) -> Iterator[list[Any]]:
        """Lists of new events (a `side_by_side` source's: (pane, event) pairs), at most one list per `interval`
        seconds, until the source is exhausted. With `prefills`, none before that many prompt forwards are done: a
        frame drawn meanwhile (the page's work and the browser's, on the same cores) slowed a first race's prompt
        forward, which is counted in its speedup."""
        batch: list[Event] = []
        try:
            while True:
                deadline = time.monotonic() + interval
                while True:
                    try:
                        item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if item is _DONE:
                        if batch:
                            yield batch
                        return
                    if isinstance(item, BaseException):
                        raise item
                    batch.append(item)
                    self.events.append(item)
                    prefills -= isinstance(item[1] if isinstance(item, tuple) else item, Prefill)
                if batch and prefills <= 0:
                    yield batch
                    batch = []
        finally:
            self.close()

    def close(self) -> None:
        """Ask the source to stop (if it still runs) and wait until it has."""
        self._cancel.set()
        self._future.result()


class StopFlags:
    """One stop flag per browser session, so Stop only ends the run of whoever pressed it."""

    def __init__(self) -> None:
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def fresh(self, session: str) -> threading.Event:
        with self._lock:
            self._flags[session] = threading.Event()
            return self._flags[session]

    def stop(self, session: str) -> bool:
        with self._lock:
            flag = self._flags.get(session)
        if flag is not None:
            flag.set()
        return flag is not None


@hosting.gpu
def gpu_decode(lm: LoadedModel, ids: list[int], method: str, **kwargs: Any) -> Iterator[Event]:
    """`decode.generate`: the model's work, the one generator that holds a GPU slice on ZeroGPU."""
    yield from decode.generate(lm, ids, method, **kwargs)


@hosting.gpu
def gpu_profile(lm: LoadedModel, fast: bool, measure: bool) -> tuple[CostProfile | None, Drift | None]:
    """The model's cost profile on this path: held or saved-and-checked (`costs.lookup`), or with `measure`
    measured now (`costs.remeasure`). Model work, so it runs on `DEVICE` (and in a GPU slice on ZeroGPU)."""
    if measure:
        return costs.remeasure(lm, fast, run=decode.run), None
    return costs.lookup(lm, fast, run=decode.run)


def calibrate(lm: LoadedModel, runs: list[tuple[list[int], str, dict[str, Any]]], tokens: int = CALIBRATION_TOKENS,
              hold: Callable[[], None] | None = None, room: int = 0) -> int:
    """Before the first visitor's run, as a bench's warm-up does: decode `tokens` of plain decoding and of each (prompt
    ids, method, parameters) on `DEVICE`, so that the app's first run is priced by a calibration (`costs.Calibration`)
    that has seen every row count the demo presets verify, in this moment of the machine, and not by the raw profile
    (which prices a fresh app's first run well under what it measures). The app does this in the background once its
    page is up (`specgui.ui.warmup`), submitting `calibrate_here` itself; this waits for it.

    Every start, even where the saved profile has learnt before (a profile's check teaches it plain steps, so it
    always has): a speedup is priced by the ratio of two corrections (a verify of its rows over a plain step), and
    both must be of one moment of the machine and of the thread that decodes. So on `DEVICE` (see the module
    docstring): a warm-up on the main thread, skipped where the saved profile had learnt, priced verifies that
    then ran slower on `DEVICE` against plain steps timed on the other thread, and a first run came out far under
    its measured speedup; decoded on `DEVICE` every start, the presets' first runs are predicted within a few percent
    (`python -m specgui first-minute` measures it). Returns how many runs it decoded.

    On the fast path (a GPU) the same runs make every program the presets' methods use (`fastpath.warm_up` at the
    cache's making, a method's pieces, plans and hooks as it sets up), and the cache is first made with `room`
    positions (the longest preset's prompt and budget), so that a visitor's first run of a preset replays programs
    and captures none (a larger cache would capture them all again)."""
    return _on_device(calibrate_here, lm, runs, tokens, hold, room)


@hosting.gpu(duration=300)
def calibrate_here(lm: LoadedModel, runs: list[tuple[list[int], str, dict[str, Any]]],
                   tokens: int = CALIBRATION_TOKENS, hold: Callable[[], None] | None = None, room: int = 0,
                   on_phase: Callable[[progress.Phase], None] | None = None) -> int:
    """`calibrate`'s work on the calling thread (it must be `DEVICE`), as one phase (`specgui.core.progress`) handed to
    `on_phase`, a step a preset; `hold` is called before every preset after the first (a test's pause)."""
    static = fastpath.resolve("auto", lm.runner)
    with progress.phase("calibrating the demo presets", total=len(runs)) as phase:
        if on_phase is not None:
            on_phase(phase)
        if static:  # a CPU has no fast path by default: nothing to capture
            with progress.phase("compiling and capturing the fast path's plain programs") as capture:
                progress.advance(capture, f"{len(fastpath.cache_for(lm.runner, room).programs)} programs")
        profile = costs.profile_for(lm, static, run=decode.run)
        for i, (ids, method, params) in enumerate(runs):
            if i and hold is not None:
                hold()
            for name, chosen in (("baseline", None), (method, params)):
                decode.run(lm, ids, name, max_new_tokens=tokens, params=chosen, profile=profile)
            progress.advance(phase, method)
        if static:
            print(f"the fast path holds {len(lm.runner.static_cache.programs)} programs for the presets' methods",
                  file=sys.stderr, flush=True)
    return 2 * len(runs)


def decode_source(lm: LoadedModel, ids: list[int], method: str, request: RunRequest,
                  profile: CostProfile | None = None) -> EventSource:
    """`gpu_decode` for `method` as a Worker source (the request's parameters apply to its own method); priced by
    `profile` (None: the model's, as `decode.generate` finds it)."""
    params = request.params if method == request.method else None
    return lambda should_stop: gpu_decode(lm, ids, method, max_new_tokens=request.max_new_tokens,
                                          sampling=request.sampling, params=params,
                                          prompt_text=request.prompt_text, fast_path=request.fast_path,
                                          compile=request.compile, should_stop=should_stop, profile=profile)


def _on_device(fn: Callable[..., Any], *args: Any) -> Any:
    return DEVICE.submit(contextvars.copy_context().run, fn, *args).result()


def priced(lm: LoadedModel, request: RunRequest) -> Iterator[Tick]:
    """Status ticks while the run's cost profile is made ready; returns (profile, drift when it is stale).

    A model's first run on this machine has no profile to be priced by, so it waits for one to be measured;
    a saved profile that a couple of plain steps now contradict (`Drift.stale`) still prices the run, which
    is not held up, and the notice says so (the caller measures it again after the run).
    """
    fast = fastpath.resolve(request.fast_path, lm.runner)
    profile, drift = _on_device(gpu_profile, lm, fast, False)
    if profile is None:
        yield Tick(status="measuring the cost profile of this model on this machine (its first run here) …")
        profile, drift = _on_device(gpu_profile, lm, fast, True)
    if drift is None or not drift.stale:
        return profile, None
    notice = (f"the saved cost profile ({profile.origin()}) no longer holds: {drift.sentence()}; this run is priced "
              "by it, and it is measured again after the run")
    yield Tick(status=notice, note=notice)
    return profile, drift


def fit_context(lm: LoadedModel, ids: list[int], max_new_tokens: int) -> tuple[int, str]:
    """Max new tokens cut to what the model's context holds after the prompt, and a note when cut."""
    room = lm.max_context - len(ids)
    if room < 1:
        raise SpecGUIError(f"the prompt is {len(ids)} tokens but the model's context holds {lm.max_context}: "
                           "shorten the prompt")
    if max_new_tokens > room:
        return room, f"max new tokens cut to {room} to fit the model's context of {lm.max_context} tokens"
    return max_new_tokens, ""


def side_by_side(method: EventSource, baseline: EventSource) -> PairSource:
    """A race's two runs decoded in turn on one thread, a step at a time: the run that has emitted fewer tokens goes
    next (the method on a tie), so both prompt forwards run back to back and both runs' steps meet the same moments of
    the machine, and the same frames of the page. Yields (pane, event).

    Why: a race's prediction prices the method's steps and plain decoding's by one calibration, so it holds where
    both runs meet the machine alike. One after the other they did not: on a shared CPU the baseline's steps,
    measured seconds apart, ran slower or faster than the method's had been priced, more so with the page streaming
    into a browser on the same cores; side by side, the prediction's error about halved. Each
    run's clock counts its own generator's time only (`decode.generate` leaves out the time it is away), so neither
    run's time holds the other's."""
    def source(should_stop: Callable[[], bool]) -> Iterator[tuple[str, Event]]:
        going = {METHOD: method(should_stop), BASELINE: baseline(should_stop)}
        made = dict.fromkeys(going, 0)  # tokens emitted so far
        try:
            while going:
                pane = min(going, key=lambda p: (made[p], p != METHOD))
                event = next(going[pane], None)
                if event is None:
                    del going[pane]
                    continue
                made[pane] += 1 if isinstance(event, Prefill) else len(event.emitted) if isinstance(event, Step) else 0
                yield pane, event
        finally:
            for run in going.values():
                run.close()
    return source


def _ticks(worker: Worker, pane: str, repeat: int) -> Iterator[Tick]:
    with closing(worker.batches(prefills=1)) as batches:  # closing this generator closes the worker too
        for batch in batches:
            yield Tick(pane, batch, repeat=repeat)


def _pair_ticks(worker: Worker, repeat: int) -> Iterator[Tick]:
    """A `side_by_side` worker's batches as ticks, a tick per pane's run of events, in order."""
    with closing(worker.batches(prefills=2)) as batches:
        for batch in batches:
            for pane, items in itertools.groupby(batch, key=lambda item: item[0]):
                yield Tick(pane, [event for _, event in items], repeat=repeat)


def live(store: ModelStore, cache: BaselineCache, request: RunRequest, stop: threading.Event) -> Iterator[Tick]:
    """Run the method and baseline, `request.repeats` times: side by side on the device thread (`side_by_side`)
    where the path allows, else one after the other; never two on the device at once."""
    if not store.holds(request.model):
        yield Tick(status=f"loading model {request.model} …")
    lm = store.get(request.model)
    ids = encode_prompt(lm.tokenizer, request.prompt)
    max_new, note = fit_context(lm, ids, request.max_new_tokens)
    if note:
        request = dataclasses.replace(request, max_new_tokens=max_new)
        yield Tick(status=note, note=note)
    key = BaselineCache.key(lm, ids, request.sampling, request.max_new_tokens, request.fast_path, request.compile)
    with store.busy:
        lm.runner.compile_mode = request.compile  # before the profile is looked up: it is kept per compile setting
        profile, stale = yield from priced(lm, request)
        yield from _pairs(lm, ids, cache, key, request, stop, profile)
        if stale is not None:  # after the run, before the device serves anyone else
            yield Tick(status="measuring the cost profile again on this machine …")
            _on_device(gpu_profile, lm, fastpath.resolve(request.fast_path, lm.runner), True)


def _pairs(lm: LoadedModel, ids: list[int], cache: BaselineCache, key: tuple, request: RunRequest,
           stop: threading.Event, profile: CostProfile) -> Iterator[Tick]:
    apart = fastpath.resolve(request.fast_path, lm.runner)  # the fast path's one static cache holds one run at a time
    for repeat in range(request.repeats):
        hit = cache.get(key) if request.reuse_baseline else None
        if hit is None and not apart:  # each run on a cache of its own: side by side
            baseline = decode_source(lm, ids, "baseline", request, profile)
            worker = Worker(side_by_side(decode_source(lm, ids, request.method, request, profile), baseline), stop)
            yield from _pair_ticks(worker, repeat)
            cache.put(key, [event for pane, event in worker.events if pane == BASELINE])
            if stop.is_set():
                return
            continue
        worker = Worker(decode_source(lm, ids, request.method, request, profile), stop)
        yield from _ticks(worker, METHOD, repeat)
        if request.method == "baseline":
            cache.put(key, worker.events)
        if stop.is_set():
            return
        # the page drew the method's last frame while this generator waited: nothing was decoding then
        hit = cache.get(key) if request.reuse_baseline else None
        if hit is not None:
            yield Tick(BASELINE, hit[0], cached_at=hit[1], repeat=repeat)
            continue
        worker = Worker(decode_source(lm, ids, "baseline", request, profile), stop)
        yield from _ticks(worker, BASELINE, repeat)
        cache.put(key, worker.events)
        if stop.is_set():
            return


def check_trace_count(n: int) -> None:
    """One or two traces: checked before reading any, so a pile of uploads is refused unread."""
    if not 1 <= n <= 2:
        raise SpecGUIError("load one trace, or a method trace and a baseline trace")


def assign_panes(traces: list[list[Event]]) -> dict[str, list[Event]]:
    """One trace plays in the method pane; with two, the baseline trace goes to the baseline pane."""
    check_trace_count(len(traces))
    if len(traces) == 1:
        return {METHOD: traces[0]}
    starts = [t[0] for t in traces]
    baseline = [i for i, s in enumerate(starts) if isinstance(s, Start) and s.method == "baseline"]
    if not baseline:
        raise SpecGUIError("of two traces, one must be a baseline run")
    b = baseline[-1]
    return {METHOD: traces[1 - b], BASELINE: traces[b]}


def _times(event: Event) -> tuple[float, ...]:
    """The recorded times (ms, or s for a summary) that place an event on the replay clock."""
    if isinstance(event, Prefill):
        return (event.ms, event.overhead_ms)
    if isinstance(event, Step):
        return (event.draft_ms, event.verify_ms, event.overhead_ms)
    return (event.wall_s,) if isinstance(event, Summary) else ()


def _timeline(events: list[Event]) -> list[tuple[float, Event]]:
    """Each event at the decoding time (seconds) it was produced."""
    clock = 0.0
    out = []
    for event in events:
        if isinstance(event, Summary):
            clock = max(clock, event.wall_s)
        else:
            clock += sum(_times(event)) / 1000
        out.append((clock, event))
    return out


def check_replay(panes: dict[str, list[Event]], speed: float) -> None:
    """Refuse a replay that could not keep time: a speed that is not positive, recorded times that are not
    finite and non-negative (a trace file may hold anything, NaN included), or one longer than MAX_REPLAY_S."""
    if not (math.isfinite(speed) and speed > 0):
        raise SpecGUIError(f"replay speed must be positive, got {speed:g}")
    if any(not (math.isfinite(t) and t >= 0) for events in panes.values() for e in events for t in _times(e)):
        raise SpecGUIError("the trace holds a time that is negative or not a number")
    longest = max((_timeline(events)[-1][0] for events in panes.values() if events), default=0.0) / speed
    if longest > MAX_REPLAY_S:
        raise SpecGUIError(f"this replay would take {longest / 60:.0f} min at {speed:g}×; "
                           f"the most is {MAX_REPLAY_S // 60} min (choose a faster speed)")


def replay(panes: dict[str, list[Event]], stop: threading.Event, speed: float = 1.0,
           frame: float = FRAME_S) -> Iterator[Tick]:
    """Yield recorded events at their recorded pace (both panes on one clock: a race), `speed` times faster."""
    check_replay(panes, speed)
    timeline = sorted(((t, pane, n, e) for pane, events in panes.items() for n, (t, e) in enumerate(_timeline(events))),
                    key=lambda item: (item[0], item[1], item[2]))
    begin = time.monotonic()
    i = 0
    while i < len(timeline) and not stop.is_set():
        now = (time.monotonic() - begin) * speed
        due: dict[str, list[Event]] = {}
        while i < len(timeline) and timeline[i][0] <= now:
            due.setdefault(timeline[i][1], []).append(timeline[i][3])
            i += 1
        for pane, events in due.items():
            yield Tick(pane, events)
        if i < len(timeline):
            wait = timeline[i][0] / speed - (time.monotonic() - begin)
            stop.wait(max(wait, frame) if due else max(wait, 0.0))  # at most one frame per `frame` seconds

"""The run controller: decoding on the device thread, method and baseline side by side, cache, stop, replay pace."""

import json
import threading
import time
from pathlib import Path

import pytest
from ui_helpers import prefill, run, slowed, start, step

from helpers import tiny_model
from specgui import costs
from specgui.core import decode
from specgui.core.events import Start, Step, Summary
from specgui.core.sampling import Sampling
from specgui.core.text import encode_prompt
from specgui.errors import SpecGUIError
from specgui.ui import runs
from specgui.ui.runs import BASELINE, METHOD, BaselineCache, ModelStore, RunRequest, StopFlags, Worker

PROMPT = "abcdeabcdeabcdeabcd"  # the tiny model's letter tokenizer; repeats give prompt lookup matches


@pytest.fixture
def store(tiny_lm):
    loads = []
    store = ModelStore(loader=lambda spec: loads.append(spec.name) or tiny_lm, check=lambda spec: None)
    store.loads = loads
    return store


def request(method: str = "pld", **kw) -> RunRequest:
    return RunRequest(**{"method": method, "prompt": PROMPT, "max_new_tokens": 24, "sampling": Sampling(),
                         "model": "tiny-llama", **kw})


def device_free() -> bool:
    """The one device thread takes new work at once (a worker still decoding would hold it)."""
    return runs.DEVICE.submit(lambda: True).result(timeout=2)


def shape(events):
    """What must match between two runs of the same decode: the tokens, step by step as emitted. (Not the drafts:
    their sizes follow what earlier steps measured, `costs.Calibration`, so timings move them.)"""
    return [t for e in events if isinstance(e, Step) for t in e.emitted] + [events[-1].token_ids]


def test_worker_hands_over_the_events_of_a_direct_run(tiny_lm):
    ids = tiny_lm.tokenizer(PROMPT)["input_ids"]
    worker = Worker(runs.decode_source(tiny_lm, ids, "pld", request()), threading.Event())
    got = [e for batch in worker.batches(0.01) for e in batch]
    assert shape(got) == shape(decode.run(tiny_lm, ids, "pld", max_new_tokens=24).events)
    assert device_free() and worker.events == got


def test_decoding_runs_on_the_one_device_thread(tiny_lm):
    seen = set()

    def source(should_stop):
        seen.add(threading.get_ident())
        yield from decode.generate(tiny_lm, [1, 2, 3], "baseline", max_new_tokens=3, should_stop=should_stop)

    for _ in range(2):
        list(Worker(source, threading.Event()).batches(0.01))
    assert seen == {runs.DEVICE.submit(threading.get_ident).result()}


def test_live_runs_the_method_beside_a_fresh_baseline_and_reuses_one_only_when_asked(store):
    cache = BaselineCache()
    ticks = list(runs.live(store, cache, request(), threading.Event()))
    panes = [t.pane for t in ticks if not t.status]
    assert ticks[0].status.startswith("loading model")
    assert panes[0] == METHOD and set(panes) == {METHOD, BASELINE}
    first_baseline = [e for t in ticks if t.pane == BASELINE for e in t.events]
    assert isinstance(first_baseline[-1], Summary) and all(t.cached_at is None for t in ticks)

    fresh = list(runs.live(store, cache, request(), threading.Event()))
    assert all(t.cached_at is None for t in fresh) and len([t for t in fresh if t.pane == BASELINE]) >= 1
    assert [e for t in fresh if t.pane == BASELINE for e in t.events] != first_baseline  # decoded again

    again = list(runs.live(store, cache, request(reuse_baseline=True), threading.Event()))
    baseline = [t for t in again if t.pane == BASELINE]
    assert len(baseline) == 1 and baseline[0].cached_at is not None and isinstance(baseline[0].events[-1], Summary)
    assert store.loads == ["tiny-llama"]  # loaded once, shared

    other = list(runs.live(store, cache, request(max_new_tokens=20, reuse_baseline=True), threading.Event()))
    assert all(t.cached_at is None for t in other if t.pane == BASELINE)  # other settings: a fresh baseline


def test_repeats_run_their_pairs_in_turn(store):
    ticks = [t for t in runs.live(store, BaselineCache(), request(repeats=3), threading.Event()) if not t.status]
    repeats = [t.repeat for t in ticks]
    assert repeats == sorted(repeats) and {(t.repeat, t.pane) for t in ticks} == {
        (r, pane) for r in range(3) for pane in (METHOD, BASELINE)}
    for repeat in range(3):
        for pane in (METHOD, BASELINE):
            events = [e for t in ticks if (t.repeat, t.pane) == (repeat, pane) for e in t.events]
            assert isinstance(events[-1], Summary) and events[-1].stop == "length"


def test_baseline_as_the_method_is_a_noise_check_against_a_fresh_baseline(store):
    ticks = list(runs.live(store, BaselineCache(), request("baseline"), threading.Event()))
    method = [e for t in ticks if t.pane == METHOD for e in t.events]
    baseline = [e for t in ticks if t.pane == BASELINE for e in t.events]
    assert all(t.cached_at is None for t in ticks) and baseline != method
    assert shape(baseline) == shape(method)  # the same decode, timed twice


def test_stop_ends_both_runs_and_caches_no_baseline(store, tiny_lm, monkeypatch):
    stop, cache = threading.Event(), BaselineCache()
    ticks = []
    # baseline: one token a forward, each at least 2 ms, so 1000 tokens outlast the first 0.5 s batch on any machine
    # (pld on this repetitive prompt finished 800 before the stop arrived)
    slowed(tiny_lm, monkeypatch)
    for tick in runs.live(store, cache, request("baseline", max_new_tokens=1000), stop):
        ticks.append(tick)
        if tick.pane == METHOD and tick.events:
            stop.set()
    for pane in (METHOD, BASELINE):
        events = [e for t in ticks if t.pane == pane for e in t.events]
        assert events[-1].stop == "cancelled" and events[-1].new_tokens < 1000
    key = BaselineCache.key(tiny_lm, encode_prompt(tiny_lm.tokenizer, PROMPT), Sampling(), 1000)
    assert cache.get(key) is None  # a stopped run is no baseline
    assert not store.busy.locked()


def test_leaving_mid_run_cancels_the_decode_and_frees_the_device(tiny_lm):
    produced = []

    def source(should_stop):
        for event in decode.generate(tiny_lm, [1, 2, 3], "pld", max_new_tokens=900, should_stop=should_stop):
            produced.append(event)
            yield event

    worker = Worker(source, threading.Event())
    batches = worker.batches(0.01)
    next(batches)
    batches.close()  # the page went away
    assert device_free() and produced[-1].stop == "cancelled"


def test_closing_a_live_run_releases_the_model(store):
    ticks = runs.live(store, BaselineCache(), request(max_new_tokens=800), threading.Event())
    next(t for t in ticks if t.pane == METHOD and not t.status)
    assert store.busy.locked()
    ticks.close()
    assert not store.busy.locked()


def test_errors_from_the_decode_reach_the_page(store):
    with pytest.raises(SpecGUIError, match="num_draft"):
        list(runs.live(store, BaselineCache(), request(params={"num_draft": 999}), threading.Event()))
    assert not store.busy.locked()


def _recorded(method: str, step_ms: float, steps: int):
    tokens = [step(i + 1, [], [], 20 + i, ms=(0.0, step_ms, 0.0)) for i in range(steps)]
    return run(start(method), prefill(ms=step_ms - 1.0), *tokens)


def test_replay_keeps_the_recorded_pace_and_races_both_panes():
    method, baseline = _recorded("pld", 50.0, 4), _recorded("baseline", 100.0, 4)  # 0.25 s and 0.5 s of decoding
    panes = runs.assign_panes([baseline, method])
    assert panes == {METHOD: method, BASELINE: baseline}
    began = time.monotonic()
    ticks = list(runs.replay(panes, threading.Event(), speed=1.0, frame=0.05))
    assert 0.45 <= time.monotonic() - began < 1.5
    assert [e for t in ticks if t.pane == METHOD for e in t.events] == method
    assert [e for t in ticks if t.pane == BASELINE for e in t.events] == baseline
    done = [t.pane for t in ticks if any(isinstance(e, Summary) for e in t.events)]
    assert done == [METHOD, BASELINE]  # the faster run finishes first, as recorded

    began = time.monotonic()
    list(runs.replay(panes, threading.Event(), speed=4.0, frame=0.05))
    assert time.monotonic() - began < 0.4


def test_a_replay_that_cannot_keep_time_is_refused_before_it_starts():
    recorded = {METHOD: _recorded("pld", 50.0, 4)}
    runs.check_replay(recorded, 0.25)
    for speed in (0.0, -1.0, float("nan")):
        with pytest.raises(SpecGUIError, match="speed must be positive"):
            runs.check_replay(recorded, speed)
    with pytest.raises(SpecGUIError, match="would take 21 min at 1×"):
        runs.check_replay({METHOD: _recorded("pld", 21 * 60 * 1000 / 5, 4)}, 1.0)  # 5 forwards, 21 min
    with pytest.raises(SpecGUIError, match="not a number"):
        list(runs.replay({METHOD: _recorded("pld", float("inf"), 1)}, threading.Event()))


def test_replay_stops_when_asked():
    stop = threading.Event()
    ticks = []
    for tick in runs.replay({METHOD: _recorded("pld", 200.0, 10)}, stop, frame=0.05):
        ticks.append(tick)
        stop.set()
    assert len(ticks) == 1


def test_pane_assignment_refuses_ambiguous_trace_sets():
    method = _recorded("pld", 10.0, 1)
    assert runs.assign_panes([method]) == {METHOD: method}
    with pytest.raises(SpecGUIError, match="baseline"):
        runs.assign_panes([method, method])
    with pytest.raises(SpecGUIError, match="one trace"):
        runs.assign_panes([method] * 3)


def test_model_store_loads_once_per_name_and_replaces(tiny_lm):
    loads = []
    store = ModelStore(loader=lambda spec: loads.append(spec.name) or tiny_lm, check=lambda spec: None)
    store.get("tiny-llama")
    store.get(" tiny-llama ")
    store.get("")  # empty means the embedded model
    assert loads == ["tiny-llama", "embedded"]


def test_baseline_cache_keeps_finished_runs_only_and_evicts_the_oldest(tiny_lm):
    cache = BaselineCache(size=2)
    finished = _recorded("baseline", 10.0, 1)
    stopped = run(start("baseline"), prefill(), step(1, [], [], 5), stop="cancelled")
    keys = [BaselineCache.key(tiny_lm, [i], Sampling(), 8) for i in range(3)]
    cache.put(keys[0], stopped)
    assert cache.get(keys[0]) is None
    for key in keys:
        cache.put(key, finished)
    assert cache.get(keys[0]) is None and cache.get(keys[2])[0] == finished
    assert BaselineCache.key(tiny_lm, [1], Sampling(temperature=0.5, seed=1), 8) != keys[1]


def test_stop_flags_are_per_session():
    flags = StopFlags()
    mine, theirs = flags.fresh("me"), flags.fresh("them")
    assert flags.stop("me") and mine.is_set() and not theirs.is_set()
    assert not flags.stop("nobody")


def test_a_stale_saved_profile_prices_the_run_with_a_notice_and_is_measured_again_after_it(tmp_path, monkeypatch):
    """A profile another CPU (8x slower) saved in a shared cache folder: the run is not held up, it is priced by
    that profile and says so; once the run is over the profile is measured again on this machine."""
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path / "here"))
    honest = costs.profile_for(tiny_model(seed=21), fast_path=False)
    foreign = json.loads(Path(honest.path).read_text())
    foreign.update(step=honest.step * 8, measured_at=1.0, forward=[[ms * 8 for ms in row] for row in honest.forward])
    saved = tmp_path / "shared" / "profiles" / Path(honest.path).name
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps(foreign))
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path / "shared"))
    lm = tiny_model(seed=22)  # a runner this process holds no profile for
    store = ModelStore(loader=lambda spec: lm, check=lambda spec: None)

    ticks = list(runs.live(store, BaselineCache(), request(), threading.Event()))
    notices = [t for t in ticks if "no longer holds" in t.status]
    assert len(notices) == 1 and notices[0].note == notices[0].status and "measured 1970-01-01" in notices[0].status
    starts = [e for t in ticks for e in t.events if isinstance(e, Start)]
    assert [s.costs["step"] for s in starts] == [honest.step * 8] * 2  # both panes priced by it: not held up
    assert ticks.index(notices[0]) < ticks.index(next(t for t in ticks if t.events))  # said before the run
    assert ticks[-1].status.startswith("measuring the cost profile again")
    again = json.loads(saved.read_text())
    assert again["measured_at"] > 1.0 and again["step"] != honest.step * 8  # replaced on disk
    assert costs.profile_for(lm, fast_path=False).measured_at == again["measured_at"]  # and held for the next run
    assert device_free() and not store.busy.locked()


def test_a_live_run_hands_over_nothing_while_its_prompt_forward_runs():
    """The page draws no frame during a prompt forward (`prefills`): its first batch holds the Prefill, even when
    the Start came many frames earlier (side by side, both Prefills); the API's batches (without it) hand the Start
    over on its own."""
    def source(should_stop):
        yield start()
        time.sleep(0.2)  # a prompt forward twenty frames long
        yield prefill()

    first = next(Worker(source, threading.Event()).batches(0.01, prefills=1))
    assert [type(e).__name__ for e in first] == ["Start", "Prefill"]
    assert [type(e).__name__ for e in next(Worker(source, threading.Event()).batches(0.01))] == ["Start"]
    first = next(Worker(runs.side_by_side(source, source), threading.Event()).batches(0.01, prefills=2))
    assert [(pane, type(e).__name__) for pane, e in first] == [(METHOD, "Start"), (METHOD, "Prefill"),
                                                               (BASELINE, "Start"), (BASELINE, "Prefill")]


def test_side_by_side_runs_a_step_of_each_in_turn_and_times_neither_with_the_other(tiny_lm):
    """The run behind in tokens goes next (the method on a tie), both prompt forwards first; each run's tokens are its
    own decode's, and its clock leaves out the other's work (here a baseline that spends 40 ms before each step's
    event: a second in all, none of it in the method's time)."""
    ids = encode_prompt(tiny_lm.tokenizer, PROMPT)
    req = request(max_new_tokens=24)
    baseline = runs.decode_source(tiny_lm, ids, "baseline", req)

    def busy_baseline(should_stop):
        for event in baseline(should_stop):
            if isinstance(event, Step):
                time.sleep(0.04)
            yield event

    items = list(runs.side_by_side(runs.decode_source(tiny_lm, ids, "pld", req), busy_baseline)(lambda: False))
    kinds = [(pane, type(e).__name__) for pane, e in items]
    assert kinds[:4] == [(METHOD, "Start"), (METHOD, "Prefill"), (BASELINE, "Start"), (BASELINE, "Prefill")]
    made = {METHOD: 1, BASELINE: 1}
    for pane, event in items[4:]:
        if isinstance(event, Step):
            other = BASELINE if pane == METHOD else METHOD
            assert made[pane] < made[other] or (made[pane] == made[other] and pane == METHOD)  # it was behind
            made[pane] += len(event.emitted)
    method = [e for pane, e in items if pane == METHOD]
    assert shape(method) == shape(decode.run(tiny_lm, ids, "pld", max_new_tokens=24).events)
    assert shape([e for pane, e in items if pane == BASELINE]) == shape(
        decode.run(tiny_lm, ids, "baseline", max_new_tokens=24).events)
    assert method[-1].wall_s < 0.5  # the baseline's second is not the method's

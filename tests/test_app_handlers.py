"""The page's handlers (App.run / replay / generate_api) on the tiny model: every bad input is one line in the
status (or one gr.Error for the API) and the next run still works; the deployment policy; Stop; memory over
many runs; hostile trace text stays text; ZeroGPU wiring (a stand-in `spaces` package, in a subprocess)."""

import gc
import html
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import gradio as gr
import psutil
import pytest
from transformers import GPT2Config
from ui_helpers import holding, prefill, run, shown, slowed, start, step

from helpers import needs_inductor
from specgui.core.events import MAX_TRACE_BYTES, Summary, dumps_trace, load_trace, save_trace
from specgui.ui import page as page_module
from specgui.ui.page import KEEP_TRACES, App, trace_name
from specgui.ui.runs import ModelStore
from specgui.ui.view import RunView

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "abcdeabcdeabcdeabcd"  # the tiny model's letter tokenizer; repeats give prompt lookup matches
MODEL = "tiny-llama"
HOSTILE = ("<script>alert(1)</script>", "<img src=x onerror=alert(1)>")
POLICY = ("SPECGUI_DEFAULT_MODEL", "SPECGUI_ALLOWED_MODELS", "SPECGUI_PUBLIC")
# Measured: the first 25 runs after warm-up grow RSS by 5-13 MB (allocator pools), the next 25 by 0-0.2 MB.
RSS_BOUND_MB = 30
RSS_PLATEAU_MB = 6


@pytest.fixture(scope="module")
def app(tiny_lm):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECGUI_DEFAULT_MODEL", MODEL)
        page = App(holding(tiny_lm))  # the real loader for any other name: named models really load (or fail to)
        page.build()
        yield page


@pytest.fixture(autouse=True)
def private_deployment(app, tiny_lm, monkeypatch):
    """Each test starts on a private deployment serving the tiny model (a load that fails late drops it)."""
    for name in POLICY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECGUI_DEFAULT_MODEL", MODEL)
    app.store.get(MODEL)


def page_run(app: App, prompt: str = PROMPT, *, model: str = MODEL, method: str = "pld", max_new=16,
             mode: str = "greedy", temperature=0.7, params: dict | None = None, repeats=1, reuse: bool = False,
             speed=8.0, fast_path="auto", compile="auto"):
    """The Run button's handler (a generator of updates) with the page's other inputs at their defaults."""
    values = app.panel.presets(MODEL, app.device)
    for i, key in enumerate(app.panel.keys):
        if key[0] == method and key[1] in (params or {}):
            values[i] = params[key[1]]
    return app.run(model, method, mode, temperature, 1.0, None, max_new, None, prompt, repeats, reuse, speed,
                   fast_path, compile, *values)


def run_page(app: App, prompt: str = PROMPT, **kw) -> list[dict]:
    return list(page_run(app, prompt, **kw))


def error_line(app: App, updates: list[dict]) -> str:
    """The page's last status must be one error line (no traceback); returns its text."""
    status = updates[-1][app.status]
    assert "sg-status-error" in status and "Traceback" not in status and "\n" not in status, status
    return html.unescape(status)


def assert_still_serves(app: App) -> None:
    final = shown(run_page(app))
    assert final[app.status].endswith("done</div>") and "identical to baseline" in final[app.speedup]


def api_error(app: App, *args) -> str:
    with pytest.raises(gr.Error) as caught:
        list(app.generate_api(*args))
    message = str(caught.value.message)
    assert "Traceback" not in message and "\n" not in message
    return message


# -- input checks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", "   \n\t "])
def test_empty_prompt(app, prompt):
    assert "prompt is empty" in error_line(app, run_page(app, prompt))
    assert "prompt is empty" in api_error(app, prompt, "pld", 8, 0.0)


def test_prompt_longer_than_the_context(app):
    long = "abcde" * 220  # 1100 tokens; the tiny model's context is 1024
    assert "context holds 1024" in error_line(app, run_page(app, long))
    assert "context holds 1024" in api_error(app, long, "pld", 8, 0.0)
    assert_still_serves(app)


def test_a_budget_past_the_context_is_cut_and_the_page_says_so(app):
    prompt = "abcde" * 200  # 1000 tokens: 24 fit
    final = shown(run_page(app, prompt, max_new=1000))
    assert "max new tokens cut to 24 to fit the model's context of 1024 tokens" in html.unescape(final[app.status])
    assert final[app.status].startswith('<div class="sg-status sg-status-info">done')
    assert final[app.views]["method"].summary.new_tokens == 24
    events = list(app.generate_api(prompt, "pld", 1000, 0.0))
    assert events[0]["max_new_tokens"] == 24 and events[-1]["new_tokens"] == 24


@pytest.mark.parametrize("value, message", [(0, "at least 1"), (-5, "at least 1"), (float("nan"), "finite"),
                                            ("lots", "must be a number"), (None, "must be a number")])
def test_max_new_tokens_out_of_range(app, value, message):
    assert message in error_line(app, run_page(app, max_new=value))
    assert message in api_error(app, PROMPT, "pld", value, 0.0)


def test_an_absurd_budget_is_capped_with_a_notice(app):
    updates = run_page(app, "abcde", max_new=10**12)  # cap 1024 fits the tiny context after 5 prompt tokens
    assert "max new tokens capped at 1024 in the app" in updates[0][app.status]
    assert "max new tokens capped at 1024 in the app" in updates[-1][app.status]
    assert shown(updates)[app.views]["method"].start.max_new_tokens == 1019  # and cut to the context


@pytest.mark.parametrize("params, message", [({"num_draft": 0}, "num_draft must be >= 1"),
                                             ({"num_draft": 10**6}, "num_draft must be <= 64"),
                                             ({"max_ngram": -1}, "max_ngram must be >= 1"),
                                             ({"num_draft": 2.5}, "num_draft must be int")])
def test_method_parameters_out_of_range(app, params, message):
    assert message in error_line(app, run_page(app, params=params))


def test_a_float_parameter_must_be_finite(app):
    """NaN passes every range comparison: refused by name before a method divides or indexes by it."""
    assert "det must be a finite number, got nan" in error_line(app, run_page(app, method="clasp",
                                                                             params={"det": float("nan")}))
    assert_still_serves(app)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(app):
    """A 10 MB prompt once took 6 s and 1.6 GB to tokenize, only for the context check to refuse it."""
    huge = "word " * 400_000  # 2 million characters
    assert "the prompt has 2,000,000 characters, more than the 1,000,000 taken" in error_line(app, run_page(app, huge))
    assert "more than the 1,000,000 taken" in api_error(app, huge, "pld", 8, 0.0)


def test_unknown_method_and_bad_sampling(app):
    assert "unknown method" in error_line(app, run_page(app, method="nope"))
    assert "unknown method" in api_error(app, PROMPT, "nope", 8, 0.0)
    assert "temperature above 0" in error_line(app, run_page(app, mode="sampling", temperature=0))
    assert "temperature must be a number" in error_line(app, run_page(app, mode="sampling", temperature="hot"))
    assert "temperature must be >= 0" in api_error(app, PROMPT, "pld", 8, -1.0)


def test_models_that_cannot_load(app, tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "hub is unreachable" in error_line(app, run_page(app, model="nobody/no-such-model"))
    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path)
    assert "is a 'gpt2'; SpecGUI runs Llama-family" in error_line(app, run_page(app, model=str(tmp_path)))
    assert "no such model directory" in error_line(app, run_page(app, model="/no/such/model"))
    assert app.store.current is tiny_lm  # each name failed its config check: the held model was kept
    assert_still_serves(app)

    tiny_lm.model.save_pretrained(tmp_path / "no-tokenizer")  # a good config whose load fails later
    assert "cannot load" in error_line(app, run_page(app, model=str(tmp_path / "no-tokenizer")))
    app.store.get(MODEL)  # the held model was freed before the weights loaded
    assert_still_serves(app)


# -- deployment policy --------------------------------------------------------------------------------------


def test_the_default_model_comes_from_the_deployment(app):
    assert app.default_model == MODEL and app.model.value == MODEL
    assert run_page(app, model="  ")[-1][app.status].endswith("done</div>")  # a blank field means the default


def test_a_public_deployment_serves_only_its_models_and_uploaded_traces(app, tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGUI_PUBLIC", "1")
    for name in ("/etc", str(tmp_path), "../models/x", "some/other-model", "embedded"):
        assert "only serves tiny-llama" in error_line(app, run_page(app, model=name))
    assert_still_serves(app)

    trace = tmp_path / "t.json"
    save_trace(run(start(), prefill(), step(1, [11], [0], 12)), trace)
    assert "only uploaded trace files" in error_line(app, list(app.replay([str(trace)], 8.0)))
    upload = Path(gr.utils.get_upload_folder()) / "specgui-test" / "t.json"
    upload.parent.mkdir(parents=True, exist_ok=True)
    upload.write_text(trace.read_text())
    assert "done · replay" in list(app.replay([str(upload)], 8.0))[-1][app.status]

    specs = []
    store = ModelStore(loader=lambda spec: specs.append(spec) or tiny_lm, check=lambda spec: None)
    App(store).store.get(MODEL)
    assert [s.trust_remote_code for s in specs] == [False]  # a visitor never turns remote code on


def test_every_model_event_shares_one_queue_slot(app):
    demo = app.build().queue(**page_module.queue_options())
    fns = {fn.api_name: fn for fn in demo.fns.values() if fn.api_name}
    for name in ("page_run", "page_race", "page_replay", "page_compare", "generate", "compare"):
        assert (fns[name].concurrency_id, fns[name].concurrency_limit) == ("model", 1), name
    for name in ("page_run", "page_race", "page_replay"):  # the status line shows "queue: i/n" while waiting
        assert fns[name].show_progress != "hidden" and fns[name].show_progress_on == [app.status]
    assert not fns["page_stop"].queue


def test_the_api_page_lists_only_generate_compare_and_replay_with_named_parameters(app):
    info = app.build().get_api_info()
    named = {name: [p["parameter_name"] for p in endpoint["parameters"]]
             for name, endpoint in info["named_endpoints"].items()}
    assert named == {"/generate": ["prompt", "method", "max_new_tokens", "temperature", "model"],
                     "/compare": ["methods", "category", "prompts_per_category", "max_new_tokens", "repeats", "preset"],
                     "/replay": ["trace", "speed"], "/preset": ["preset"]}
    assert list(named) == ["/generate", "/compare", "/replay", "/preset"] and not info["unnamed_endpoints"]


# -- the verdict, the race, repeats ---------------------------------------------------------------------------


def test_a_run_shows_the_verdict_then_races_both_runs_at_their_recorded_pace(app):
    updates = run_page(app, speed=1.0)
    statuses = [html.unescape(u[app.status]) for u in updates if app.status in u]
    verdict = next(i for i, u in enumerate(updates) if app.speedup in u and "sg-speedup-figure" in u[app.speedup]
                   and "×</span>" in u[app.speedup])
    race = [i for i, u in enumerate(updates) if i > verdict and app.c_race in u]
    assert len(race) >= 2
    assert any(s.startswith('<div class="sg-status sg-status-busy">the race at 1×') for s in statuses)
    assert statuses[-1].endswith("done</div>") and all("done" not in s for s in statuses[:-1])
    replayed = [u[app.m_stats] for u in updates[verdict + 1:] if app.m_stats in u]
    assert "waiting" in replayed[0] and "<b>16</b> tokens" in replayed[-1]  # the panes filled again
    final = shown(updates)
    assert "break-even tau" in final[app.speedup] and "one run: no noise range" in final[app.speedup]
    assert "baseline: fresh run" in final[app.speedup]


def test_repeats_show_the_median_and_range_and_the_race_shows_the_median_pair(app):
    final = shown(run_page(app, repeats=3))
    assert "median of 3 runs in turn" in final[app.speedup] and "range " in final[app.speedup]
    assert "The median run: " in final[app.speedup]
    pair = final[app.views]
    figure = final[app.speedup].split('sg-speedup-figure">')[1].split("×")[0]
    assert float(figure) > 0 and pair["method"].done and pair["baseline"].done


def test_a_cached_baseline_only_when_asked_and_labelled_with_its_age(app):
    assert "baseline: fresh run" in shown(run_page(app))[app.speedup]
    final = shown(run_page(app, reuse=True))
    assert "baseline: cached run, recorded" in final[app.speedup] and " s ago" in final[app.speedup]
    assert "cached run, recorded" in final[app.b_stats]


def test_the_race_replays_again_on_request_and_refuses_before_a_run(app):
    assert "nothing to replay yet" in error_line(app, list(app.race_again(None, 1.0)))
    assert "replay speed must be positive" in error_line(app, list(app.race_again(shown(run_page(app))[app.views], 0)))
    pair = shown(run_page(app))[app.views]
    updates = list(app.race_again(pair, 0.5))
    assert "the race at 0.5×" in updates[0][app.status] and updates[-1][app.status].endswith("done</div>")
    assert app.speedup not in shown(updates)  # the verdict stays as it was


def test_bad_repeats_and_race_speeds_are_one_line(app):
    assert "repeats must be a whole number from 1 to 5" in error_line(app, run_page(app, repeats=9))
    assert "repeats must be a whole number" in error_line(app, run_page(app, repeats=1.5))
    assert "replay speed must be a number" in error_line(app, run_page(app, speed="fast"))


def test_the_fast_path_setting_applies_to_both_runs_and_is_checked(app):
    pair = shown(run_page(app, fast_path="on"))[app.views]  # on a CPU too: the same buffers, called directly
    assert pair["method"].start.fast_path and pair["baseline"].start.fast_path
    assert pair["method"].summary.token_ids == pair["baseline"].summary.token_ids
    off = shown(run_page(app, fast_path="off"))[app.views]
    assert not off["method"].start.fast_path and off["method"].summary.token_ids == pair["method"].summary.token_ids
    assert "fast path must be one of auto, on, off" in error_line(app, run_page(app, fast_path="fastest"))


@needs_inductor
def test_the_compile_setting_applies_to_both_runs_and_is_checked(app):
    """*Compile* on a CPU too (where auto leaves it off): both runs' programs compiled, the tokens as without."""
    pair = shown(run_page(app, fast_path="on", compile="on"))[app.views]
    assert pair["method"].start.compiled and pair["baseline"].start.compiled
    plain = shown(run_page(app, fast_path="on", compile="off"))[app.views]
    assert not plain["method"].start.compiled and not plain["baseline"].start.compiled
    assert pair["method"].summary.token_ids == plain["method"].summary.token_ids == pair["baseline"].summary.token_ids
    assert "compile must be one of auto, on, off" in error_line(app, run_page(app, compile="always"))
    assert "compiled programs run on the fast path" in error_line(app, run_page(app, fast_path="off", compile="on"))


def test_downloaded_traces_are_named_by_method_prompt_and_time(app):
    final = shown(run_page(app, "Summarise: the report, in brief!"))
    names = [Path(p).name for p in final[app.trace_out]]
    assert [n.split("_")[:2] for n in names] == [["pld", "summarise-the-report-in-brief"],
                                                 ["baseline", "summarise-the-report-in-brief"]]
    assert names[0].split("_", 2)[2] == names[1].split("_", 2)[2]  # the same time stamp
    assert [load_trace(p)[0].method for p in final[app.trace_out]] == ["pld", "baseline"]
    noise = RunView()
    noise.extend(load_trace(final[app.trace_out][1]))
    assert trace_name(noise, "method", 0.0).startswith("noise-check_summarise")


# -- the documented API ---------------------------------------------------------------------------------------


def test_replay_api_streams_a_trace_at_its_recorded_pace(app, tmp_path):
    events = run(start(), prefill(), step(1, [11, 12], [0], 13), step(2, [14], [0], 15))
    streamed = list(app.replay_api(dumps_trace(events), 8.0))
    assert [e["type"] for e in streamed] == ["start", "prefill", "step", "step", "summary"]
    assert streamed[-1]["new_tokens"] == events[-1].new_tokens and isinstance(events[-1], Summary)
    for bad, message in (("{", "not valid JSON"), (None, "text of a trace file")):
        with pytest.raises(gr.Error, match=message):
            list(app.replay_api(bad, 1.0))
    with pytest.raises(gr.Error, match="must be positive"):
        list(app.replay_api(dumps_trace(events), -1))


@pytest.mark.parametrize("args, message", [
    (("pld", "qa", 1, 8, 1), "methods must be a list"),
    ((["pld"], "poetry", 1, 8, 1), "no prompts in category 'poetry'"),
    ((["pld"], "qa", 0, 8, 1), "prompts per category must be a whole number from 1 to 8"),
    ((["pld"], "qa", 1, 8, 6), "repeats must be a whole number from 1 to 5"),
    ((["nope"], "qa", 1, 8, 1), "unknown method"),
])
def test_compare_api_refuses_bad_input_in_one_line(app, args, message):
    with pytest.raises(gr.Error, match=message):
        app.compare_api(*args)
    assert app.store.busy.acquire(blocking=False)
    app.store.busy.release()


def test_a_public_deployment_compares_methods_by_name_within_a_token_budget(app, monkeypatch):
    """Each suite holds the one device until it ends: on a public server a visitor's is bounded, and method settings
    (METHOD+KEY=VALUE, which reach every parameter, dv's search included) are not taken."""
    monkeypatch.setenv("SPECGUI_PUBLIC", "1")
    with pytest.raises(gr.Error, match=r"methods by name only, without METHOD\+KEY=VALUE"):
        app.compare_api(["pld+num_draft=2"], "qa", 1, 8, 1)
    with pytest.raises(gr.Error, match=r"44 prompts x 3 methods x 5 repeats x 1024 tokens is 675,840 new tokens; "
                                       r"this deployment runs at most 100,000"):
        app.compare_api(["pld", "selfdraft"], "all categories", 8, 1024, 5)


# -- traces ---------------------------------------------------------------------------------------------------


def replay_file(app: App, tmp_path: Path, text: str | bytes, name: str = "t.json") -> list[dict]:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return list(app.replay([str(path)], 8.0))


def test_malformed_traces_are_refused_in_one_line(app, tmp_path):
    good = json.loads(dumps_trace(run(start(), prefill(), step(1, [11, 12], [0], 13))))
    bad_path = json.loads(json.dumps(good))
    bad_path["events"][2]["path"] = [5]
    bad_type = json.loads(json.dumps(good))
    bad_type["events"][2]["draft_tokens"] = "os.system('x')"
    cases = [("{not json", "not valid JSON"), ("[1, 2]", "not a SpecGUI trace"),
             (json.dumps({**good, "version": 99}), "unsupported trace version"),
             (json.dumps(bad_path), "accepted path is not a path"),
             (json.dumps(bad_type), "has the wrong type"),
             (json.dumps({**good, "events": good["events"][1:]}), "begin with exactly one start")]
    for text, message in cases:
        assert message in error_line(app, replay_file(app, tmp_path, text)), message
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)  # sparse: never read
    assert "larger than 32 MiB" in error_line(app, list(app.replay([str(huge)], 1.0)))
    assert "load one trace" in error_line(app, list(app.replay([str(huge)] * 3, 1.0)))
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert "replay speed must be a number" in error_line(app, list(app.replay([str(tmp_path / "good.json")], "x")))


def test_traces_with_impossible_timings_are_refused_or_replayed_without_a_verdict(app, tmp_path):
    zero = (0.0, 0.0, 0.0)
    method = run(start("pld"), prefill(ms=0.0), step(1, [11], [0], 12, ms=zero))
    baseline = run(start("baseline"), prefill(ms=0.0), step(1, [], [], 11, ms=zero), step(2, [], [], 12, ms=zero))
    save_trace(method, tmp_path / "m.json")
    save_trace(baseline, tmp_path / "b.json")
    final = shown(list(app.replay([str(tmp_path / "m.json"), str(tmp_path / "b.json")], 8.0)))
    assert final[app.status].startswith('<div class="sg-status sg-status-info">done') and "per step" not in final[
        app.speedup]  # no time to divide: no why line, and no crash
    for text, message in ((dumps_trace(method).replace('"verify_ms": 0.0', '"verify_ms": NaN'), "not a number"),
                          (dumps_trace(method).replace('"verify_ms": 0.0', '"verify_ms": -5.0'), "negative"),
                          (dumps_trace(method).replace('"verify_ms": 0.0', '"verify_ms": 1e12'), "would take")):
        assert message in error_line(app, replay_file(app, tmp_path, text))  # refused at once, never waited out
        with pytest.raises(gr.Error, match=message):
            list(app.replay_api(text, 1.0))


def test_hostile_token_text_from_a_trace_is_shown_as_text(app, tmp_path):
    pieces = {11: HOSTILE[0], 12: HOSTILE[1], 13: "ok"}
    method = run(start("pld"), prefill(10, HOSTILE[1]), step(1, [11, 12], [0], 13, pieces=pieces))
    baseline = run(start("baseline"), prefill(10, HOSTILE[1]), step(1, [], [], 11, pieces=pieces),
                   step(2, [], [], 13, pieces=pieces))
    save_trace(method, tmp_path / "m.json")
    save_trace(baseline, tmp_path / "b.json")
    updates = list(app.replay([str(tmp_path / "m.json"), str(tmp_path / "b.json")], 8.0))
    final = {component: value for update in updates for component, value in update.items()}  # as the page ends
    shown = final[app.m_tokens] + final[app.b_tokens] + final[app.inspector] + final[app.summary]
    for text in HOSTILE:
        assert text not in shown
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in final[app.m_tokens]
    assert "&lt;img src=x onerror=alert(1)&gt;" in final[app.b_tokens]
    assert "&lt;img src=x onerror=alert(1)&gt;" in final[app.inspector]


# -- Stop, and memory -------------------------------------------------------------------------------------------


def test_stop_ends_the_run_frees_the_slot_and_the_next_run_completes(app, tiny_lm, monkeypatch):
    slowed(tiny_lm, monkeypatch)  # 1000 tokens outlast the first frame on any machine
    frames = page_run(app, method="baseline", max_new=1000)
    updates = []
    for update in frames:
        updates.append(update)
        if app.m_stats in update and "<b>0</b> tokens" not in update[app.m_stats] and "tokens" in update[app.m_stats]:
            break
    app.stop()
    final = shown(updates + list(frames))
    assert final[app.status].startswith('<div class="sg-status sg-status-info">stopped')
    stopped = final[app.views]["method"].summary
    assert stopped.stop == "cancelled" and stopped.new_tokens < 1000
    baseline = final[app.views]["baseline"].summary  # side by side (the eager path): it ran beside, and stopped too
    assert baseline is not None and baseline.stop == "cancelled" and baseline.new_tokens < 1000
    assert app.store.busy.acquire(blocking=False)  # the slot is free
    app.store.busy.release()
    assert_still_serves(app)


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def test_fifty_runs_do_not_leak(app, monkeypatch):
    # every run still races, at once: memory is what is measured here, not pace (the race's frame of 0.25 s
    # between draws was 14 s of this test's 19)
    fast = 1000.0
    monkeypatch.setattr(page_module, "RACE_FRAME_S", 0.0)
    for _ in range(5):  # warm-up: first-time allocations, the baseline cache entry, plotly's templates
        run_page(app, speed=fast)
    sizes = [rss_mb()]
    for _ in range(2):
        for i in range(25):
            final = run_page(app, method="pld" if i % 2 else "baseline", speed=fast)[-1]
            assert final[app.status].endswith("done</div>")  # after the race
        sizes.append(rss_mb())
    print(f"RSS growth over 50 runs: {sizes[2] - sizes[0]:.1f} MB (second 25: {sizes[2] - sizes[1]:.1f} MB)")
    assert sizes[2] - sizes[0] < RSS_BOUND_MB and sizes[2] - sizes[1] < RSS_PLATEAU_MB
    assert threading.active_count() < 50  # workers do not pile up threads
    assert len(list(app.trace_root.iterdir())) <= KEEP_TRACES  # nor trace files on disk


def test_an_apps_trace_folder_goes_with_it(tiny_lm):
    page = App(holding(tiny_lm))
    save_trace(run(start(), prefill()), page.trace_root / "t.json")
    root = page.trace_root
    del page
    gc.collect()
    assert not root.exists()


# -- ZeroGPU wiring ----------------------------------------------------------------------------------------------

FAKE_SPACES = '''
import inspect, sys
torch_loaded = "torch" in sys.modules or "gradio" in sys.modules
wrapped, calls = [], []

def GPU(duration=60):
    def wrap(fn):
        wrapped.append((fn.__name__, duration))
        if inspect.isgeneratorfunction(fn):
            def gen(*a, **k):
                calls.append(fn.__name__)
                yield from fn(*a, **k)
            return gen
        def call(*a, **k):
            calls.append(fn.__name__)
            return fn(*a, **k)
        return call
    return wrap
'''

ZERO_GPU_RUN = '''
import json, sys
import app  # the entry point: must import `spaces` (through specgui.model.hosting) before torch and gradio
import spaces
from helpers import tiny_model
from specgui.ui.page import App
from ui_helpers import holding
events = list(App(holding(tiny_model())).generate_api("abcdeabcde", "pld", 6, 0.0))
print(json.dumps({"torch_first": spaces.torch_loaded, "wrapped": spaces.wrapped, "calls": spaces.calls,
                  "events": events}))
'''


def test_zero_gpu_wraps_the_decode_and_is_imported_before_torch(tmp_path):
    (tmp_path / "spaces.py").write_text(FAKE_SPACES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests"), str(ROOT)]),
           "SPECGUI_DEFAULT_MODEL": MODEL}
    out = subprocess.run([sys.executable, "-c", ZERO_GPU_RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])  # json: the API's results are plain CPU data
    assert got["torch_first"] is False
    assert {name for name, _ in got["wrapped"]} >= {"gpu_decode", "run_suite"}
    assert got["calls"] == ["gpu_decode"]
    assert got["events"][0]["type"] == "start" and got["events"][-1]["new_tokens"] == 6

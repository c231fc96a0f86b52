"""The page: layout, and handlers that turn the run controller's ticks into component updates.

`App` owns the shared model (`ModelStore`), the baseline cache and the per-session stop flags; `build`
lays out the Live and Compare tabs and wires them. Every model-using event shares one concurrency
group of size 1 (and `ModelStore.busy`), so runs queue instead of sharing the device, and the status
line shows a waiting visitor's place in the queue; Stop skips the queue. A live run and a replay feed
the same `_frames`, which redraws text every frame (twice a second) and the charts every `CHART_S`
seconds and at the end.

Visitors' input is untrusted: the model they name passes `hosting.check_model_request`, numbers are
parsed and bounded here, traces are size-capped and schema-checked data (and on a public deployment
only gradio's own upload files are read). Any failure is one line in the status (or a `gr.Error` for
the API); a failure that is not a `SpecGUIError` is a bug, logged with its traceback on the server.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from specgui import ASSETS_DIR, hosting, methods, papers
from specgui.config import decoding_defaults
from specgui.errors import SpecGUIError
from specgui.events import MAX_TRACE_BYTES, load_trace, save_trace, to_json
from specgui.loading import EMBEDDED, EMBEDDED_NAME, LoadedModel, resolve_device
from specgui.prompts import load_prompts
from specgui.sampling import Sampling
from specgui.text import encode_prompt
from specgui.ui import charts, compare, controls, render, runs
from specgui.ui.runs import BASELINE, METHOD, BaselineCache, ModelStore, RunRequest, Tick, Worker
from specgui.ui.view import RunView, TokenText
from specgui.ui.view import compare as compare_views

KEEP_TRACES = 64  # runs whose trace files stay on disk (gradio serves its own copies, cleaned by delete_cache)
GRADIO_CACHE = (3600, 3600)  # delete gradio's cached files older than an hour, hourly
CHART_S = 4.0  # charts are whole-figure updates (costly in the browser): redraw this often mid-run
API_FRAME_S = 0.25  # API batches: 0.05 s cost the decode 10-13% tok/s on 2 cores (serialising), 0.25 s 1-4%
INTRO = """# SpecGUI
Self-speculative decoding, one draft → verify step at a time. The chosen method and plain `baseline`
decode the same prompt with the same settings **one after the other, never at once**; times count
decoding only (drawing the page is not counted)."""
PROGRESS = gr.Progress()  # gradio's marker default: it injects a live tracker into the handler
HIDE_REJECTED_JS = "(show) => { document.body.classList.toggle('sg-hide-rejected', !show); return show; }"
LOG = logging.getLogger("specgui.app")


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "local"


def _failure(exc: Exception) -> str:
    """The one line a visitor sees for a failed request; a non-SpecGUIError is a bug, logged in full."""
    if isinstance(exc, SpecGUIError):
        return str(exc)
    LOG.error("unexpected error in a handler", exc_info=exc)
    return f"unexpected error ({type(exc).__name__}); the details are in the server log"


def _upload_path(file: Any) -> str:
    """The path of an uploaded file; on a public deployment only files inside gradio's upload folder."""
    path = str(getattr(file, "path", None) or getattr(file, "name", None) or file)
    if hosting.is_public() and not Path(path).resolve().is_relative_to(Path(gr.utils.get_upload_folder()).resolve()):
        raise SpecGUIError("only uploaded trace files can be replayed on this deployment")
    return path


class App:
    """The SpecGUI page and its shared state (one model, one baseline cache, stop flags per session)."""

    def __init__(self, store: ModelStore | None = None) -> None:
        self.store = store or ModelStore()
        self.default_model = hosting.default_model()
        self.cache = BaselineCache()
        self.stops = runs.StopFlags()
        self.examples = {e.label: e for e in controls.examples()}
        self.device = resolve_device("auto").type
        self.defaults = decoding_defaults()
        self.trace_root = Path(tempfile.mkdtemp(prefix="specgui-traces-"))

    # -- layout ---------------------------------------------------------------------------------------

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="SpecGUI", delete_cache=GRADIO_CACHE) as demo:
            gr.Markdown(INTRO)
            with gr.Tabs():
                with gr.Tab("Live", id="live"):
                    self._live_tab()
                with gr.Tab("Compare", id="compare"):
                    self._compare_tab()
                with gr.Tab("Methods", id="methods"):
                    gr.Markdown(controls.method_help())
            gr.api(self.generate_api, api_name="generate", concurrency_id="model", concurrency_limit=1)
        return demo

    def _live_tab(self) -> None:
        names = methods.names()
        first = next((n for n in names if n != "baseline"), names[0])
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=320):
                self.model = gr.Textbox(self.default_model, label="Model", elem_id="sg-model", info=_model_help())
                self.method = gr.Dropdown(names, value=first, label="Method", elem_id="sg-method")
                with gr.Accordion("Method parameters (presets from configs/)", open=False):
                    self.panel = controls.param_panel(self._preset_model(self.default_model), self.device,
                                                      shown=first)
                with gr.Accordion("Decoding", open=True):
                    self.mode = gr.Radio(["greedy", "sampling"], value="greedy", label="Mode")
                    with gr.Group(visible=False) as sampling_box:
                        temperature = self.defaults["temperature"] or 0.7  # the YAML's 0 means greedy
                        self.temperature = gr.Slider(0.05, 2.0, value=temperature, step=0.05, label="Temperature")
                        self.top_p = gr.Slider(0.05, 1.0, value=self.defaults["top_p"], step=0.05,
                                               label="Top-p")
                        self.seed = gr.Number(None, precision=0, label="Seed (empty: random)")
                    self.max_new = gr.Slider(1, controls.max_new_tokens_cap(), step=1, elem_id="sg-max-new",
                                             value=self.defaults["max_new_tokens"], label="Max new tokens")
                self.example = gr.Dropdown(list(self.examples), value=None, label="Example from the built-in suite",
                                           elem_id="sg-example")
                self.prompt = gr.Textbox(label="Prompt", lines=4, elem_id="sg-prompt",
                                         value="Write a haiku about speculative decoding.")
                with gr.Row():
                    self.run_button = gr.Button("Run", variant="primary", elem_id="sg-run")
                    self.stop_button = gr.Button("Stop", variant="stop", elem_id="sg-stop")
                with gr.Accordion("Trace: download or replay", open=False):
                    self.trace_out = gr.File(label="This run's traces", file_count="multiple", interactive=False)
                    self.trace_in = gr.File(label="Load trace(s) to replay (a method and optionally a baseline)",
                                            file_count="multiple", file_types=[".json"], elem_id="sg-trace-in")
                    self.speed = gr.Slider(0.25, 8, value=1, step=0.25, label="Replay speed")
                    self.replay_button = gr.Button("Replay", elem_id="sg-replay")
            with gr.Column(scale=3):
                self.status = gr.HTML(render.status("Ready."), elem_id="sg-status")
                with gr.Row():
                    self.legend = gr.HTML(render.legend(), elem_id="sg-legend")
                    self.show_rejected = gr.Checkbox(True, label="show rejected drafts inline", scale=0,
                                                     min_width=240, elem_id="sg-show-rejected")
                with gr.Row(equal_height=False):
                    with gr.Column():
                        self.m_title = gr.HTML(render.pane_title(RunView(), "method"))
                        self.m_stats = gr.HTML(render.pane_stats(RunView(), running=False), elem_id="sg-method-stats")
                        self.m_tokens = gr.HTML(render.tokens(RunView()), elem_id="sg-method-tokens")
                    with gr.Column():
                        self.b_title = gr.HTML(render.pane_title(RunView(), "baseline"))
                        self.b_stats = gr.HTML(render.pane_stats(RunView(), running=False),
                                               elem_id="sg-baseline-stats")
                        self.b_tokens = gr.HTML(render.tokens(RunView(), plain=True), elem_id="sg-baseline-tokens")
                self.summary = gr.HTML("", elem_id="sg-summary")
                gr.Markdown("### Step inspector")
                self.step = gr.Slider(1, 2, value=1, step=1, label="Step", visible=False, elem_id="sg-step")
                self.inspector = gr.HTML(render.step_detail(RunView(), 0), elem_id="sg-inspector")
                with gr.Row():
                    self.c_accept = gr.Plot(charts.accepted_per_step(RunView()), show_label=False)
                    self.c_race = gr.Plot(charts.race(RunView(), RunView()), show_label=False)
                with gr.Row():
                    self.c_skip = gr.Plot(charts.skip_heatmap(RunView()), show_label=False)
                    self.c_phase = gr.Plot(charts.phase_times(RunView()), show_label=False)
        self.views = gr.State(None)

        self.method.change(self.panel.show, self.method, list(self.panel.groups.values()), queue=False)
        self.model.submit(self._presets, self.model, self.panel.components, queue=False)
        self.model.blur(self._presets, self.model, self.panel.components, queue=False)
        self.mode.change(lambda m: gr.update(visible=m == "sampling"), self.mode, sampling_box, queue=False)
        self.example.change(self._pick_example, self.example, self.prompt, queue=False)
        self.show_rejected.change(None, self.show_rejected, None, js=HIDE_REJECTED_JS, queue=False)
        inputs = [self.model, self.method, self.mode, self.temperature, self.top_p, self.seed, self.max_new,
                  self.example, self.prompt, *self.panel.components]
        queued = {"concurrency_id": "model", "concurrency_limit": 1, "show_progress": "minimal",
                  "show_progress_on": self.status}  # the status line shows "queue: i/n" while waiting
        self.run_button.click(self._run_clicked, inputs, self._outputs(), api_name="run", **queued)
        self.replay_button.click(self.replay, [self.trace_in, self.speed], self._outputs(), api_name="replay", **queued)
        self.stop_button.click(self.stop, None, None, queue=False, api_name="stop")
        self.step.change(self.inspect, [self.step, self.views], self.inspector, queue=False, show_progress="hidden")

    def _compare_tab(self) -> None:
        rows = load_prompts()
        categories = [compare.ALL, *dict.fromkeys(r.category for r in rows)]
        with gr.Row():
            self.cmp_methods = gr.CheckboxGroup([n for n in methods.names() if n != "baseline"], label="Methods",
                                                value=[n for n in methods.names() if n != "baseline"],
                                                info="baseline always runs")
            self.cmp_category = gr.Dropdown(categories, value=compare.ALL, label="Category")
            self.cmp_per = gr.Slider(1, 8, value=1, step=1, label="Prompts per category")
            self.cmp_tokens = gr.Slider(8, 256, value=48, step=8, label="Max new tokens")
            self.cmp_repeats = gr.Slider(1, 5, value=1, step=1, label="Repeats (median)")
        self.cmp_preset = gr.Dropdown([compare.NO_PRESET, *papers.names()], value=compare.NO_PRESET,
                                      label="Paper preset", info="a seed paper's comparison set, laid out as its "
                                      "table with the paper's own numbers beside ours (replaces methods and category)")
        with gr.Row():
            self.cmp_run = gr.Button("Run suite", variant="primary", elem_id="sg-cmp-run")
            self.cmp_stop = gr.Button("Stop", variant="stop")
        self.cmp_status = gr.HTML(render.status("Greedy decoding, embedded model unless the Live tab loaded another."))
        self.cmp_table = gr.Dataframe(headers=compare.COLUMNS, interactive=False, elem_id="sg-cmp-table")
        self.cmp_note = gr.HTML("")
        self.cmp_chart = gr.Plot(show_label=False)
        self.cmp_run.click(self.run_compare, [self.cmp_methods, self.cmp_category, self.cmp_per, self.cmp_tokens,
                                              self.cmp_repeats, self.cmp_preset],
                           [self.cmp_status, self.cmp_table, self.cmp_chart, self.cmp_note], concurrency_id="model",
                           concurrency_limit=1, api_name="compare")
        self.cmp_stop.click(self.stop_compare, None, None, queue=False)

    def _outputs(self) -> list[Any]:
        return [self.status, self.legend, self.m_title, self.m_stats, self.m_tokens, self.b_title, self.b_stats,
                self.b_tokens, self.summary, self.step, self.inspector, self.c_accept, self.c_race, self.c_skip,
                self.c_phase, self.views, self.trace_out]

    # -- small handlers -------------------------------------------------------------------------------

    def _preset_model(self, name: str) -> str:
        name = name.strip() or self.default_model
        return EMBEDDED_NAME if name == EMBEDDED else name.rstrip("/")

    def _checked_model(self, name: Any) -> str:
        """The model a visitor named (blank: the default), refused where this deployment does not serve it."""
        name = str(name or "").strip() or self.default_model
        hosting.check_model_request(name)
        return name

    def _loaded(self) -> LoadedModel:
        """The shared model for handlers that take no model name: the current one, else the default."""
        return self.store.current or self.store.get(self.default_model)

    def _presets(self, model: str) -> list[Any]:
        return self.panel.presets(self._preset_model(model), self.device)

    def _pick_example(self, label: str | None) -> Any:
        example = self.examples.get(label or "")
        return example.row.preview if example else gr.skip()

    def stop(self, request: gr.Request = None) -> None:
        self.stops.stop(_session(request))

    def stop_compare(self, request: gr.Request = None) -> None:
        self.stops.stop(_session(request) + "/compare")

    def inspect(self, step: float, views: dict[str, RunView] | None) -> str:
        if not views:
            return render.step_detail(RunView(), 0)
        return render.step_detail(views[METHOD], int(step) - 1, self._token_text(views[METHOD]))

    def _token_text(self, view: RunView) -> TokenText | None:
        """Token -> text while the run's model is loaded (a replay of another model's trace shows ids)."""
        lm = self.store.current
        if lm is None or view.start is None or lm.name != view.start.model:
            return None
        return lambda t: lm.tokenizer.decode([t], skip_special_tokens=False)

    # -- runs -----------------------------------------------------------------------------------------

    def _run_clicked(self, request: gr.Request, *values: Any) -> Iterator[dict]:
        # gradio hands a Request only to positional parameters, and `run` ends in *params
        yield from self.run(*values, session=_session(request))

    def run(self, model: str, method: str, mode: str, temperature: float, top_p: float, seed: float | None,
            max_new: float, example: str | None, prompt: str, *params: Any, session: str = "local") -> Iterator[dict]:
        """Live: the method, then baseline, streamed into the panes; then the summary and the traces."""
        try:
            model = self._checked_model(model)
            n, note = controls.clamp_tokens(max_new)
            overrides = self.panel.overrides(method, list(params))
            methods.params_for(method, self._preset_model(model), self.device, overrides)  # ranges, before queueing
            req = RunRequest(method=methods.get(method).name, prompt=controls.prompt_for(prompt,
                             self.examples.get(example or "")), max_new_tokens=n,
                             sampling=controls.sampling_from(mode, temperature, top_p, seed),
                             params=overrides, model=model, prompt_text=prompt)
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return
        stop = self.stops.fresh(session)
        yield from self._frames(runs.live(self.store, self.cache, req, stop), note, live=True)

    def replay(self, files: list[Any] | None, speed: float, request: gr.Request = None) -> Iterator[dict]:
        """Replay: recorded traces stream into the panes at their recorded pace (no model needed)."""
        try:
            if not files:
                raise SpecGUIError("choose one or two trace files first")
            runs.check_trace_count(len(files))
            panes = runs.assign_panes([load_trace(_upload_path(f)) for f in files])
            speed = controls.number(speed, "replay speed")
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return
        stop = self.stops.fresh(_session(request))
        start = panes[METHOD][0]
        note = f"replay of a trace recorded with {start.model} on {start.device}"
        yield from self._frames(runs.replay(panes, stop, speed), note, live=False)

    def _frames(self, ticks: Iterator[Tick], note: str, *, live: bool) -> Iterator[dict]:
        views = {METHOD: RunView(), BASELINE: RunView()}
        yield self._reset(note or ("running" if live else "replaying"))
        last_charts = time.monotonic()
        token_text: TokenText | None = None
        try:
            for tick in ticks:
                if tick.note:
                    note = " · ".join(filter(None, (note, tick.note)))
                if tick.status:
                    yield {self.status: render.status(tick.status, "busy")}
                    continue
                view = views[tick.pane]
                layers = list(view.fractal_layers)
                view.cached_at = tick.cached_at if tick.cached_at is not None else view.cached_at
                view.extend(tick.events)
                if token_text is None and live and view.start is not None:
                    token_text = self._token_text(view)
                update = self._pane(tick.pane, view)
                if tick.pane == METHOD:
                    if view.steps:
                        update[self.inspector] = render.step_detail(view, len(view.steps) - 1, token_text)
                    if view.fractal_layers != layers:
                        update[self.legend] = render.legend(view.fractal_layers)
                    if view.done or time.monotonic() - last_charts > CHART_S:
                        update.update(self._method_charts(view))
                        last_charts = time.monotonic()
                yield update
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return
        yield self._final(views, note, token_text)

    def _reset(self, note: str) -> dict:
        empty = RunView()
        return {self.status: render.status(note, "busy"), self.legend: render.legend(),
                self.m_title: render.pane_title(empty, "method"), self.m_stats: render.pane_stats(empty, running=True),
                self.m_tokens: render.tokens(empty), self.b_title: render.pane_title(empty, "baseline"),
                self.b_stats: render.pane_stats(empty, running=True), self.b_tokens: render.tokens(empty, plain=True),
                self.summary: "", self.step: gr.update(visible=False), self.trace_out: None}

    def _pane(self, pane: str, view: RunView) -> dict:
        stats = render.pane_stats(view, running=True)
        if pane == METHOD:
            return {self.m_title: render.pane_title(view, "method"), self.m_stats: stats,
                    self.m_tokens: render.tokens(view)}
        return {self.b_title: render.pane_title(view, "baseline"), self.b_stats: stats,
                self.b_tokens: render.tokens(view, plain=True)}

    def _method_charts(self, view: RunView) -> dict:
        return {self.c_accept: charts.accepted_per_step(view), self.c_skip: charts.skip_heatmap(view),
                self.c_phase: charts.phase_times(view)}

    def _final(self, views: dict[str, RunView], note: str, token_text: TokenText | None) -> dict:
        method, baseline = views[METHOD], views[BASELINE]
        update = {**self._method_charts(method), self.c_race: charts.race(method, baseline), self.views: views,
                  self.m_stats: render.pane_stats(method, running=False),
                  self.b_stats: render.pane_stats(baseline, running=False)}
        if method.steps:
            last = len(method.steps)
            update[self.step] = gr.update(minimum=1, maximum=max(2, last), value=last, visible=True)
            update[self.inspector] = render.step_detail(method, last - 1, token_text)
        if method.done and baseline.done:
            update[self.summary] = render.summary(method, baseline, compare_views(method, baseline))
        stopped = not method.done or method.summary.stop == "cancelled" or (baseline.start is not None
                                                                              and not baseline.done)
        update[self.status] = render.status(("stopped" if stopped else "done") + (f" · {note}" if note else ""))
        update[self.trace_out] = self._save_traces(views) or None
        return update

    def _save_traces(self, views: dict[str, RunView]) -> list[str]:
        """Each pane's events as a core trace file: trace-<pane>-<method>.json (the oldest runs' are deleted)."""
        for old in sorted(self.trace_root.iterdir(), key=lambda d: d.stat().st_mtime)[:-KEEP_TRACES + 1]:
            shutil.rmtree(old, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(dir=self.trace_root))
        paths = []
        for pane, view in views.items():
            if view.start is not None:
                path = folder / f"trace-{pane}-{view.method}.json"
                save_trace(view.events, path)
                paths.append(str(path))
        return paths

    # -- compare tab ----------------------------------------------------------------------------------

    def run_compare(self, names: list[str], category: str, per_category: float, max_new: float, repeats: float,
                    preset: str = compare.NO_PRESET, request: gr.Request = None,
                    progress: gr.Progress = PROGRESS) -> tuple:
        stop = self.stops.fresh(_session(request) + "/compare")
        try:
            rows, names, paper = compare.choose(load_prompts(), list(names or []), category, int(per_category),
                                                preset)
            lm = self._loaded()
            counts: queue.SimpleQueue = queue.SimpleQueue()  # (done, total) from the device thread
            with self.store.busy:
                job = runs.DEVICE.submit(contextvars.copy_context().run, compare.run_suite, lm, rows,
                                         names, max_new_tokens=int(max_new), repeats=int(repeats),
                                         sampling=Sampling(), stop=stop,
                                         progress=lambda done, total: counts.put((done, total)))
                while not job.done():
                    with contextlib.suppress(queue.Empty):
                        progress(counts.get(timeout=0.2), desc="runs", unit="runs")
                report = job.result()
        except compare.Stopped:
            return render.status("stopped"), gr.skip(), gr.skip(), gr.skip()
        except Exception as exc:
            return render.status(_failure(exc), "error"), gr.skip(), gr.skip(), gr.skip()
        message = (f"{len(rows)} prompts × {len(report['methods'])} methods on {report['model']} ({report['device']}), "
                   f"max {report['max_new_tokens']} new tokens, median of {report['repeats']}")
        note = render.status(papers.caption(report, paper)) if paper else ""
        return (render.status(message), compare.result_table(report, paper), charts.compare_chart(report), note)

    # -- API ------------------------------------------------------------------------------------------

    def generate_api(self, prompt: str, method: str = "pld", max_new_tokens: int = 64,
                     temperature: float = 0.0) -> Iterator[dict]:
        """Stream one generation as JSON events: start, prefill, one per draft -> verify step, summary."""
        try:
            method = methods.get(str(method)).name
            n, _ = controls.clamp_tokens(max_new_tokens)
            sampling = Sampling(temperature=controls.number(temperature, "temperature"))
            if not isinstance(prompt, str):
                raise SpecGUIError("the prompt must be text")
            lm = self._loaded()
            ids = encode_prompt(lm.tokenizer, prompt)
            n, _ = runs.fit_context(lm, ids, n)  # the start event states the budget that ran
        except Exception as exc:
            raise gr.Error(_failure(exc)) from None
        request = RunRequest(method=method, prompt=prompt, max_new_tokens=n, sampling=sampling, prompt_text=prompt)
        with self.store.busy:
            worker = Worker(runs.decode_source(lm, ids, method, request), threading.Event())
            try:
                for batch in worker.batches(API_FRAME_S):
                    yield from (to_json(event) for event in batch)
            except Exception as exc:
                raise gr.Error(_failure(exc)) from None


def _model_help() -> str:
    if hosting.is_public():
        return "this deployment serves: " + ", ".join(hosting.allowed_models())
    return "'embedded' (SmolLM2-135M-Instruct), a hub id or a local directory"


def launch_options() -> dict[str, Any]:
    """Theme and stylesheet for `launch` (gradio 6 takes them there): local fonts, no CDN; uploads are
    refused above the trace size cap before they reach a handler."""
    return {"css_paths": [ASSETS_DIR / "app.css"], "theme": gr.themes.Default(), "max_file_size": MAX_TRACE_BYTES}

"""The page: layout, and handlers that turn the run controller's ticks into component updates.

`App` owns the shared model (`ModelStore`), the baseline cache and the per-session stop flags; `build`
lays out the Live and Compare tabs and wires them. Every model-using event shares one concurrency
group of size 1 (and `ModelStore.busy`), so runs queue instead of sharing the device, and the status
line shows a waiting visitor's place in the queue; Stop skips the queue. A live run redraws the panes
every frame (twice a second) but none while a run's prompt forward runs (`Worker.batches`), and the charts
only with the verdict (a chart is a whole figure, costly in the browser on the cores the method decodes on,
which plain decoding's run never paid for); once both runs are measured, the race replays them side by side
at their recorded pace (`_race`), which is also how a trace file replays.
The race is in the same queue group: it decodes nothing, but its frames would cost another visitor's
decode CPU time.

One layout serves two views: the full page, and the stage view (`/?view=stage`, or the Stage view box)
that fits a projector: a class on <html> hides all but the preset picker, Run, the panes, the speedup and
the race (assets/app.css). Stable element ids for tests and stage styling: `run`, `pane-method`,
`pane-baseline`, `speedup`, `race`.

Visitors' input is untrusted: the model they name passes `hosting.check_model_request`, numbers are
parsed and bounded here, traces are size-capped and schema-checked data (and on a public deployment
only gradio's own upload files are read). Any failure is one line in the status (or a `gr.Error` for
the API); a failure that is not a `SpecGUIError` is a bug, logged with its traceback on the server.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import queue
import re
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Generator, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import gradio as gr

from specgui import ASSETS_DIR, fastpath, methods
from specgui.core.events import MAX_TRACE_BYTES, Event, load_trace, loads_trace, save_trace, to_json
from specgui.core.sampling import Sampling
from specgui.core.text import encode_prompt
from specgui.cpu import kernels
from specgui.errors import SpecGUIError
from specgui.fastpath import compiled
from specgui.methods.presets import decoding_defaults
from specgui.model import hosting
from specgui.model.loading import EMBEDDED, EMBEDDED_NAME, LoadedModel, resolve_device
from specgui.tools import papers
from specgui.tools.prompts import load_prompts
from specgui.ui import charts, compare, controls, diffs, render, runs, warmup
from specgui.ui.runs import BASELINE, METHOD, BaselineCache, ModelStore, RunRequest, Tick, Worker
from specgui.ui.view import RunView, TokenText, comparable, median_index, spread, why
from specgui.ui.view import compare as compare_views

KEEP_TRACES = 64  # runs whose trace files stay on disk (gradio serves its own copies, cleaned by delete_cache)
GRADIO_CACHE = (3600, 3600)  # delete gradio's cached files older than an hour, hourly
STARTUP_S = 1.0  # the start line's redraw while the calibration runs
RACE_FRAME_S = 0.25  # the race decodes nothing, so it can draw more often than a live run
API_FRAME_S = 0.25  # API batches: 0.05 s cost the decode 10-13% tok/s on 2 cores (serialising), 0.25 s 1-4%
MAX_REPEATS = 5
# a public deployment's suites: at most this many new tokens in all (prompts x methods with baseline x repeats x
# tokens; ~30 minutes of a 2-core CPU Space), and methods by name only: the longest, 44 prompts x 9 methods x 5
# repeats x 1024 tokens, held the one device for ~19 hours, and METHOD+KEY=VALUE entries made it unbounded
PUBLIC_SUITE_TOKENS = 100_000
QUEUE_SIZE = 64  # requests waiting for the device; more are refused at once (gradio's queue `max_size`)
RACE_SPEEDS = [("1×", 1.0), ("0.5×", 0.5), ("0.25×", 0.25)]
INTRO = """# SpecGUI
Self-speculative decoding, one draft → verify step at a time. Pick a preset and press **Run**: the method and
plain `baseline` decode the same prompt **a step of each in turn, never at once**, then race side by side at
their recorded pace. Times count decoding only (drawing the page is not counted)."""
STAGE_CLASS = "sg-stage"
# In <head>, so the stage layout is there from the first paint; the box then mirrors it (STAGE_LOAD_JS).
STAGE_HEAD = (f"<script>if (new URLSearchParams(location.search).get('view') === 'stage') "
              f"document.documentElement.classList.add('{STAGE_CLASS}');</script>")
STAGE_LOAD_JS = "() => new URLSearchParams(location.search).get('view') === 'stage'"
STAGE_TOGGLE_JS = f"""(on) => {{
  document.documentElement.classList.toggle('{STAGE_CLASS}', on);
  const url = new URL(location.href);
  if (on) url.searchParams.set('view', 'stage'); else url.searchParams.delete('view');
  history.replaceState(null, '', url);
}}"""
# A run is sent once the browser has a whole idle frame (or after IDLE_WAIT_MS): pressed while the page still drew
# itself (its charts, as it loads), the method's prompt forward, which runs first, shared the machine's cores with that
# drawing and took 2-3x plain decoding's (3548 against 1562 ms, AMD EPYC 2 cores), so the first race read 1.28x
# against 1.49x predicted. The inputs go on unchanged.
IDLE_WAIT_MS = 5000
SETTLED_JS = f"""async (...inputs) => {{
  if (window.requestIdleCallback) await new Promise((done) => {{
    const until = Date.now() + {IDLE_WAIT_MS};
    const check = (idle) => (idle.timeRemaining() >= 40 || Date.now() > until) ? done()
      : requestIdleCallback(check, {{timeout: 500}});
    requestIdleCallback(check, {{timeout: 500}});
  }});
  return inputs;
}}"""
NOISE_CHECK = "baseline (noise check: plain decoding against itself)"
PROGRESS = gr.Progress()  # gradio's marker default: it injects a live tracker into the handler
HIDE_REJECTED_JS = "(show) => { document.body.classList.toggle('sg-hide-rejected', !show); return show; }"
LOG = logging.getLogger("specgui.app")
Pair = dict[str, RunView]  # one method run and the baseline run it is compared with, by pane


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
    if "\0" in path:
        raise SpecGUIError("a file path cannot hold a NUL character")
    if hosting.is_public() and not Path(path).resolve().is_relative_to(Path(gr.utils.get_upload_folder()).resolve()):
        raise SpecGUIError("only uploaded trace files can be replayed on this deployment")
    return path


def _whole(value: Any, what: str, low: int, high: int) -> int:
    """An integer setting from a widget or an API caller, within [low, high], or a one-line error."""
    x = controls.number(value, what)
    if not x.is_integer() or not low <= x <= high:
        raise SpecGUIError(f"{what} must be a whole number from {low} to {high}, got {str(value)[:40]}")
    return int(x)


def _speed(value: Any) -> float:
    speed = controls.number(value, "replay speed")
    if speed <= 0:
        raise SpecGUIError(f"replay speed must be positive, got {speed:g}")
    return speed


def trace_name(view: RunView, pane: str, stamp: float) -> str:
    """A downloaded trace's file name: method, the prompt's first words and the time, e.g.
    'pld_summarise-the-report_2025-06-01_11-30-05.json' (the baseline pane's run is 'baseline_…')."""
    label = view.method if pane == METHOD else "baseline"
    if pane == METHOD and view.method == "baseline":
        label = "noise-check"
    start = view.start
    words = re.findall(r"[a-z0-9]+", (start.prompt_text if start else "").lower())[:5]
    slug = "-".join(words)[:40].strip("-") or "prompt"
    return f"{label}_{slug}_{time.strftime('%Y-%m-%d_%H-%M-%S', time.localtime(stamp))}.json"


def _pair() -> Pair:
    return {METHOD: RunView(), BASELINE: RunView()}


class App:
    """The SpecGUI page and its shared state (one model, one baseline cache, stop flags per session)."""

    def __init__(self, store: ModelStore | None = None) -> None:
        self.store = store or ModelStore()
        self.default_model = hosting.default_model()
        self.cache = BaselineCache()
        self.stops = runs.StopFlags()
        examples = controls.examples()
        self.examples = {e.label: e for e in examples}
        self.presets = {p.name: p for p in controls.presets(examples)}
        self.device = resolve_device("auto").type
        self.kernel_note = _kernel_note(self.device)
        if self.kernel_note:
            LOG.warning(self.kernel_note)
        self.defaults = decoding_defaults()
        self.warmup = warmup.Warmup()  # the demo presets' calibration, started by app.py once the page is up
        self.trace_root = Path(tempfile.mkdtemp(prefix="specgui-traces-"))
        # removed with the app, or when the process exits (a test session built ~30 apps and left their folders)
        weakref.finalize(self, shutil.rmtree, str(self.trace_root), True)

    def preset_runs(self, lm: LoadedModel) -> list[tuple[list[int], str, dict[str, Any]]]:
        """Each demo preset as the calibration decodes it: (prompt ids, method, parameters)."""
        return [(p.example.row.encode(lm.tokenizer), p.method, p.params) for p in self.presets.values()]

    def start_warmup(self, lm: LoadedModel) -> None:
        """Calibrate the demo presets in the background, on the device thread (`specgui.ui.warmup`); on a GPU with
        the fast path's cache made for the longest preset, prompt and budget, so their first runs capture nothing."""
        presets = self.preset_runs(lm)
        room = max(len(ids) + p.max_new_tokens for (ids, _, _), p in zip(presets, self.presets.values(), strict=True))
        self.warmup.start(lm, presets, room)

    # -- layout ---------------------------------------------------------------------------------------

    def build(self) -> gr.Blocks:
        diffs.install()  # streamed values (the API's events above all) reach every client exactly
        with gr.Blocks(title="SpecGUI", delete_cache=GRADIO_CACHE) as demo:
            gr.Markdown(INTRO, elem_id="sg-intro")
            with gr.Tabs(elem_id="sg-tabs"):
                with gr.Tab("Live", id="live"):
                    self._live_tab()
                with gr.Tab("Compare", id="compare"):
                    self._compare_tab()
                with gr.Tab("Methods", id="methods"):
                    gr.Markdown(controls.method_help())
            demo.load(None, None, self.stage, js=STAGE_LOAD_JS)
            # the start line as the calibration stands when the page opens (a component's callable value would be
            # a load event of its own, listed in the API)
            demo.load(self.warmup.line, None, self.startup, queue=False, api_visibility="private")
            # the documented API, in this order; every page event above is private
            gr.api(self.generate_api, api_name="generate", concurrency_id="model", concurrency_limit=1)
            gr.api(self.compare_api, api_name="compare", concurrency_id="model", concurrency_limit=1)
            gr.api(self.replay_api, api_name="replay")
            gr.api(self.preset_api, api_name="preset", concurrency_id="model", concurrency_limit=1)
        return demo

    def _bar(self) -> None:
        """Preset, repeats, Run / Stop, the race's replay and speed, the view: the stage view keeps all of it."""
        first = next(iter(self.presets.values()))
        with gr.Row(elem_id="sg-bar", equal_height=False):
            # each field in its own column: gradio would stack neighbouring fields in one box
            with gr.Column(scale=4, min_width=260):
                self.preset = gr.Dropdown(list(self.presets), value=first.name, label="Preset", elem_id="sg-preset")
            with gr.Column(scale=0, min_width=100):
                self.repeats = gr.Dropdown(list(range(1, MAX_REPEATS + 1)), value=1, label="Repeats",
                                           elem_id="sg-repeats")
            self.run_button = gr.Button("Run", variant="primary", elem_id="run", scale=1, min_width=100)
            self.stop_button = gr.Button("Stop", variant="stop", elem_id="sg-stop", scale=0, min_width=80)
            self.race_button = gr.Button("Replay race", elem_id="sg-race-replay", scale=0, min_width=150)
            with gr.Column(scale=0, min_width=250):
                self.race_speed = gr.Radio(RACE_SPEEDS, value=1.0, label="Race speed", elem_id="sg-race-speed")
            with gr.Column(scale=0, min_width=130):
                self.stage = gr.Checkbox(False, label="Stage view", elem_id="sg-stage-toggle")

    def _live_tab(self) -> None:
        first = next(iter(self.presets.values()))
        self._bar()
        with gr.Row(equal_height=False, elem_id="sg-live"):
            with gr.Column(scale=1, min_width=320, elem_id="sg-settings"):
                self._settings(first)
            with gr.Column(scale=3, elem_id="sg-main"):
                self.status = gr.HTML(render.status(f"Ready. {self.kernel_note}".strip()), elem_id="sg-status")
                # the start's calibration: read at every page load, redrawn each second while it runs
                self.startup = gr.HTML("", elem_id="sg-startup")  # filled at each page load (`build`)
                self.startup_timer = gr.Timer(STARTUP_S)
                with gr.Row(elem_id="sg-legend-row"):
                    self.legend = gr.HTML(render.legend(), elem_id="sg-legend")
                    self.show_rejected = gr.Checkbox(True, label="show rejected drafts inline", scale=0,
                                                     min_width=240, elem_id="sg-show-rejected")
                with gr.Row(equal_height=False, elem_id="sg-panes"):
                    with gr.Column(elem_id="pane-method", min_width=280):
                        self.m_title = gr.HTML(render.pane_title(RunView(), "method"), elem_id="sg-method-title")
                        self.m_stats = gr.HTML(render.pane_stats(RunView(), running=False), elem_id="sg-method-stats")
                        self.m_tokens = gr.HTML(render.tokens(RunView()), elem_id="sg-method-tokens")
                    with gr.Column(elem_id="pane-baseline", min_width=280):
                        self.b_title = gr.HTML(render.pane_title(RunView(), "baseline"), elem_id="sg-baseline-title")
                        self.b_stats = gr.HTML(render.pane_stats(RunView(), running=False),
                                               elem_id="sg-baseline-stats")
                        self.b_tokens = gr.HTML(render.tokens(RunView(), plain=True), elem_id="sg-baseline-tokens")
                with gr.Row(equal_height=False, elem_id="sg-result"):
                    self.speedup = gr.HTML(render.speedup_pending(), elem_id="speedup", min_height=0)
                    self.c_race = gr.Plot(charts.race(RunView(), RunView()), show_label=False, elem_id="race")
                self.summary = gr.HTML("", elem_id="sg-summary")
                gr.Markdown("### Step inspector", elem_id="sg-inspector-title")
                self.step = gr.Slider(1, 2, value=1, step=1, label="Step", visible=False, elem_id="sg-step")
                self.inspector = gr.HTML(render.step_detail(RunView(), 0), elem_id="sg-inspector")
                with gr.Row(elem_id="sg-charts"):
                    self.c_accept = gr.Plot(charts.accepted_per_step(RunView()), show_label=False)
                    self.c_phase = gr.Plot(charts.phase_times(RunView()), show_label=False)
                with gr.Row(elem_id="sg-more-charts"):
                    self.c_skip = gr.Plot(charts.skip_heatmap(RunView()), show_label=False, elem_id="sg-skip-chart")
                    self.c_cost = gr.Plot(charts.cost_profile(RunView()), show_label=False, elem_id="sg-cost-chart")
        self.views = gr.State(None)
        self._wire_live()

    def _settings(self, first: controls.Preset) -> None:
        """The full view's left column: model, method and its parameters, decoding, baseline, prompt, traces."""
        self.model = gr.Textbox(self.default_model, label="Model", elem_id="sg-model", info=_model_help())
        choices = [(NOISE_CHECK if n == "baseline" else n, n) for n in methods.names()]
        self.method = gr.Dropdown(choices, value=first.method, label="Method", elem_id="sg-method")
        with gr.Accordion("Method parameters (presets from configs/)", open=False):
            self.panel = controls.param_panel(self._preset_model(self.default_model), self.device, shown=first.method)
        with gr.Accordion("Decoding", open=True):
            self.mode = gr.Radio(["greedy", "sampling"], value="greedy", label="Mode")
            with gr.Group(visible=False) as self.sampling_box:
                temperature = self.defaults["temperature"] or 0.7  # the YAML's 0 means greedy
                self.temperature = gr.Slider(0.05, 2.0, value=temperature, step=0.05, label="Temperature")
                self.top_p = gr.Slider(0.05, 1.0, value=self.defaults["top_p"], step=0.05, label="Top-p")
                self.seed = gr.Number(None, precision=0, label="Seed (empty: random)")
            self.max_new = gr.Slider(1, controls.max_new_tokens_cap(), step=1, elem_id="sg-max-new",
                                     value=first.max_new_tokens, label="Max new tokens")
        self.fast_path = gr.Radio(list(fastpath.MODES), value="auto", label="Fast path", elem_id="sg-fast-path",
                                  info="static KV cache, bucketed forwards, CUDA graphs; auto = on a GPU only. "
                                       "Both runs use it alike")
        self.compile = gr.Radio(list(compiled.MODES), value="auto", label="Compile", elem_id="sg-compile",
                                info="the fast path's programs as compiled kernels (inductor), compiled once per "
                                     "machine; auto = on a GPU only. Both runs use it alike")
        self.reuse_baseline = gr.Checkbox(False, label="Reuse a cached baseline", elem_id="sg-reuse-baseline",
                                          info="faster; its timing is from an earlier run (its age is shown). "
                                               "Off: a fresh baseline every run")
        self.example = gr.Dropdown(list(self.examples), value=first.example.label, elem_id="sg-example",
                                   label="Example from the built-in suite")
        self.prompt = gr.Textbox(first.example.row.preview, label="Prompt", lines=4, max_lines=10, elem_id="sg-prompt")
        with gr.Accordion("Trace: download or replay", open=False):
            self.trace_out = gr.File(label="This run's traces", file_count="multiple", interactive=False,
                                     elem_id="sg-trace-out")
            self.trace_in = gr.File(label="Load trace(s) to replay (a method and optionally a baseline)",
                                    file_count="multiple", file_types=[".json"], elem_id="sg-trace-in")
            self.replay_button = gr.Button("Replay the traces", elem_id="sg-replay")

    def _wire_live(self) -> None:
        private = {"queue": False, "api_visibility": "private"}
        self.preset.change(self._pick_preset, [self.preset, self.model],
                           [self.method, self.example, self.prompt, self.max_new, *self.panel.components], **private)
        self.method.change(self.panel.show, self.method, list(self.panel.groups.values()), **private)
        self.model.submit(self._presets, self.model, self.panel.components, **private)
        self.model.blur(self._presets, self.model, self.panel.components, **private)
        self.mode.change(lambda m: gr.update(visible=m == "sampling"), self.mode, self.sampling_box, **private)
        self.example.change(self._pick_example, self.example, self.prompt, **private)
        self.show_rejected.change(None, self.show_rejected, None, js=HIDE_REJECTED_JS, queue=False)
        self.stage.change(None, self.stage, None, js=STAGE_TOGGLE_JS, queue=False)
        inputs = [self.model, self.method, self.mode, self.temperature, self.top_p, self.seed, self.max_new,
                  self.example, self.prompt, self.repeats, self.reuse_baseline, self.race_speed, self.fast_path,
                  self.compile, *self.panel.components]
        queued = {"concurrency_id": "model", "concurrency_limit": 1, "show_progress": "minimal",
                  "show_progress_on": self.status, "api_visibility": "private"}  # status shows "queue: i/n"
        self.run_button.click(self._run_clicked, inputs, self._outputs(), api_name="page_run", js=SETTLED_JS,
                              **queued)
        self.race_button.click(self.race_again, [self.views, self.race_speed], self._outputs(),
                               api_name="page_race", js=SETTLED_JS, **queued)
        self.replay_button.click(self.replay, [self.trace_in, self.race_speed], self._outputs(),
                                 api_name="page_replay", **queued)
        self.stop_button.click(self.stop, None, None, api_name="page_stop", **private)
        self.step.change(self.inspect, [self.step, self.views], self.inspector, show_progress="hidden", **private)
        self.startup_timer.tick(self._startup_tick, None, [self.startup, self.startup_timer], show_progress="hidden",
                                **private)

    def _compare_tab(self) -> None:
        rows = load_prompts()
        categories = [compare.ALL, *dict.fromkeys(r.category for r in rows)]
        with gr.Row():
            self.cmp_methods = gr.CheckboxGroup([n for n in methods.names() if n != "baseline"], label="Methods",
                                                value=[n for n in methods.names() if n != "baseline"],
                                                info="baseline always runs")
            self.cmp_category = gr.Dropdown(categories, value=compare.ALL, label="Category")
            self.cmp_per = gr.Slider(1, 8, value=1, step=1, label="Prompts per category")
            self.cmp_tokens = gr.Slider(8, 256, value=48, step=8, label="Max new tokens", elem_id="sg-cmp-tokens")
            self.cmp_repeats = gr.Slider(1, MAX_REPEATS, value=1, step=1, label="Repeats (median)")
        self.cmp_preset = gr.Dropdown([compare.NO_PRESET, *papers.names()], value=compare.NO_PRESET,
                                      label="Paper preset", info="a seed paper's comparison set, laid out as its "
                                      "table with the paper's own numbers beside ours (replaces methods and category)")
        with gr.Row():
            self.cmp_run = gr.Button("Run suite", variant="primary", elem_id="sg-cmp-run")
            self.cmp_stop = gr.Button("Stop", variant="stop")
        self.cmp_status = gr.HTML(render.status("Greedy decoding, embedded model unless the Live tab loaded another."),
                                  elem_id="sg-cmp-status")
        self.cmp_table = gr.Dataframe(headers=compare.COLUMNS, interactive=False, elem_id="sg-cmp-table")
        self.cmp_note = gr.HTML("")
        self.cmp_chart = gr.Plot(show_label=False)
        self.cmp_run.click(self.run_compare, [self.cmp_methods, self.cmp_category, self.cmp_per, self.cmp_tokens,
                                              self.cmp_repeats, self.cmp_preset],
                           [self.cmp_status, self.cmp_table, self.cmp_chart, self.cmp_note], concurrency_id="model",
                           concurrency_limit=1, api_name="page_compare", api_visibility="private",
                           show_progress_on=self.cmp_status)
        self.cmp_stop.click(self.stop_compare, None, None, queue=False, api_visibility="private")

    def _outputs(self) -> list[Any]:
        return [self.status, self.legend, self.m_title, self.m_stats, self.m_tokens, self.b_title, self.b_stats,
                self.b_tokens, self.speedup, self.summary, self.step, self.inspector, self.c_accept, self.c_race,
                self.c_skip, self.c_phase, self.c_cost, self.views, self.trace_out]

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

    def _pick_preset(self, name: str | None, model: str) -> tuple:
        """A preset sets the method, the example (and so the prompt), the token budget and the parameters
        (configs/ presets for the model, with the preset's own on top) in one choice."""
        preset = self.presets.get(name or "")
        if preset is None:
            return (gr.skip(),) * (4 + len(self.panel.components))
        values = self.panel.presets(self._preset_model(str(model or "")), self.device, preset.method, preset.params)
        return preset.method, preset.example.label, preset.example.row.preview, preset.max_new_tokens, *values

    def _startup_tick(self) -> tuple[str, gr.Timer]:
        """The start line now; the timer stops once the calibration is not running."""
        return self.warmup.line(), gr.Timer(active=self.warmup.running)

    def stop(self, request: gr.Request = None) -> None:
        self.stops.stop(_session(request))

    def stop_compare(self, request: gr.Request = None) -> None:
        self.stops.stop(_session(request) + "/compare")

    def inspect(self, step: float, views: Pair | None) -> str:
        if not views:
            return render.step_detail(RunView(), 0)
        index = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else 1  # the slider's, or junk
        return render.step_detail(views[METHOD], index - 1, self._token_text(views[METHOD]))

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
            max_new: float, example: str | None, prompt: str, repeats: float, reuse_baseline: bool,
            race_speed: float, fast_path: str, compile: str, *params: Any,
            session: str = "local") -> Iterator[dict]:
        """Live: the method and baseline (`runs.live`), `repeats` times, streamed into the panes; the verdict; the
        race."""
        try:
            model = self._checked_model(model)
            n, note = controls.clamp_tokens(max_new)
            overrides = self.panel.overrides(method, list(params))
            methods.params_for(method, self._preset_model(model), self.device, overrides)  # ranges, before queueing
            req = RunRequest(method=methods.get(method).name, prompt=controls.prompt_for(prompt,
                             self.examples.get(example or "")), max_new_tokens=n,
                             sampling=controls.sampling_from(mode, temperature, top_p, seed),
                             params=overrides, model=model, prompt_text=prompt,
                             repeats=_whole(repeats, "repeats", 1, MAX_REPEATS), reuse_baseline=bool(reuse_baseline),
                             fast_path=fastpath.checked(fast_path), compile=compiled.with_path(fast_path, compile))
            speed = _speed(race_speed)
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return
        stop = self.stops.fresh(session)
        for tick in self.warmup.ticks(stop):  # a Run pressed while the start calibrates waits for it, and says so
            note = " · ".join(filter(None, (note, tick.note)))
            yield {self.status: render.status(tick.status, "busy")}
        if stop.is_set():
            yield {self.status: render.status("stopped")}
            return
        measured = yield from self._live(runs.live(self.store, self.cache, req, stop), note, req.repeats)
        if measured is not None:
            yield from self._race(*measured, speed, stop)

    def race_again(self, views: Pair | None, speed: float, request: gr.Request = None) -> Iterator[dict]:
        """The last run's race again, at the chosen speed (1x: as recorded)."""
        try:
            if not views or views[METHOD].start is None:
                raise SpecGUIError("nothing to replay yet: press Run first")
            speed = _speed(speed)
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return
        yield from self._race(views, "", speed, self.stops.fresh(_session(request)))

    def replay(self, files: list[Any] | None, speed: float, request: gr.Request = None) -> Iterator[dict]:
        """Replay: recorded traces race in the panes at their recorded pace (no model needed)."""
        try:
            if not files:
                raise SpecGUIError("choose one or two trace files first")
            runs.check_trace_count(len(files))
            panes = runs.assign_panes([load_trace(_upload_path(f)) for f in files])
            speed = _speed(speed)
            runs.check_replay(panes, speed)
            pair = _pair()
            for pane, events in panes.items():
                pair[pane].extend(events)
            verdict = self._final([pair], None)[0]
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return
        start = panes[METHOD][0]
        note = f"replay of a trace recorded with {start.model} on {start.device}"
        yield {**self._reset(note), **verdict}
        yield from self._race(pair, note, speed, self.stops.fresh(_session(request)))

    def _live(self, ticks: Iterator[Tick], note: str, repeats: int) -> Generator[dict, None, tuple[Pair, str] | None]:
        """Live ticks into the panes (each repeat starts them afresh), then the verdict over all repeats.
        Returns the pair to race and the status note, or None when there is nothing to race (stopped, failed)."""
        pairs: list[Pair] = []
        yield self._reset(note or "running")
        token_text: TokenText | None = None
        try:
            for tick in ticks:
                if tick.note:
                    note = " · ".join(filter(None, (note, tick.note)))
                if tick.status:
                    yield {self.status: render.status(tick.status, "busy")}
                    continue
                if tick.repeat == len(pairs):
                    pairs.append(_pair())
                    if repeats > 1:
                        yield {**self._panes(pairs[-1]),
                               self.status: render.status(f"repeat {tick.repeat + 1} of {repeats}", "busy")}
                view = pairs[tick.repeat][tick.pane]
                layers = list(view.fractal_layers)
                view.cached_at = tick.cached_at if tick.cached_at is not None else view.cached_at
                view.extend(tick.events)
                if token_text is None and view.start is not None:
                    token_text = self._token_text(view)
                update = self._pane(tick.pane, view)
                if tick.pane == METHOD:
                    if view.steps:
                        update[self.inspector] = render.step_detail(view, len(view.steps) - 1, token_text)
                    if view.fractal_layers != layers:
                        update[self.legend] = render.legend(view.fractal_layers, view.num_layers)
                yield update
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return None
        update, chosen, stopped = self._final(pairs, token_text)
        if stopped:
            yield {**update, self.status: render.status(" · ".join(filter(None, ("stopped", note))))}
            return None
        yield update
        return chosen, note

    def _race(self, pair: Pair, note: str, speed: float, stop: threading.Event) -> Iterator[dict]:
        """Both runs again, side by side at their recorded pace (`speed` times), the race chart drawing along.

        Only the panes and the race chart change: the verdict, the inspector and the charts stay. Nothing
        is decoded: the events' own timings set the pace."""
        recorded = {pane: view.events for pane, view in pair.items() if view.start is not None}
        views = {pane: RunView(cached_at=view.cached_at) for pane, view in pair.items()}
        span = charts.race_span(*pair.values())
        yield {**self._panes(views), self.c_race: charts.race(views[METHOD], views[BASELINE], span),
               self.status: render.status(f"the race at {speed:g}×: both runs at their recorded pace", "busy")}
        try:
            for tick in runs.replay(recorded, stop, speed, frame=RACE_FRAME_S):
                views[tick.pane].extend(tick.events)
                yield {**self._pane(tick.pane, views[tick.pane]),
                       self.c_race: charts.race(views[METHOD], views[BASELINE], span)}
        except Exception as exc:
            yield {self.status: render.status(_failure(exc), "error")}
            return
        state = "stopped" if stop.is_set() else "done"
        yield {**self._panes(views, running=False), self.c_race: charts.race(views[METHOD], views[BASELINE], span),
               self.status: render.status(" · ".join(filter(None, (state, note))))}

    def _reset(self, note: str) -> dict:
        return {**self._panes(_pair()), self.status: render.status(note, "busy"), self.legend: render.legend(),
                self.speedup: render.speedup_pending("measuring: the speedup appears when both runs are done"),
                self.summary: "", self.step: gr.update(visible=False), self.trace_out: None,
                self.c_race: charts.race(RunView(), RunView())}

    def _pane(self, pane: str, view: RunView, *, running: bool = True) -> dict:
        stats = render.pane_stats(view, running=running)
        if pane == METHOD:
            return {self.m_title: render.pane_title(view, "method"), self.m_stats: stats,
                    self.m_tokens: render.tokens(view)}
        return {self.b_title: render.pane_title(view, "baseline"), self.b_stats: stats,
                self.b_tokens: render.tokens(view, plain=True)}

    def _panes(self, pair: Pair, *, running: bool = True) -> dict:
        return {**self._pane(METHOD, pair[METHOD], running=running), **self._pane(BASELINE, pair[BASELINE],
                                                                                 running=running)}

    def _method_charts(self, view: RunView) -> dict:
        return {self.c_accept: charts.accepted_per_step(view), self.c_skip: charts.skip_heatmap(view),
                self.c_phase: charts.phase_times(view), self.c_cost: charts.cost_profile(view)}

    def _final(self, pairs: list[Pair], token_text: TokenText | None) -> tuple[dict, Pair, bool]:
        """The verdict over every repeat: the median speedup and range, the why line and the details of the
        pair nearest the median. Returns the update, that pair, and whether a run was stopped."""
        measured = [p for p in pairs if comparable(p[METHOD], p[BASELINE])]
        speedups = [p[METHOD].tokens_per_s / p[BASELINE].tokens_per_s for p in measured]
        chosen = measured[median_index(speedups)] if measured else (pairs[-1] if pairs else _pair())
        method, baseline = chosen[METHOD], chosen[BASELINE]
        update = {**self._method_charts(method), **self._panes(chosen, running=False), self.views: chosen,
                  self.legend: render.legend(method.fractal_layers, method.num_layers),
                  self.c_race: charts.race(method, baseline, charts.race_span(method, baseline))}
        if method.steps:
            last = len(method.steps)
            update[self.step] = gr.update(minimum=1, maximum=max(2, last), value=last, visible=True)
            update[self.inspector] = render.step_detail(method, last - 1, token_text)
        if method.done and baseline.done:
            comparison = compare_views(method, baseline)
            update[self.speedup] = render.speedup(method, baseline, spread(speedups), why(method, baseline),
                                                  comparison)
            update[self.summary] = render.summary(method, baseline)
        else:
            update[self.speedup] = render.speedup_pending("no baseline run to compare with")
        update[self.trace_out] = self._save_traces(chosen) or None
        stopped = any(v.start is not None and (not v.done or v.summary.stop == "cancelled")
                      for p in pairs for v in p.values())
        return update, chosen, stopped

    def _save_traces(self, views: Pair) -> list[str]:
        """Each pane's events as a core trace file named by method, prompt and time (the oldest runs' are deleted)."""
        for old in sorted(self.trace_root.iterdir(), key=lambda d: d.stat().st_mtime)[:-KEEP_TRACES + 1]:
            shutil.rmtree(old, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(dir=self.trace_root))
        stamp = time.time()
        paths = []
        for pane, view in views.items():
            if view.start is not None:
                path = folder / trace_name(view, pane, stamp)
                save_trace(view.events, path)
                paths.append(str(path))
        return paths

    # -- compare tab ----------------------------------------------------------------------------------

    def _suite(self, names: Any, category: Any, per_category: Any, max_new: Any, repeats: Any, preset: Any,
               stop: threading.Event, progress: compare.Progress) -> tuple[Future, int, papers.PaperPreset | None]:
        """Start the suite on the device thread (the caller holds `store.busy`): the job, its prompt count and
        the paper preset that chose the methods and categories (None: `names` and `category` did)."""
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise SpecGUIError("methods must be a list of method names")
        if not isinstance(preset, str):
            raise SpecGUIError("preset must be a paper preset's name")
        per_category = _whole(per_category, "prompts per category", 1, 8)
        rows, names, paper = compare.choose(load_prompts(), names, str(category), per_category, preset)
        max_new = _whole(max_new, "max new tokens", 1, controls.max_new_tokens_cap())
        repeats = _whole(repeats, "repeats", 1, MAX_REPEATS)
        if hosting.is_public():
            if paper is None and any("+" in name for name in names):
                raise SpecGUIError("this deployment compares methods by name only, without METHOD+KEY=VALUE settings")
            tokens = len(rows) * (len(names) + 1) * repeats * max_new
            if tokens > PUBLIC_SUITE_TOKENS:
                raise SpecGUIError(f"{len(rows)} prompts x {len(names) + 1} methods x {repeats} repeats x {max_new} "
                                   f"tokens is {tokens:,} new tokens; this deployment runs at most "
                                   f"{PUBLIC_SUITE_TOKENS:,}: fewer prompts, methods, repeats or tokens")
        lm = self._loaded()
        job = runs.DEVICE.submit(contextvars.copy_context().run, compare.run_suite, lm, rows, names,
                                 max_new_tokens=max_new, repeats=repeats, sampling=Sampling(), stop=stop,
                                 progress=progress)
        return job, len(rows), paper

    def run_compare(self, names: list[str], category: str, per_category: float, max_new: float, repeats: float,
                    preset: str = compare.NO_PRESET, request: gr.Request = None,
                    progress: gr.Progress = PROGRESS) -> tuple:
        stop = self.stops.fresh(_session(request) + "/compare")
        counts: queue.SimpleQueue = queue.SimpleQueue()  # (runs done per method, runs per method), device thread
        try:
            with self.store.busy:
                job, prompts, paper = self._suite(list(names or []), category, per_category, max_new, repeats,
                                                  preset, stop, lambda done, each: counts.put((done, each)))
                progress(0, desc="warm-up: one short untimed run per method")
                while not job.done():
                    with contextlib.suppress(queue.Empty):
                        done, each = counts.get(timeout=0.2)
                        progress((sum(done.values()), each * len(done)), desc=compare.progress_text(done, each),
                                 unit="runs")
                report = job.result()
        except compare.Stopped:
            return render.status("stopped"), gr.skip(), gr.skip(), gr.skip()
        except Exception as exc:
            return render.status(_failure(exc), "error"), gr.skip(), gr.skip(), gr.skip()
        message = (f"done: {prompts} prompts × {len(report['methods'])} methods on {report['model']} "
                   f"({report['device']}), max {report['max_new_tokens']} new tokens, median of {report['repeats']}")
        note = render.status(papers.caption(report, paper)) if paper else ""
        return render.status(message), compare.result_table(report, paper), charts.compare_chart(report), note

    # -- API ------------------------------------------------------------------------------------------

    def generate_api(self, prompt: str, method: str = "pld", max_new_tokens: int = 64,
                     temperature: float = 0.0, model: str = "") -> Iterator[dict]:
        """Stream one generation as JSON events: start, prefill, one per draft -> verify step, summary. `model`
        (blank: the one loaded, else the default) is checked against this deployment's policy first."""
        try:
            method = methods.get(str(method)).name
            n, _ = controls.clamp_tokens(max_new_tokens)
            sampling = Sampling(temperature=controls.number(temperature, "temperature"))
            if not isinstance(prompt, str):
                raise SpecGUIError("the prompt must be text")
            lm = self.store.get(self._checked_model(model)) if str(model or "").strip() else self._loaded()
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

    def compare_api(self, methods: list[str], category: str = compare.ALL, prompts_per_category: int = 1,
                    max_new_tokens: int = 48, repeats: int = 1, preset: str = compare.NO_PRESET) -> dict:
        """Bench the built-in suite (every category, or one) with `methods` against baseline, greedy: the
        report as JSON (tokens/s, speedup, tau, acceptance and identity per method, per category, per prompt).
        A paper `preset` (configs/papers/) replaces methods and category by that paper's comparison set."""
        try:
            with self.store.busy:
                job, _, _ = self._suite(methods, category, prompts_per_category, max_new_tokens, repeats, preset,
                                        threading.Event(), lambda done, each: None)
                return job.result()
        except Exception as exc:
            raise gr.Error(_failure(exc)) from None

    def preset_api(self, preset: str) -> dict:
        """Run one demo preset (`configs/demos.yaml`) as Run does on the page, the method and then plain decoding,
        and return the verdict: the speedup, the why line the page shows under it, and both runs' summaries."""
        try:
            chosen = self.presets.get(str(preset))
            if chosen is None:
                raise SpecGUIError(f"unknown preset {str(preset)[:80]!r}: choose from {', '.join(self.presets)}")
            example = chosen.example
            request = RunRequest(method=chosen.method, prompt=controls.prompt_for(example.row.preview, example),
                                 max_new_tokens=chosen.max_new_tokens, sampling=Sampling(), params=chosen.params,
                                 model=self._checked_model(""), prompt_text=example.row.preview)
            pair = _pair()
            self.warmup.wait()  # priced by the start's finished calibration, as a Run is
            for tick in runs.live(self.store, self.cache, request, threading.Event()):
                pair[tick.pane].extend(tick.events)
            method, baseline = pair[METHOD], pair[BASELINE]
            if not (method.done and baseline.done and comparable(method, baseline)):
                raise SpecGUIError("the preset's runs did not finish")
        except Exception as exc:
            raise gr.Error(_failure(exc)) from None
        reason = why(method, baseline)
        return {"preset": chosen.name, "method": chosen.method, "speedup": method.tokens_per_s / baseline.tokens_per_s,
                "why": reason.sentence() if reason else "", "per_step": reason.per_step if reason else None,
                "predicted_per_step": reason.predicted_per_step if reason else None,
                "overall": reason.overall if reason else None, "predicted": reason.predicted if reason else None,
                "uncalibrated": reason.uncalibrated if reason else None,
                "summaries": {pane: to_json(view.summary) for pane, view in pair.items()}}

    def replay_api(self, trace: str, speed: float = 1.0) -> Iterator[dict]:
        """Stream a recorded trace's events at their recorded pace, `speed` times faster; no model is used. `trace` is
        the JSON text of a trace file, or a file's path on the server (on a public deployment only an upload's)."""
        try:
            if not isinstance(trace, str):
                raise SpecGUIError("the trace must be the text of a trace file")
            text = trace.lstrip()
            events: list[Event] = loads_trace(trace) if text.startswith(("[", "{")) else load_trace(
                _upload_path(text))
            speed = _speed(speed)
            runs.check_replay({METHOD: events}, speed)
        except Exception as exc:
            raise gr.Error(_failure(exc)) from None
        for tick in runs.replay({METHOD: events}, threading.Event(), speed, frame=API_FRAME_S):
            yield from (to_json(event) for event in tick.events)


def _kernel_note(device: str) -> str:
    """Why decoding is slower than it could be here, said once on the server's log and in the first status line: on
    a CPU without the compiled C kernel (a Space without packages.txt has no C compiler) the app still runs, through
    torch's kernels. Empty where the kernel is built, or on a GPU, which never uses it."""
    if device != "cpu" or kernels.skinny_library() is not None:
        return ""
    return ("The C kernel is not built here (no C compiler, or a CPU without AVX2): "
            "decoding runs through torch's kernels, slower.")


def _model_help() -> str:
    if hosting.is_public():
        return "this deployment serves: " + ", ".join(hosting.allowed_models())
    return "'embedded' (SmolLM2-135M-Instruct), a hub id or a local directory"


@contextlib.contextmanager
def served_locally(app: App) -> Iterator[str]:
    """`app`'s page launched as app.py launches it (one queue, the page's theme), on a free loopback port, for a
    headless browser or a client in this process (a test, the stage picture): its URL, closed afterwards."""
    demo = app.build().queue(**queue_options())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True, **launch_options())
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def queue_options() -> dict[str, Any]:
    """The one queue every event waits in (one device: one at a time), bounded (`QUEUE_SIZE`)."""
    return {"default_concurrency_limit": 1, "max_size": QUEUE_SIZE}


def launch_options() -> dict[str, Any]:
    """Theme, stylesheet and the stage view's early script for `launch` (gradio 6 takes them there): local
    fonts, no CDN; uploads are refused above the trace size cap before they reach a handler."""
    return {"css_paths": [ASSETS_DIR / "app.css"], "theme": gr.themes.Default(), "max_file_size": MAX_TRACE_BYTES,
            "head": STAGE_HEAD}

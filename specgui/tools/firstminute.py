"""`python -m specgui first-minute`: what a newcomer meets in the app's first minute, measured as they meet it.

Why a command: how long `python app.py` keeps a terminal and a browser waiting, and whether the first race after a
start is as fair as the tenth, are properties of the whole product on a machine (imports, the model's conversion, the
C kernel's build, the cost profile, the calibration, the browser on the same cores), which no unit test times. This
starts `app.py` as a user does, twice on one fresh cache folder (cold: nothing converted, built or measured; warm:
all of it read back), and times each start from the command to the first answer at its address (the starting page,
`specgui.ui.placeholder`), to the page's "Running on" and to the calibration's end;
then, on the warm start, it drives the stage view in a headless chromium and presses Run on the first preset twice,
recording each race's overall speedup beside its prediction, both runs' prompt forwards and what a prediction's error
comes from (the plain step the method was priced against beside the baseline's steps as measured; from the page's
traces).
`--save` writes `results/<machine>/startup.json`, which README's first-start paragraph renders.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgui import REPO_DIR
from specgui.errors import SpecGUIError

START_TIMEOUT_S = 30 * 60  # a cold start on a busy two-core machine took minutes
RUN_TIMEOUT_MS = 20 * 60 * 1000
RUNNING = "Running on local URL:"
CALIBRATED = re.compile(r"calibration: (\w+)")


@dataclass
class Start:
    """A served app.py and its output, each line with the seconds since the command."""

    proc: subprocess.Popen
    began: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None
    answered: float | None = None  # seconds from the command to the address's first answer

    def seconds_to(self, pattern: str | re.Pattern[str], timeout: float = START_TIMEOUT_S) -> float:
        """Seconds from the command to the first line holding `pattern` (waits for it)."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((t for t, line in list(self.lines) if re.search(pattern, line)), None)
            if found is not None:
                return found
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(line for _, line in self.lines[-20:])
                raise SpecGUIError(f"app.py never printed {pattern!r} (exit {self.proc.poll()}): ...\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        if self.reader is not None:
            self.reader.join(timeout=60)  # it reads to the end of the output, then the pipe can close
        self.proc.stdout.close()


def start(cache: Path, port: int) -> Start:
    """`python app.py` on `port` with `cache` as its cache folder, its output read line by line (a bar's redraws
    too)."""
    env = {**os.environ, "SPECGUI_CACHE": str(cache), "GRADIO_SERVER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=REPO_DIR, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    started = Start(proc, began)

    def read() -> None:
        buffer = ""
        while chunk := proc.stdout.read(1):
            if chunk in "\r\n":
                if buffer.strip():
                    started.lines.append((time.monotonic() - began, buffer))
                buffer = ""
            else:
                buffer += chunk

    def ask() -> None:
        # as a browser asks: the starting page answers other clients 503 until the app is up
        request = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Accept": "text/html"})
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(request, timeout=60):
                    started.answered = time.monotonic() - began
                    return
            except OSError:
                time.sleep(0.05)

    started.reader = threading.Thread(target=read, daemon=True)
    started.reader.start()
    threading.Thread(target=ask, daemon=True).start()
    return started


def timed_start(cache: Path, port: int) -> tuple[Start, dict[str, float]]:
    """A start's seconds to its address's first answer, to "Running on" and to the calibration's end (the app left
    running)."""
    app = start(cache, port)
    running = app.seconds_to(RUNNING)
    calibrated = app.seconds_to(CALIBRATED)
    state = next(CALIBRATED.search(line)[1] for _, line in app.lines if CALIBRATED.search(line))
    if state != "done":
        app.stop()
        raise SpecGUIError(f"the calibration ended {state}: " + next(line for _, line in app.lines
                                                                    if CALIBRATED.search(line)))
    answered = app.answered if app.answered is not None else running
    return app, {"answers_s": round(answered, 1), "running_s": round(running, 1), "calibrated_s": round(calibrated, 1)}


def races(url: str, count: int = 2) -> list[dict[str, Any]]:
    """Press Run on the stage view's first preset `count` times in a headless chromium; each race's figures."""
    from playwright.sync_api import sync_playwright

    from specgui.core.events import loads_trace
    from specgui.tools.picture import SIZE, chromium_path

    found = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(),
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": SIZE[0], "height": SIZE[1]})
        page.set_default_timeout(RUN_TIMEOUT_MS)
        page.goto(url + "?view=stage")
        page.wait_for_selector("#run")
        page.wait_for_selector("#sg-status .sg-status", state="attached")  # gradio mounts the HTML after the button
        # pressed at once, as an eager visitor would: the page holds the run until it has drawn itself (`SETTLED_JS`)
        for _ in range(count):
            page.evaluate("document.querySelector('#sg-status .sg-status').dataset.old = '1'")
            page.click("#run")
            page.wait_for_function("(() => { const e = document.querySelector('#sg-status .sg-status');"
                                   " return e && !e.dataset.old && e.innerText.startsWith('done'); })()")
            traces = [loads_trace(page.request.get(link).text()) for link in trace_links(page)]
            found.append(race_figures(traces) if len(traces) == 2 else read_figures(page))
        browser.close()
    return found


def trace_links(page: Any) -> list[str]:
    """The finished runs' trace files on the page: the stage view hides them, so the full view shows them a moment
    (between races, when nothing decodes) with their accordion open; [] where they cannot be found."""
    from specgui.ui.page import STAGE_CLASS

    page.evaluate(f"document.documentElement.classList.remove('{STAGE_CLASS}')")
    try:
        if not page.locator("#sg-trace-out a").count():
            page.get_by_text("Trace: download or replay").click()
        page.wait_for_selector("#sg-trace-out a", timeout=30_000)
        return page.locator("#sg-trace-out a").evaluate_all("links => [...new Set(links.map(a => a.href))]")
    except Exception:  # a page that hides them otherwise: the why line still has the figures (`read_figures`)
        return []
    finally:
        page.evaluate(f"document.documentElement.classList.add('{STAGE_CLASS}')")


def read_figures(page: Any) -> dict[str, Any]:
    """A race's overall speedup and its prediction as the why line on the page states them (no prompt forwards)."""
    text = page.locator("#speedup").inner_text()
    found = re.search(r"([\d.]+)× overall \(predicted ([\d.]+)×", text) or re.search(
        r"([\d.]+)× per step \(predicted ([\d.]+)×", text)
    if found is None:
        raise SpecGUIError(f"no speedup beside a prediction on the page: {text[:200]!r}")
    return {"method": page.locator("#sg-method input").input_value(), "overall": float(found[1]),
            "predicted": float(found[2]), "per_step": None, "prefill_ms": None}


def race_figures(traces: list[list[Any]]) -> dict[str, Any]:
    """A race's overall speedup and its prediction (as the why line reads them), each run's prompt forward, and what
    the prediction's error comes from: the plain step the method's run was priced against (`plain_priced_ms`, the
    median of its steps' `plain_ms`) beside the baseline's own steps as measured (`baseline_step_ms`, their median),
    and the method's measured time over its predicted (`method_measured_over_predicted`)."""
    import statistics

    from specgui.core.events import Prefill, Step
    from specgui.ui.runs import assign_panes
    from specgui.ui.view import RunView, why

    panes = {pane: RunView() for pane in ("method", "baseline")}
    for pane, events in assign_panes(traces).items():
        panes[pane].extend(events)
    reason = why(panes["method"], panes["baseline"])
    if reason is None:
        raise SpecGUIError("a race without both runs measured")
    prefill = {pane: next(e.ms for e in view.events if isinstance(e, Prefill)) for pane, view in panes.items()}
    steps = {pane: [e for e in view.events if isinstance(e, Step)] for pane, view in panes.items()}
    measured = {pane: [s.draft_ms + s.verify_ms + s.overhead_ms for s in found] for pane, found in steps.items()}
    predicted = sum(s.predicted_ms for s in steps["method"])
    return {"method": panes["method"].method, "overall": round(reason.overall, 3),
            "predicted": round(reason.predicted, 3) if reason.predicted is not None else None,
            "per_step": round(reason.per_step, 3), "prefill_ms": {k: round(v, 1) for k, v in prefill.items()},
            "plain_priced_ms": round(statistics.median(s.plain_ms for s in steps["method"]), 2),
            "baseline_step_ms": round(statistics.median(measured["baseline"]), 2),
            "method_measured_over_predicted": round(sum(measured["method"]) / predicted, 3) if predicted else None}


def measure(cache: Path | None, port: int, cold: bool = True) -> dict[str, Any]:
    """Cold and warm starts on `cache` (None: a fresh folder; cold needs one), then the warm start's first races."""
    folder = Path(tempfile.mkdtemp(prefix="specgui-first-minute-")) if cache is None else cache
    data: dict[str, Any] = {"cache": "fresh folder" if cache is None else "given folder"}
    if cold:
        app, data["cold"] = timed_start(folder, port)
        app.stop()
        print(f"cold start: {data['cold']}", file=sys.stderr)
    app, data["warm"] = timed_start(folder, port)
    print(f"warm start: {data['warm']}", file=sys.stderr)
    try:
        data["races"] = races(f"http://127.0.0.1:{port}/")
    finally:
        app.stop()
    for n, race in enumerate(data["races"], 1):
        print(f"race {n}: {race}", file=sys.stderr)
    return data

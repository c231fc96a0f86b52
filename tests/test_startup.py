"""The app's first minute: `python app.py` answers at its address from the start (a starting page that brings the app
in by itself), serves its page before the demo presets' calibration ends, the page and the terminal say how far it
is, and a Run pressed meanwhile waits for it in a real chromium, then ends identical to plain decoding and priced by
the finished calibration. While it starts, every request but a browser's is told to wait (503), and the API example of
docs/app.md, run as written, waits for the app and then decodes through it.

Neither verdict rests on the machine's speed: the calibration is held after its first preset (SPECGUI_CALIBRATION_HOLD
for the served app.py, a `threading.Event` for the page in this process), and the start itself before its page is
served (SPECGUI_START_HOLD), until the test has seen what it checks."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from urllib.error import HTTPError

import pytest
from markdown_it import MarkdownIt
from playwright.sync_api import sync_playwright
from test_browser import visitor
from ui_helpers import served

from specgui import REPO_DIR
from specgui.tools.picture import chromium_path
from specgui.ui import controls, placeholder, warmup

START_TIMEOUT_S = 600  # bounds, not verdicts: a busy two-core machine took minutes to import and load
TIMEOUT_MS = START_TIMEOUT_S * 1000
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SHORT_DEMOS = 2  # the served app.py's presets (SPECGUI_DEMOS): the first two of configs/demos.yaml, whose order of
# events at the start is the same as the nine's and whose calibration takes seconds, not a minute


def short_demos(folder) -> tuple[str, int]:
    """A presets file of configs/demos.yaml's first `SHORT_DEMOS` presets (for SPECGUI_DEMOS), and how many."""
    import yaml

    rows = yaml.safe_load(controls.DEMOS_FILE.read_text(encoding="utf-8"))[:SHORT_DEMOS]
    path = folder / "demos.yaml"
    path.write_text(yaml.safe_dump(rows), encoding="utf-8")
    return str(path), len(controls.presets(controls.examples(), path))
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"  # chromium's, navigating
DOCS_URL = "http://127.0.0.1:7860/"  # where docs/app.md's client example asks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_until(lines: list[str], proc: subprocess.Popen, text: str) -> None:
    """Wait until the app's output (collected into `lines` by a thread) holds `text`."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not any(text in line for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"app.py never printed {text!r} (exit {proc.poll()}):\n" + "".join(lines[-40:]))
        time.sleep(0.1)


def first_answer(url: str, proc: subprocess.Popen) -> str:
    """The first page the address answers a browser with, asked every 0.1 s from the app's start."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": BROWSER_ACCEPT}),
                                        timeout=60) as answer:
                assert answer.status == 200
                return answer.read().decode("utf-8")
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"app.py never answered at {url} (exit {proc.poll()})")


def test_app_py_serves_the_page_while_the_calibration_runs_and_says_when_it_ends(embedded_lm, tmp_path):
    # embedded_lm: the session's cache holds the converted weights and the built kernel (a warm start)
    release = tmp_path / "release"
    port = free_port()
    demos, presets = short_demos(tmp_path)
    env = {**os.environ, warmup.HOLD_ENV: str(release), "GRADIO_SERVER_PORT": str(port), "PYTHONUNBUFFERED": "1",
           controls.DEMOS_ENV: demos}
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=REPO_DIR, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}/"
        first = first_answer(url, proc)  # the address answers from the start: the starting page, with its phase
        assert placeholder.MARK in first and "starting SpecGUI" in first
        assert not any("Running on" in line for line in lines)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), args=ARGS)
            page = visitor(browser, 1280, 720)
            page.goto(url + "?view=stage")
            page.wait_for_selector("#run", timeout=TIMEOUT_MS)  # the starting page brings the app's in by itself
            assert any("Running on" in line for line in lines)
            # held after its first preset: the calibration cannot end before the release below
            page.wait_for_function("document.querySelector('#sg-startup')?.innerText.includes("
                                   f"'calibrating the demo presets: 1 of {presets}')", timeout=TIMEOUT_MS)
            assert page.locator("#sg-startup progress").is_visible()
            assert not any("calibration: done" in line for line in lines)
            release.touch()
            page.wait_for_function("document.querySelector('#sg-startup')?.innerText.includes("
                                   f"'calibrated at start: {presets} presets')", timeout=TIMEOUT_MS)
            browser.close()
        read_until(lines, proc, f"calibration: done, {presets} presets in")
        output = "".join(lines)
        assert output.index("Running on") < output.index("calibrating the demo presets …")  # the page first
        assert "the page is up; calibrating the demo presets in the background" in output
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def docs_client_example() -> str:
    """The Python client example of docs/app.md (its one fence that imports gradio_client), as written."""
    tokens = MarkdownIt("commonmark").parse((REPO_DIR / "docs" / "app.md").read_text(encoding="utf-8"))
    [code] = [t.content for t in tokens if t.type == "fence" and "gradio_client" in t.content]
    assert code.count(DOCS_URL) == 1  # the one place the test points it at its own port
    return code


def test_while_app_py_starts_a_client_is_told_to_wait_and_the_docs_client_example_then_runs(embedded_lm, tmp_path):
    # embedded_lm: a warm start (see above); --no-calibrate: the example's run queues behind no calibration
    release = tmp_path / "release"
    port = free_port()
    env = {**os.environ, placeholder.HOLD_ENV: str(release), "GRADIO_SERVER_PORT": str(port),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "app.py", "--no-calibrate"], cwd=REPO_DIR, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{port}/"
        read_until(lines, proc, f"({placeholder.HOLD_ENV}) …")  # held before its page: the starting page answers
        refused = [urllib.request.Request(url + "config"),
                   urllib.request.Request(url + "gradio_api/call/generate", method="POST",
                                          data=json.dumps({"data": ["Hi", "pld", 8, 0.0, ""]}).encode(),
                                          headers={"Content-Type": "application/json"}),
                   urllib.request.Request(url + "healthz"),
                   urllib.request.Request(url, headers={"Accept": "application/json"})]
        for request in refused:
            with pytest.raises(HTTPError) as answer:
                urllib.request.urlopen(request, timeout=60)
            assert answer.value.code == 503, request.full_url
            assert answer.value.headers["Retry-After"] == str(placeholder.RETRY_AFTER_S)
            said = json.loads(answer.value.read())
            assert said["status"] == "starting" and said["phase"].startswith("held until"), said
        page = first_answer(url, proc)  # a browser: the starting page, with the phase that runs
        assert placeholder.MARK in page and "held until" in page
        assert not any("Running on" in line for line in lines)

        release.touch()
        scope: dict = {}
        exec(compile(docs_client_example().replace(DOCS_URL, url), "docs/app.md", "exec"), scope)
        assert scope["event"]["type"] == "summary" and scope["event"]["text"], scope["event"]
        with urllib.request.urlopen(url + "healthz", timeout=60) as health:  # now answered by gradio's app
            assert health.status == 200
            assert json.loads(health.read()) == {"status": "ready", "calibration": warmup.SKIPPED}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_run_pressed_while_the_start_calibrates_waits_then_matches_plain_decoding(embedded_lm):
    gate = threading.Event()
    with served(embedded_lm) as (app, url), sync_playwright() as p:
        app.warmup = warmup.Warmup(hold=gate.wait)
        first, second = app.preset_runs(embedded_lm)[:2]
        app.warmup.start(embedded_lm, [first, second])  # two presets keep the test short; the first is Run's
        browser = p.chromium.launch(executable_path=chromium_path(), args=ARGS)
        page = visitor(browser, 1400, 1000)
        page.goto(url)
        page.wait_for_function("document.querySelector('#sg-startup')?.innerText.includes('1 of 2')",
                               timeout=TIMEOUT_MS)
        page.click("#run")  # the first preset: the one calibrated before the hold
        page.wait_for_function("document.querySelector('#sg-status')?.innerText.startsWith("
                               "'waiting for the start\\'s calibration')", timeout=TIMEOUT_MS)
        assert "calibrating the demo presets: 1 of 2" in page.locator("#sg-status").inner_text()
        assert not page.locator("#sg-method-tokens .sg-tok").count()  # nothing decoded while it waits
        gate.set()
        page.wait_for_function("document.querySelector('#sg-status')?.innerText.startsWith('done')",
                               timeout=TIMEOUT_MS)
        assert app.warmup.state == warmup.DONE
        assert "waited" in page.locator("#sg-status").inner_text()
        verdict = page.locator("#speedup").inner_text()
        assert "identical to baseline" in verdict and "predicted" in verdict and "uncalibrated" not in verdict
        page.wait_for_function("document.querySelector('#sg-startup')?.innerText.includes("
                               "'calibrated at start: 2 presets')", timeout=TIMEOUT_MS)
        browser.close()

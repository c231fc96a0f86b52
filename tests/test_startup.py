"""The app's first minute: `python app.py` answers at its address from the start (a starting page that brings the app
in by itself), serves its page before the demo presets' calibration ends, the page and the terminal say how far it
is, and a Run pressed meanwhile waits for it in a real chromium, then ends identical to plain decoding and priced by
the finished calibration.

Neither verdict rests on the machine's speed: the calibration is held after its first preset (SPECGUI_CALIBRATION_HOLD
for the served app.py, a `threading.Event` for the page in this process) until the test has seen what it checks."""

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from playwright.sync_api import sync_playwright
from test_browser import visitor
from ui_helpers import served

from specgui import REPO_DIR
from specgui.picture import chromium_path
from specgui.ui import controls, placeholder, warmup

START_TIMEOUT_S = 600  # bounds, not verdicts: a busy two-core machine took minutes to import and load
TIMEOUT_MS = START_TIMEOUT_S * 1000
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
PRESETS = len(controls.presets(controls.examples()))  # what app.py calibrates (configs/demos.yaml)


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
    """The first page the address answers with, asked every 0.1 s from the app's start."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=60) as answer:
                assert answer.status == 200
                return answer.read().decode("utf-8")
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"app.py never answered at {url} (exit {proc.poll()})")


def test_app_py_serves_the_page_while_the_calibration_runs_and_says_when_it_ends(embedded_lm, tmp_path):
    # embedded_lm: the session's cache holds the converted weights and the built kernel (a warm start)
    release = tmp_path / "release"
    port = free_port()
    env = {**os.environ, warmup.HOLD_ENV: str(release), "GRADIO_SERVER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
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
                                   f"'calibrating the demo presets: 1 of {PRESETS}')", timeout=TIMEOUT_MS)
            assert page.locator("#sg-startup progress").is_visible()
            assert not any("calibration: done" in line for line in lines)
            release.touch()
            page.wait_for_function("document.querySelector('#sg-startup')?.innerText.includes("
                                   f"'calibrated at start: {PRESETS} presets')", timeout=TIMEOUT_MS)
            browser.close()
        read_until(lines, proc, f"calibration: done, {PRESETS} presets in")
        output = "".join(lines)
        assert output.index("Running on") < output.index("calibrating the demo presets …")  # the page first
        assert "the page is up; calibrating the demo presets in the background" in output
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

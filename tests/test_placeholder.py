"""The starting page answers a browser with the page and tells every other request to wait (503, Retry-After, the
phase that runs as JSON), served in this process on a free port: every Accept and method a client or probe sends,
without starting the app (tests/test_startup.py starts app.py itself)."""

import json
import socket
import urllib.request
from urllib.error import HTTPError

import pytest

from specgui.core import progress
from specgui.ui import placeholder

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"  # chromium's, navigating


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(url: str, method: str = "GET", accept: str | None = None, data: bytes | None = None) -> tuple[int, dict, bytes]:
    """Status, headers and body of one request, a refusal's included."""
    headers = {"Accept": accept} if accept is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=30) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except HTTPError as refused:
        return refused.code, dict(refused.headers), refused.read()


@pytest.mark.parametrize(("accept", "page"), [
    (BROWSER, True), ("text/html", True), ("application/xhtml+xml;q=0.5", True), ("TEXT/HTML; q=1.0", True),
    ("", False), ("*/*", False), ("application/json", False), ("text/html;q=0, application/json", False),
    ("text/plain, image/*", False)])
def test_only_an_accept_that_names_html_asks_for_the_page(accept, page):
    assert placeholder.accepts_page(accept) is page


def test_the_starting_page_answers_a_browser_and_tells_every_other_request_to_wait(monkeypatch):
    port = free_port()
    monkeypatch.setenv("GRADIO_SERVER_NAME", "127.0.0.1")
    monkeypatch.setenv("GRADIO_SERVER_PORT", str(port))
    url = f"http://127.0.0.1:{port}/"
    starting = placeholder.serve()
    try:
        with progress.phase("loading the default model (tiny)"):
            status, headers, body = ask(url + "?view=stage", accept=BROWSER)
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            assert placeholder.MARK in body.decode() and "loading the default model (tiny)" in body.decode()
            assert ask(url, "HEAD", accept=BROWSER)[::2] == (200, b"")

            refused = [ask(url), ask(url + "config"), ask(url + "gradio_api/info", accept="application/json"),
                       ask(url + "gradio_api/call/generate", "POST", data=b"x" * 200_000),  # read, not reset
                       ask(url + "gradio_api/queue/join", "OPTIONS"), ask(url + "healthz", "PUT", data=b"{}")]
            for status, headers, body in refused:
                assert status == 503 and headers["Retry-After"] == str(placeholder.RETRY_AFTER_S)
                said = json.loads(body)
                assert said["status"] == "starting" and said["health"] == placeholder.HEALTH_PATH
                assert said["phase"].startswith("loading the default model (tiny), ") and len(said["phases"]) == 1
            assert ask(url + "healthz", "HEAD")[::2] == (503, b"")
    finally:
        starting.stop()
    with socket.socket() as s:  # stop() frees the address for gradio, which binds it as here (uvicorn reuses it)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))

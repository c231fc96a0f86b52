"""The address answers from the start: a small page that says what the app is doing until the real page takes over.

Why: importing torch, transformers and gradio alone takes ~10 s on a 2-core machine (AMD EPYC, warm cache), then the
model loads and the page is built; until gradio listens, a browser opened on the address (a demo's projector, a Space's
visitor) gets "unable to connect". This stdlib server (nothing heavy imported, so it listens within a fraction of a
second of `python app.py`) answers a browser with the phases running now (`progress.BOARD`, what the terminal's
bars show) and asks again every second; `stop()` frees the address right before gradio binds it, and the first answer
that is not this page's brings the real page in. (A reload instead of a request would have met the second between the
two servers with the browser's "unable to connect", which reloads no more.) It listens where gradio will
(`GRADIO_SERVER_NAME`, `GRADIO_SERVER_PORT`, gradio's defaults).

Only a browser gets the page: a GET that accepts HTML. Every other request (`/config`, the API, a POST, a client
that asks for JSON, a probe that accepts anything) is told to wait: 503, `Retry-After` and a small JSON body naming
the phase that runs. A 200 there would pass the starting page off as the app: gradio_client read it as its config and
failed on JSON, and a readiness probe took the app for up. `HEALTH_PATH` says the same while starting (503) and, by
`health_route` added to gradio's app, 200 once the app serves the address.
"""

from __future__ import annotations

import html
import json
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from specgui.core import progress

MARK = 'id="sg-starting"'
HEALTH_PATH = "/healthz"  # 503 while starting, 200 once the app serves the address (a Space's or container's probe)
RETRY_AFTER_S = 2  # what a 503 asks a client to wait before it asks again
HOLD_ENV = "SPECGUI_START_HOLD"  # FILE: the start waits, starting page up, before it builds the page until FILE exists
PAGE_TYPES = ("text/html", "application/xhtml+xml")  # what a browser's Accept names for a page
MAX_DRAINED_BYTES = 1 << 20  # a refused request's body read up to this, so closing does not reset the answer
PAGE = r"""<!doctype html><html><head><meta charset="utf-8"><title>SpecGUI is starting</title></head>
<body style="font-family: system-ui, sans-serif; margin: 3em; color: #222">
<h1>SpecGUI is starting</h1><p MARK>{lines}</p>
<p style="color: #777">The app appears here as soon as it is up.</p>
<script>
async function poll() {
  try {
    const text = await (await fetch(location.href, {cache: "no-store", headers: {Accept: "text/html"}})).text();
    if (!text.includes('MARK')) { location.reload(); return; }
    const found = text.match(/<p MARK>([\s\S]*?)<\/p>/);
    if (found) document.getElementById("sg-starting").innerHTML = found[1];
  } catch (e) {}  // between this server and the app's: ask again
  setTimeout(poll, 1000);
}
setTimeout(poll, 1000);
</script></body></html>""".replace("MARK", MARK)


def accepts_page(accept: str) -> bool:
    """Does an Accept header name HTML (with a quality above 0)? A browser's navigation does; gradio_client, curl,
    a probe and `fetch` without headers send `*/*` or nothing, and are answered as clients, not as visitors."""
    for part in accept.split(","):
        media, *params = (piece.strip().lower() for piece in part.split(";"))
        if media in PAGE_TYPES:
            quality = next((p.partition("=")[2] for p in params if p.startswith("q=")), "1")
            try:
                if float(quality) > 0:
                    return True
            except ValueError:
                return True  # a malformed quality: the default's 1
    return False


def starting_state() -> dict[str, Any]:
    """What a refused request is told: the app is starting, in which phase (the innermost running), and every phase
    running now with its count and seconds (`progress.BOARD`, what the page and the terminal show)."""
    lines = [p.line() for p in progress.BOARD.now()]
    return {"status": "starting", "phase": lines[-1] if lines else "starting", "phases": lines,
            "retry_after_s": RETRY_AFTER_S, "health": HEALTH_PATH}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if not accepts_page(self.headers.get("Accept", "")):
            self._wait()
            return
        lines = "<br>".join(html.escape(p.line()) for p in progress.BOARD.now()) or "starting"
        self._answer(200, "text/html; charset=utf-8", PAGE.replace("{lines}", lines).encode("utf-8"))

    def do_HEAD(self) -> None:
        self.do_GET()

    def _wait(self) -> None:
        """503, Retry-After and `starting_state()` as JSON: the app is not there yet, ask again."""
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= MAX_DRAINED_BYTES:
            self.rfile.read(int(length))  # unread bytes at close would reset the connection under the answer
        self._answer(503, "application/json", json.dumps(starting_state()).encode("utf-8"),
                     {"Retry-After": str(RETRY_AFTER_S)})

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _wait

    def _answer(self, status: int, kind: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the terminal shows the phases, not every reload


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True  # its closed connections must not hold the address gradio binds next
    daemon_threads = True


class Placeholder:
    """The starting page, served in a daemon thread from `serve()` until `stop()`."""

    def __init__(self, server: _Server | None) -> None:
        self.server = server

    def stop(self) -> None:
        """Stop answering and free the address (gradio binds it next); idempotent."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def serve() -> Placeholder:
    """Answer at gradio's address at once. Where the address cannot be bound (taken, or not allowed), nothing is
    served and the start goes on as before: gradio then says what is wrong with the address."""
    host = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    try:
        port = int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
        server = _Server((host, port), _Handler)
    except (OSError, ValueError):
        return Placeholder(None)
    threading.Thread(target=server.serve_forever, name="specgui-placeholder", daemon=True).start()
    return Placeholder(server)


def health_route(ready: Callable[[], dict[str, Any]]) -> Any:
    """`HEALTH_PATH` on gradio's app (a starlette `Route`, for `launch(app_kwargs={"routes": [...]})`, so that it is
    there before gradio listens): 200 and `{"status": "ready", **ready()}` as JSON. The starting page answers the
    same path with 503 until `stop()`, so a probe reads "ready" exactly when the app serves the address. Starlette is
    imported here, not at the top: this module must load before gradio does."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ready", **ready()}, headers={"Cache-Control": "no-store"})

    return Route(HEALTH_PATH, health, methods=["GET", "HEAD"])

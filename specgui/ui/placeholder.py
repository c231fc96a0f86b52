"""The address answers from the start: a small page that says what the app is doing until the real page takes over.

Why: importing torch, transformers and gradio alone takes ~10 s on a 2-core machine (AMD EPYC, warm cache), then the
model loads and the page is built; until gradio listens, a browser opened on the address (a demo's projector, a Space's
visitor) gets "unable to connect". This stdlib server (nothing heavy imported, so it listens within a fraction of a
second of `python app.py`) answers every request with the phases running now (`progress.BOARD`, what the terminal's
bars show) and asks again every second; `stop()` frees the address right before gradio binds it, and the first answer
that is not this page's brings the real page in. (A reload instead of a request would have met the second between the
two servers with the browser's "unable to connect", which reloads no more.) It listens where gradio will
(`GRADIO_SERVER_NAME`, `GRADIO_SERVER_PORT`, gradio's defaults).
"""

from __future__ import annotations

import html
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from specgui import progress

MARK = 'id="sg-starting"'
PAGE = r"""<!doctype html><html><head><meta charset="utf-8"><title>SpecGUI is starting</title></head>
<body style="font-family: system-ui, sans-serif; margin: 3em; color: #222">
<h1>SpecGUI is starting</h1><p MARK>{lines}</p>
<p style="color: #777">The app appears here as soon as it is up.</p>
<script>
async function poll() {
  try {
    const text = await (await fetch(location.href, {cache: "no-store"})).text();
    if (!text.includes('MARK')) { location.reload(); return; }
    const found = text.match(/<p MARK>([\s\S]*?)<\/p>/);
    if (found) document.getElementById("sg-starting").innerHTML = found[1];
  } catch (e) {}  // between this server and the app's: ask again
  setTimeout(poll, 1000);
}
setTimeout(poll, 1000);
</script></body></html>""".replace("MARK", MARK)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        lines = "<br>".join(html.escape(p.line()) for p in progress.BOARD.now()) or "starting"
        body = PAGE.replace("{lines}", lines).encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
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

"""SpecGUI app entry point: `python app.py` serves the page on http://127.0.0.1:7860 (Hugging Face Spaces too).

The page lives in `specgui/ui/`; this file only loads the default model up front (so the first visitor
does not wait for it) and launches with the page's theme and stylesheet. Set GRADIO_SERVER_NAME /
GRADIO_SERVER_PORT to change where it listens; SPECGUI_DEFAULT_MODEL, SPECGUI_ALLOWED_MODELS and
SPECGUI_PUBLIC set the deployment policy (see specgui/hosting.py).
"""

from __future__ import annotations

# hosting first: on ZeroGPU `spaces` must be imported before anything imports torch or gradio
from specgui import hosting  # noqa: F401  (imported for that side effect; the page reads its policy)
from specgui.errors import SpecGUIError
from specgui.ui import runs
from specgui.ui.page import App, launch_options, queue_options


def main() -> None:
    app = App()
    try:
        lm = app.store.get(app.default_model)
        # the demo presets' first runs priced as well as a bench's: a warm-up of each, as a bench's (`runs.calibrate`)
        runs.calibrate(lm, [(p.example.row.encode(lm.tokenizer), p.method, p.params) for p in app.presets.values()])
    except SpecGUIError as exc:  # the page still opens: traces replay without a model, another can be named
        print(f"warning: {exc}")
    app.build().queue(**queue_options()).launch(**launch_options())


if __name__ == "__main__":
    main()

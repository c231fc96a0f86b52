"""SpecGUI app entry point: `python app.py` serves the page on http://127.0.0.1:7860 (Hugging Face Spaces too).

The page lives in `specgui/ui/`; this file loads the default model, launches the page at once with its theme and
stylesheet (until then a starting page answers at the address: `specgui.ui.placeholder`), and only then calibrates
the demo presets in the background on the device thread (`specgui.ui.warmup`): the page answers while it
calibrates, says how far it is, and a Run pressed meanwhile waits for it. Every slow phase of a start prints a line
and a bar (`specgui.core.progress`). `--no-calibrate` (or SPECGUI_NO_CALIBRATE=1, for a Space) skips the calibration for
quick restarts. Set GRADIO_SERVER_NAME / GRADIO_SERVER_PORT to change where it listens; SPECGUI_DEFAULT_MODEL,
SPECGUI_ALLOWED_MODELS and SPECGUI_PUBLIC set the deployment policy (see specgui/model/hosting.py). `/healthz`
answers 503 while the app starts and 200 once it serves the page (a probe's path); SPECGUI_START_HOLD=FILE holds the
start, the starting page up, until FILE exists (how a test catches the starting page on any machine).
"""

from __future__ import annotations

import argparse
import os
import sys

from specgui.core import progress

# hosting first: on ZeroGPU `spaces` must be imported before anything imports torch or gradio
from specgui.model import hosting
from specgui.ui import placeholder

progress.to_terminal()
starting = placeholder.serve()  # the address answers at once, with these phases, until the page takes it over
with progress.phase("starting SpecGUI: importing torch, transformers and gradio"):  # seconds on a small machine
    from specgui.errors import SpecGUIError
    from specgui.ui import warmup
    from specgui.ui.page import App, launch_options, queue_options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the SpecGUI page.")
    parser.add_argument("--no-calibrate", action="store_true",
                        help=f"skip the demo presets' calibration at start (quick restarts; also "
                             f"{warmup.NO_CALIBRATE_ENV}=1): predictions then come from the raw cost profile")
    args = parser.parse_args(argv)
    app = App()
    lm = None
    try:
        with progress.phase(f"loading the default model ({app.default_model})"):
            lm = app.store.get(app.default_model)
    except SpecGUIError as exc:  # the page still opens: traces replay without a model, another can be named
        print(f"warning: {exc}", file=sys.stderr)
    if os.environ.get(placeholder.HOLD_ENV):
        with progress.phase(f"held until {os.environ[placeholder.HOLD_ENV]} exists ({placeholder.HOLD_ENV})"):
            warmup.held_by_file(os.environ[placeholder.HOLD_ENV])()
    with progress.phase("building and serving the page"):
        demo = app.build().queue(**queue_options())
        health = placeholder.health_route(lambda: {"calibration": app.warmup.state})  # there before gradio listens
        starting.stop()
        demo.launch(prevent_thread_lock=True, app_kwargs={"routes": [health]}, **launch_options())
    if lm is None:
        app.warmup.skip("no model loaded")
    elif args.no_calibrate or warmup.skipped_by_environment():
        app.warmup.skip("--no-calibrate" if args.no_calibrate else f"{warmup.NO_CALIBRATE_ENV} is set")
    else:
        where = " inside a ZeroGPU call" if hosting.on_zero_gpu() else ""
        print(f"the page is up; calibrating the demo presets in the background{where} (a Run waits for it)",
              file=sys.stderr, flush=True)
        app.start_warmup(lm)
        app.warmup.job.add_done_callback(lambda _: print(f"calibration: {app.warmup.state}, {app.warmup.detail}",
                                                         file=sys.stderr, flush=True))
    demo.block_thread()


if __name__ == "__main__":
    main()

"""The Gradio app, built only from the decoding core's events.

    view      events -> what each component shows (token marks, per-step internals, comparison); no gradio
    render    views -> HTML (every model or user string escaped)
    charts    views -> plotly figures
    runs      the run controller: one shared model, decoding in a worker thread, a baseline cache, replay
    controls  input widgets built from each method's `Params` metadata and `configs/` presets
    compare   the suite across methods (the Compare tab)
    page      the page layout and its event handlers; `app.py` launches it
    warmup    the demo presets' calibration at start, in the background once the page is up

Decoding never waits for rendering: a worker thread runs `decode.generate` into a queue and the page
drains it every few hundred milliseconds, so a slow browser costs frames, not tokens per second.
"""

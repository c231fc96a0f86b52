"""SpecGUI: see self-speculative decoding work, step by step.

The package is one decoding core (`runner`, `verify`, `decode`, `events`) with drafting methods behind
a registry (`specgui.methods`), and front ends that only consume its events (CLI, bench, Gradio app).
"""

__version__ = "0.1.0"

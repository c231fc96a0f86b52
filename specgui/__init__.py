"""SpecGUI: see self-speculative decoding work, step by step.

The package is one decoding core (`runner`, `verify`, `decode`, `events`) with drafting methods behind
a registry (`specgui.methods`), and front ends that only consume its events (CLI, bench, Gradio app).
"""

from pathlib import Path

__version__ = "0.1.0"

# Data that ships beside the package (prompt suites, corpus caches, the stylesheet) and the method presets.
REPO_DIR = Path(__file__).resolve().parent.parent
ASSETS_DIR = REPO_DIR / "assets"

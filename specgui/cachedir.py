"""Where SpecGUI keeps what it makes once per machine: converted weights, cost profiles, matmul choices and the
compiled matmul kernel, skip-set searches. Its own module because the lowest layers (`kernels`) need it too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SPECGUI_CACHE, else $XDG_CACHE_HOME/specgui, else ~/.cache/specgui."""
    if os.environ.get("SPECGUI_CACHE"):
        return Path(os.environ["SPECGUI_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specgui"

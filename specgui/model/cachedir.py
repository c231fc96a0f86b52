"""Where SpecGUI keeps what it makes once per machine: converted weights, cost profiles, matmul choices and the
compiled matmul kernel, skip-set searches. Its own module because the lowest layers (`kernels`) need it too."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


def cache_root() -> Path:
    """$SPECGUI_CACHE, else $XDG_CACHE_HOME/specgui, else ~/.cache/specgui."""
    if os.environ.get("SPECGUI_CACHE"):
        return Path(os.environ["SPECGUI_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specgui"


@contextlib.contextmanager
def exclusive(target: Path) -> Iterator[None]:
    """Hold `target`'s lock file while making it: two processes sharing a cache (the app's workers, a Space and
    a CLI, the test suite's workers) that both miss it measure it once, the second waiting and then reading
    what the first wrote, instead of both measuring at once and each slowing the other's timings.
    Where the OS has no `fcntl` (Windows) there is no lock: at worst both measure, as before."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(target.with_name(target.name + ".lock"), "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

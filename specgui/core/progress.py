"""Slow phases said aloud: a line and a progress bar in the terminal, and the same phase held for the page to show.

Why: a first start converts a GGUF, builds a C kernel, measures a cost profile and calibrates the demo presets, each
for seconds to a minute; a terminal that says nothing for 80 s and a page that cannot say what it waits for read as a
hang. Every such phase runs inside `phase(...)`: while it runs it is on `BOARD` (what the page's start line reads,
`specgui.ui.warmup`) and, once `to_terminal()` was called (app.py and the CLI call it; the library alone prints
nothing), a tqdm bar on stderr that a ticker redraws twice a second, so a phase of one long step still shows its
seconds passing. `advance` moves a phase with a count (n of N) and names the item it is on.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

TICK_S = 0.5  # how often a bar is redrawn, so that a phase of one long step shows its time passing
BAR = "  {percentage:3.0f}%|{bar:24}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}"
CLOCK = "  {elapsed} elapsed"


@dataclass
class Phase:
    """One slow phase: what it does, how far along it is (`done` of `total`, None: one step) and the item it is on."""

    what: str
    total: int | None = None
    done: int = 0
    item: str = ""
    started: float = field(default_factory=time.monotonic)
    bar: Any = None  # its tqdm bar where the terminal shows phases

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def line(self) -> str:
        """'measuring the cost profile: 2 of 4 (forwards at 1024 tokens), 6 s' or 'building the C kernel, 12 s'."""
        count = f": {self.done} of {self.total}" if self.total else ""
        item = f" ({self.item})" if self.item else ""
        return f"{self.what}{count}{item}, {self.elapsed_s:.0f} s"


class Board:
    """The phases running now, oldest first (a phase may run inside another: the profile inside the calibration)."""

    def __init__(self) -> None:
        self._phases: list[Phase] = []
        self._lock = threading.Lock()
        self._terminal = False
        self._ticker: threading.Thread | None = None

    def to_terminal(self) -> None:
        """Print every phase from now on as a line and a bar on stderr."""
        with self._lock:
            self._terminal = True
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="specgui-progress", daemon=True)
                self._ticker.start()

    def now(self) -> list[Phase]:
        with self._lock:
            return list(self._phases)

    @contextmanager
    def phase(self, what: str, total: int | None = None) -> Iterator[Phase]:
        current = Phase(what, total)
        with self._lock:
            if self._terminal:
                from tqdm import tqdm

                print(f"{what} …", file=sys.stderr, flush=True)
                current.bar = tqdm(total=total, file=sys.stderr, leave=False, bar_format=BAR if total else CLOCK)
            self._phases.append(current)
        try:
            yield current
        finally:
            with self._lock:
                self._phases.remove(current)
                if current.bar is not None:
                    current.bar.close()
                    print(f"{what}: done in {current.elapsed_s:.1f} s", file=sys.stderr, flush=True)

    def advance(self, phase: Phase, item: str = "", by: int = 1) -> None:
        """`phase` is `by` steps further along, now on `item`."""
        with self._lock:
            phase.done += by
            phase.item = item
            if phase.bar is not None:
                phase.bar.set_postfix_str(item, refresh=False)
                phase.bar.update(by)

    def _tick(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._lock:
                for current in self._phases:
                    if current.bar is not None:
                        current.bar.refresh()


BOARD = Board()
phase = BOARD.phase
advance = BOARD.advance
to_terminal = BOARD.to_terminal

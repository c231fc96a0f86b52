"""The Compare tab: the built-in suite (or one category) across chosen methods, via `specgui.tools.bench`.

A paper preset (`specgui.tools.papers`) replaces the methods and categories by a seed paper's comparison set and
lays the table out as that paper does, its own reported numbers beside ours.

The numbers are exactly the CLI's `bench` (same warm-up, rotation and medians), so the tab and the
README's tables agree. Stop works through bench's `progress` callback: it raises `Stopped` between runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from specgui.core.sampling import Sampling
from specgui.model import hosting
from specgui.model.loading import LoadedModel
from specgui.tools import bench, papers
from specgui.tools.papers import PaperPreset
from specgui.tools.prompts import PromptRow, select

ALL = "all categories"
COLUMNS = ["method", "category", "tok/s", "speedup", "tau", "acceptance", "identical"]
NO_PRESET = "none (the methods and category above)"


class Stopped(Exception):
    """Raised from the progress callback when the user pressed Stop."""


def pick_rows(rows: list[PromptRow], category: str, per_category: int) -> list[PromptRow]:
    """The first `per_category` prompts of each category (or of the chosen one)."""
    return select(rows, None if category == ALL else [category], per_category)


Progress = Callable[[dict[str, int], int], None]  # (runs done per method, runs each method will make)


def choose(suite: list[PromptRow], names: list[str], category: str, per_category: int,
           preset: str) -> tuple[list[PromptRow], list[str], PaperPreset | None]:
    """The prompts and methods a run uses: a paper preset's (configs/papers/), or those picked in the tab."""
    if preset and preset != NO_PRESET:
        paper = papers.load(preset)
        return select(suite, paper.categories, per_category), list(paper.methods), paper
    return pick_rows(suite, category, per_category), names, None


@hosting.gpu(duration=300)  # a suite is many runs: one GPU slice for all of them
def run_suite(lm: LoadedModel, rows: list[PromptRow], names: list[str], *, max_new_tokens: int, repeats: int,
              sampling: Sampling, progress: Progress, stop: threading.Event) -> dict[str, Any]:
    """Bench `names` (baseline added) on `rows`; `progress(done per method, runs per method)` after every run."""
    chosen = bench.entries_for(names)
    done = dict.fromkeys((e.label for e in chosen), 0)

    def ran(entry: bench.Entry, row: PromptRow) -> None:
        done[entry.label] += 1
        progress(dict(done), len(rows) * repeats)
        if stop.is_set():
            raise Stopped

    settings = bench.Settings(max_new_tokens=max_new_tokens, repeats=repeats, sampling=sampling)
    return bench.bench(lm, rows, chosen, settings, progress=ran)


def progress_text(done: dict[str, int], per_method: int) -> str:
    """'baseline 3/7 · pld 2/7 · …': how far each method is (methods take turns, so they move together)."""
    return " · ".join(f"{label} {n}/{per_method}" for label, n in done.items())


def table(report: dict[str, Any]) -> list[list[Any]]:
    """One row per (method, category), then each method's overall row (left out for one category: the same row)."""

    def row(name: str, category: str, agg: dict[str, Any]) -> list[Any]:
        tau = round(agg["mean_accepted"], 2) if agg["mean_accepted"] is not None else None
        acceptance = f"{agg['acceptance_rate']:.0%}" if agg["acceptance_rate"] is not None else "-"
        identical = f"{agg['identical']}/{agg['total']}" if agg["identical"] is not None else "n/a"
        return [name, category, round(agg["tokens_per_s"], 2), round(agg["speedup"], 2), tau, acceptance, identical]

    rows = [row(name, cat, per[name]) for cat, per in report["categories"].items() for name in per]
    if len(report["categories"]) > 1:
        rows += [row(name, "overall", agg) for name, agg in report["methods"].items()]
    return rows


def result_table(report: dict[str, Any], preset: PaperPreset | None) -> dict[str, list]:
    """The table for the tab: the plain one, or the paper's layout with ours and the paper's numbers."""
    if preset is None:
        return {"headers": COLUMNS, "data": table(report)}
    headers, rows = papers.table(report, preset)
    return {"headers": headers, "data": rows}

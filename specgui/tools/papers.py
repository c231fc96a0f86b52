"""Paper presets: each seed paper's own comparison, run here and laid out as the paper lays out its table.

A preset (`configs/papers/<name>.yaml`) names the paper's comparison set (our method -> the paper's name
for it), the paper's columns mapped onto the suite's categories, the figures per cell, the layout, and the
paper's own reported numbers with the setting they were measured in. `bench --preset NAME` and the Compare
tab run the preset's methods on the preset's categories with the ordinary bench (so the numbers are the
bench's), then `table` puts ours and the paper's side by side, each row saying whose it is:

  layout "methods":    a row per method, a group of figures per paper column, optionally overall speedup
                       (CLaSp's Table 1, ASD's Tables 3-4)
  layout "benchmarks": a row per benchmark, baseline throughput, then a group of figures per method
                       (Self-Draft's Table 2)

Where two paper columns map to one category (CNN/DM and XSum are both summarization here), the category is
one column group and the paper's cell shows both of its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import yaml

from specgui import methods
from specgui.errors import SpecGUIError
from specgui.methods.presets import CONFIG_DIR
from specgui.tools import bench

PAPERS_DIR = CONFIG_DIR / "papers"
LAYOUTS = ("methods", "benchmarks")
METRIC_NAMES = {"tau": "τ", "speedup": "speedup", "tok_s": "tok/s", "improvement": "Imp."}


@dataclass(frozen=True)
class PaperPreset:
    name: str
    title: str
    layout: str
    metrics: tuple[str, ...]
    metric_names: dict[str, str]
    overall: bool
    methods: dict[str, str]  # our method -> the paper's name, in the paper's order (baseline first)
    columns: dict[str, str]  # the paper's column -> our suite category
    setting: str  # where and on what the paper measured its numbers
    reported: dict[str, dict[str, dict[str, float]]]  # paper name -> paper column or row -> metric -> value

    @property
    def categories(self) -> list[str]:
        return list(dict.fromkeys(self.columns.values()))

    def entries(self) -> list[bench.Entry]:
        return bench.entries_for(list(self.methods))

    def paper_columns(self, category: str) -> list[str]:
        return [col for col, cat in self.columns.items() if cat == category]


def names() -> list[str]:
    """The presets under configs/papers/, by file name."""
    return sorted(p.stem for p in PAPERS_DIR.glob("*.yaml"))


@cache
def load(name: str) -> PaperPreset:
    """Read and check one preset; every problem is one line naming the file."""
    path = PAPERS_DIR / f"{name}.yaml"
    if name not in names():
        raise SpecGUIError(f"unknown paper preset {name!r}: choose from {', '.join(names()) or 'none'}")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    where = f"configs/papers/{name}.yaml"
    try:
        preset = PaperPreset(
            name=name, title=str(data["title"]), layout=data["layout"], metrics=tuple(data["metrics"]),
            metric_names={**METRIC_NAMES, **(data.get("metric_names") or {})}, overall=bool(data.get("overall")),
            methods=dict(data["methods"]), columns=dict(data["columns"]), setting=str(data["reported"]["setting"]),
            reported=dict(data["reported"]["rows"]),
        )
    except (KeyError, TypeError) as exc:
        raise SpecGUIError(f"{where}: missing or malformed {exc}") from None
    if preset.layout not in LAYOUTS or not set(preset.metrics) <= set(METRIC_NAMES):
        raise SpecGUIError(f"{where}: layout must be one of {LAYOUTS}, metrics among {', '.join(METRIC_NAMES)}")
    if next(iter(preset.methods), None) != "baseline":
        raise SpecGUIError(f"{where}: the first method must be baseline (every speedup is against it)")
    for method in preset.methods:
        methods.get(method)
    return preset


def _ours(agg: dict[str, Any], metric: str) -> float | None:
    if metric == "tau":
        return agg["mean_accepted"]
    if metric == "improvement":
        return (agg["speedup"] - 1.0) * 100.0
    return agg["tokens_per_s" if metric == "tok_s" else "speedup"]


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "–"
    if metric == "speedup":
        return f"{value:.2f}×"
    if metric == "improvement":
        return f"{value:+.0f}%"
    return f"{value:.1f}" if metric == "tok_s" else f"{value:.2f}"


def _paper(preset: PaperPreset, method: str, cells: list[str], metric: str) -> str:
    """The paper's figure(s) for a method over some of its columns or rows ("–" where it printed none)."""
    row = preset.reported.get(preset.methods[method], {})
    values = [row.get(cell, {}).get(metric) for cell in cells]
    return " / ".join(_fmt(metric, v) for v in values) if any(v is not None for v in values) else "–"


def table(report: dict[str, Any], preset: PaperPreset) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: ours (from a bench report of the preset's entries), then the paper's."""
    return (_by_method if preset.layout == "methods" else _by_benchmark)(report, preset)


def _by_method(report: dict[str, Any], preset: PaperPreset) -> tuple[list[str], list[list[str]]]:
    cats = preset.categories
    headers = ["", "method"] + [f"{cat} ({', '.join(preset.paper_columns(cat))}) {preset.metric_names[m]}"
                                for cat in cats for m in preset.metrics]
    if preset.overall:
        headers.append("overall speedup")
    rows = []
    for method, paper_name in preset.methods.items():
        row = ["ours", f"{method} ({paper_name})"]
        row += [_fmt(m, _ours(report["categories"][cat][method], m)) for cat in cats for m in preset.metrics]
        if preset.overall:
            row.append(_fmt("speedup", report["methods"][method]["speedup"]))
        rows.append(row)
    for method, paper_name in preset.methods.items():
        row = ["paper", paper_name] + [_paper(preset, method, preset.paper_columns(cat), m)
                                       for cat in cats for m in preset.metrics]
        if preset.overall:
            row.append(_paper(preset, method, ["overall"], "speedup"))
        rows.append(row)
    return headers, rows


def _by_benchmark(report: dict[str, Any], preset: PaperPreset) -> tuple[list[str], list[list[str]]]:
    base, *others = preset.methods
    names = preset.metric_names
    headers = ["", "benchmark", f"{preset.methods[base]} {names['tok_s']}"]
    headers += [f"{preset.methods[m]} {names[metric]}" for m in others for metric in preset.metrics]
    rows = []
    for cat in preset.categories:
        per = report["categories"][cat]
        row = ["ours", f"{cat} ({', '.join(preset.paper_columns(cat))})", _fmt("tok_s", per[base]["tokens_per_s"])]
        rows.append(row + [_fmt(metric, _ours(per[m], metric)) for m in others for metric in preset.metrics])
    benchmarks = list(dict.fromkeys(b for method in preset.methods.values() for b in preset.reported.get(method, {})))
    for name in benchmarks:
        row = ["paper", name, _paper(preset, base, [name], "tok_s")]
        rows.append(row + [_paper(preset, m, [name], metric) for m in others for metric in preset.metrics])
    return headers, rows


def caption(report: dict[str, Any], preset: PaperPreset) -> str:
    """Whose numbers are whose: our run's setting, the paper's, and how many of our runs matched baseline."""
    checked = [agg for label, agg in report["methods"].items() if label != "baseline" and agg["identical"] is not None]
    same = sum(a["identical"] for a in checked)
    total = sum(a["total"] for a in checked)
    identical = f"; {same}/{total} runs identical to baseline" if checked else ""
    return (f"{preset.title}. ours: {report['model']} on {report['device']}, {report['prompts']} prompts, "
            f"{report['max_new_tokens']} new tokens, median of {report['repeats']}{identical}. {preset.setting}.")


def format_table(report: dict[str, Any], preset: PaperPreset) -> str:
    """The table as plain text, with its caption."""
    headers, rows = table(report, preset)
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [caption(report, preset), ""]
    for r in [headers, *rows]:
        lines.append("  ".join(str(cell).ljust(w) for cell, w in zip(r, widths)).rstrip())
    return "\n".join(lines)

"""Grid measurement: one method under many parameter settings, against `baseline`, in one process.

Self-Draft's best branch count N, branch length L and candidate budget depend on what an extra token in the
forward costs, which differs by orders of magnitude between a GPU and a small CPU (the paper's Fig. 5-7
sweep N and L on an A100). This command sweeps any method's parameters the way `bench` measures methods
(it *is* a `bench` run whose entries are the settings: warm-up excluded, settings take turns per prompt in
a rotating order so drift in machine load spreads evenly, tokens/s = total tokens / total time) and prints
one row per setting, best first:

    python -m specgui.tools.grid --method selfdraft --grid branches=0,1,2 --grid branch_len=2,4 \\
        --set budget=8 --limit 1 --max-new-tokens 48

Every `--grid KEY=V1,V2` multiplies the settings; `--set KEY=V` fixes a value for all of them. The presets
in configs/selfdraft.yaml cite the grids they came from.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specgui import methods
from specgui.cli import Parser, add_model_args, load_model
from specgui.errors import SpecGUIError
from specgui.methods.params import parse_setting, parse_value
from specgui.tools import bench
from specgui.tools.prompts import PromptRow, load_prompts, select


def settings(grid: list[str], fixed: list[str]) -> list[dict[str, Any]]:
    """The cartesian product of `--grid KEY=V1,V2` values, each merged with the `--set KEY=V` values."""
    base = dict(parse_setting(item, f"--set {item!r}: expected KEY=VALUE") for item in fixed)
    axes: list[list[tuple[str, Any]]] = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise SpecGUIError(f"--grid {item!r}: expected KEY=V1,V2,...")
        axes.append([(key, parse_value(v)) for v in values.split(",")])
    return [{**base, **dict(combo)} for combo in itertools.product(*axes)]


def measure(lm, rows: list[PromptRow], method: str, grid: list[dict[str, Any]], max_new_tokens: int,
            progress: Callable[[bench.Entry, PromptRow], None] | None = None, repeats: int = 1) -> list[dict[str, Any]]:
    """Bench baseline and every setting on every prompt (each pair's median of `repeats` runs); return one summary
    per setting, fastest first."""
    entries = [bench.Entry("baseline", "baseline")] + [
        bench.Entry(f"#{i}", method, values) for i, values in enumerate(grid)]
    report = bench.bench(lm, rows, entries, bench.Settings(max_new_tokens=max_new_tokens, repeats=repeats),
                         progress=progress)
    results = []
    for entry in entries[1:]:
        overall = report["methods"][entry.label]
        results.append({
            "params": entry.params, "tokens_per_s": overall["tokens_per_s"], "speedup": overall["speedup"],
            "tau": overall["mean_accepted"] or 1.0, "identical": overall["identical"], "total": overall["total"],
            "categories": {cat: per[entry.label]["speedup"] for cat, per in report["categories"].items()},
        })
    return sorted(results, key=lambda r: -r["speedup"])


def format_table(results: list[dict[str, Any]]) -> str:
    varied = [k for k in results[0]["params"] if len({str(r["params"][k]) for r in results}) > 1] if results else []
    cats = list(results[0]["categories"]) if results else []
    head = " ".join(f"{k[:10]:>10}" for k in varied)
    lines = [f"{head} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'ident':>6}  " + " ".join(f"{c[:8]:>8}" for c in cats)]
    for r in results:
        cells = " ".join(f"{r['params'][k]!s:>10}" for k in varied)
        per = " ".join(f"{r['categories'][c]:>7.2f}x" for c in cats)
        lines.append(f"{cells} {r['tokens_per_s']:>7.2f} {r['speedup']:>7.2f}x {r['tau']:>5.2f} "
                     f"{r['identical']:>2}/{r['total']:<3}  {per}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m specgui.tools.grid", description="Sweep one method's parameters against baseline.")
    parser.add_argument("--method", default="selfdraft")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="values to sweep")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V", help="value fixed for all settings")
    parser.add_argument("--prompts", default="suite", help="JSONL file, or 'suite' for the built-in suite")
    parser.add_argument("--categories", default=None)
    parser.add_argument("--limit", type=int, default=1, help="prompts per category (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (prompt, setting) pair, median kept: "
                        "with one, a prompt's single baseline run prices every setting and its noise moves them all")
    parser.add_argument("--json", default=None, metavar="OUT.json")
    add_model_args(parser)
    try:
        args = parser.parse_args(argv)
        methods.get(args.method)
        if args.repeats < 1:
            raise SpecGUIError(f"--repeats must be at least 1, got {args.repeats}")
        grid = settings(args.grid, args.set)
        rows = select(load_prompts(args.prompts), args.categories.split(",") if args.categories else None,
                      args.limit or None)
        lm = load_model(args)
        print(f"{args.method} on {lm.name} ({lm.runner.device}), {len(rows)} prompts, {args.max_new_tokens} new "
              f"tokens, {len(grid)} settings", file=sys.stderr)
        results = measure(lm, rows, args.method, grid, args.max_new_tokens,
                          progress=lambda entry, row: print(".", end="", file=sys.stderr, flush=True),
                          repeats=args.repeats)
        print(file=sys.stderr)
    except SpecGUIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

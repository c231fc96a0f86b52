"""Grid measurement: one method under many parameter settings, against `baseline`, in one process.

Self-Draft's best branch count N, branch length L and candidate budget depend on what an extra token in the
forward costs, which differs by orders of magnitude between a GPU and a small CPU (the paper's Fig. 5-7
sweep N and L on an A100). This command sweeps any method's parameters the way `bench` measures methods
(warm-up excluded, settings take turns per prompt in a rotating order so drift in machine load spreads
evenly, tokens/s = total tokens / total time) and prints one row per setting, best first:

    python -m specgui.grid --method selfdraft --grid branches=0,1,2 --grid branch_len=2,4 \\
        --set budget=8 --limit 1 --max-new-tokens 48

Every `--grid KEY=V1,V2` multiplies the settings; `--set KEY=V` fixes a value for all of them. The presets
in configs/selfdraft.yaml cite the grids they came from.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

from specgui import bench, methods
from specgui.cli import Parser, add_model_args, load_model, parse_value
from specgui.errors import SpecGUIError
from specgui.prompts import BUILTIN_SUITE, PromptRow, load_prompts
from specgui.sampling import GREEDY


def settings(grid: list[str], fixed: list[str]) -> list[dict[str, Any]]:
    """The cartesian product of `--grid KEY=V1,V2` values, each merged with the `--set KEY=V` values."""
    base: dict[str, Any] = {}
    for item in fixed:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecGUIError(f"--set {item!r}: expected KEY=VALUE")
        base[key] = parse_value(value)
    axes: list[list[tuple[str, Any]]] = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise SpecGUIError(f"--grid {item!r}: expected KEY=V1,V2,...")
        axes.append([(key, parse_value(v)) for v in values.split(",")])
    return [{**base, **dict(combo)} for combo in itertools.product(*axes)]


def pick_prompts(path: str, categories: str | None, limit: int | None) -> list[PromptRow]:
    rows = load_prompts(BUILTIN_SUITE if path == "suite" else path)
    if categories:
        keep = {c.strip() for c in categories.split(",") if c.strip()}
        rows = [r for r in rows if r.category in keep]
    if limit:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            seen[r.category] = seen.get(r.category, 0) + 1
            if seen[r.category] <= limit:
                kept.append(r)
        rows = kept
    if not rows:
        raise SpecGUIError("no prompts selected")
    return rows


def measure(lm, rows: list[PromptRow], method: str, grid: list[dict[str, Any]], max_new_tokens: int,
            progress=None) -> list[dict[str, Any]]:
    """Run baseline and every setting on every prompt; return one summary per setting, fastest first."""
    for values in grid:
        methods.params_for(method, lm.name, lm.runner.device.type, values)  # reject bad settings before timing
    encoded = [row.encode(lm.tokenizer) for row in rows]
    entrants: list[tuple[str, dict[str, Any] | None]] = [("baseline", None)] + [(method, g) for g in grid]
    for name, values in entrants[:2]:  # warm-up, excluded
        bench.run_method(lm, rows[0], encoded[0], name, min(16, max_new_tokens), GREEDY, values)
    runs: dict[int, list[bench.Run]] = {i: [] for i in range(len(entrants))}
    for p, (row, ids) in enumerate(zip(rows, encoded)):
        order = list(range(len(entrants)))
        shift = p % len(order)
        for i in order[shift:] + order[:shift]:
            name, values = entrants[i]
            runs[i].append(bench.run_method(lm, row, ids, name, max_new_tokens, GREEDY, values))
            if progress is not None:
                progress()
    base = runs[0]
    base_rate = sum(len(r.tokens) for r in base) / sum(r.wall for r in base)
    results = []
    for i, (_, values) in enumerate(entrants[1:], start=1):
        group = runs[i]
        rate = sum(len(r.tokens) for r in group) / sum(r.wall for r in group)
        per_category: dict[str, float] = {}
        for cat in dict.fromkeys(r.category for r in group):
            mine = [r for r in group if r.category == cat]
            theirs = [r for r in base if r.category == cat]
            per_category[cat] = (sum(len(r.tokens) for r in mine) / sum(r.wall for r in mine)) / (
                sum(len(r.tokens) for r in theirs) / sum(r.wall for r in theirs))
        steps = sum(r.steps for r in group)
        results.append({
            "params": values, "tokens_per_s": rate, "speedup": rate / base_rate,
            "tau": sum(r.emitted_in_steps for r in group) / steps if steps else 1.0,
            "identical": sum(r.tokens == b.tokens for r, b in zip(group, base)), "total": len(group),
            "categories": per_category,
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
    parser = Parser(prog="python -m specgui.grid", description="Sweep one method's parameters against baseline.")
    parser.add_argument("--method", default="selfdraft")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="values to sweep")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V", help="value fixed for all settings")
    parser.add_argument("--prompts", default="suite", help="JSONL file, or 'suite' for the built-in suite")
    parser.add_argument("--categories", default=None)
    parser.add_argument("--limit", type=int, default=1, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", default=None, metavar="OUT.json")
    add_model_args(parser)
    try:
        args = parser.parse_args(argv)
        methods.get(args.method)
        grid = settings(args.grid, args.set)
        rows = pick_prompts(args.prompts, args.categories, args.limit)
        lm = load_model(args)
        print(f"{args.method} on {lm.name} ({lm.runner.device}), {len(rows)} prompts, {args.max_new_tokens} new "
              f"tokens, {len(grid)} settings", file=sys.stderr)
        results = measure(lm, rows, args.method, grid, args.max_new_tokens,
                          progress=lambda: print(".", end="", file=sys.stderr, flush=True))
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

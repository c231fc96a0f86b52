"""`python -m specgui report`: render the measured results (`results/<machine>/<kind>.json`) into README.md and docs/.

A document marks where a table goes:

    <!-- report:heldout -->
    (generated: never edit by hand)
    <!-- /report:heldout -->

The name is a result kind (`specgui.tools.results.KINDS`), optionally with a machine folder (`heldout:cpu-amd-epyc-2c`);
without one, the newest file of that kind by its provenance date among the machines' own runs (a run whose skinny
kernels were forced to another vector form, `SPECGUI_SIMD=avx2` on an AVX-512 CPU, is shown only where its folder is
named: `profile:cpu-intel-xeon-processor-2c-avx2`). Everything between the two markers is replaced by
the kind's table and one provenance line taken from the JSON; the markers and everything outside them are never
touched. `--check` changes nothing and lists the blocks whose text differs from what their JSON gives (CI runs it
through the test suite), so a figure in the docs is always the one its command wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specgui import REPO_DIR
from specgui.tools.results import KINDS, RESULTS_DIR, measured_at

BLOCK = re.compile(r"(<!-- report:(?P<name>[\w.:-]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)


def documents(root: Path = REPO_DIR) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def find_result(name: str, results_dir: Path = RESULTS_DIR) -> tuple[dict[str, Any] | None, str]:
    """The JSON a block named `name` renders (None where nothing was measured yet) and its kind."""
    kind, _, machine = name.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown report block {name!r}: kinds are {', '.join(KINDS)}")
    paths = [results_dir / machine / f"{kind}.json"] if machine else sorted(results_dir.glob(f"*/{kind}.json"))
    found = [json.loads(p.read_text(encoding="utf-8")) for p in paths if p.is_file()]
    if not machine:
        found = [data for data in found if not data.get("provenance", {}).get("simd_forced")]
    if not found:
        return None, kind
    return max(found, key=measured_at), kind


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _identical(aggregate: dict[str, Any]) -> str:
    if aggregate.get("identical") is None:
        return "-"
    return f"{aggregate['identical']}/{aggregate['total']}"


def _heldout(data: dict[str, Any]) -> list[str]:
    base = data["methods"]["baseline"]
    rows = [[f"`{label}`", f"{m['tokens_per_s']:.1f}", _x(m["speedup"]), _x(m.get("predicted_speedup")),
             _x(m.get("ceiling")), "-" if m.get("mean_accepted") is None else f"{m['mean_accepted']:.2f}",
             _identical(m)] for label, m in data["methods"].items()]
    return [f"{data['prompts']} held-out prompts (`assets/heldout.jsonl`), {data['max_new_tokens']} new tokens, "
            f"{data['repeats']} runs each (speedups paired by round, tokens/s of the median runs), {data['model']} in "
            f"{data['dtype']} on {data['device']}; plain decoding {base['tokens_per_s']:.1f} tokens/s.", "",
            *_table(["method", "tokens/s", "speedup", "predicted", "ceiling", "tau", "identical"], rows)]


def _presets(data: dict[str, Any]) -> list[str]:
    rows = [[p["name"], f"`{p['method']}`", _x(p["speedup"]), _x(p.get("predicted_speedup")), _x(p.get("ceiling")),
             "-" if p.get("mean_accepted") is None else f"{p['mean_accepted']:.2f}", _identical(p)]
            for p in data["presets"]]
    return [f"Each preset against plain decoding on its own prompt, {data['repeats']} runs each paired by round, "
            f"{data['model']}.", "", *_table(["preset", "method", "speedup", "predicted", "ceiling", "tau",
                                               "identical"], rows)]


def _profile(data: dict[str, Any]) -> list[str]:
    ctx = data["contexts"][0]
    one = data["forward"][0][0]
    rows = [[t, f"{data['forward'][0][i]:.2f}", f"{data['forward'][0][i] / one:.2f}×"]
            for i, t in enumerate(data["sizes"])]
    kernels = f" Skinny kernels: {data['simd']}." if data.get("simd") else ""
    lines = [f"Forward of the {data['model']} over {ctx} cached tokens by new rows; a plain step {data['step']:.2f} ms "
             f"(loop {data['loop']:.2f} ms beyond its forward), LM head {data['head']:.2f} ms.{kernels}", "",
             *_table(["rows", "forward ms", "vs one row"], rows)]
    if data.get("draft_tokens"):
        tokens = data["draft_tokens"]
        cells = [[r["layers"], f"{r['full_ms']:.2f} ({r['full_priced_ms']:.2f})",
                  f"{r['vocab_ms']:.2f} ({r['vocab_priced_ms']:.2f})",
                  f"{r['change']:+.0%} ({r['priced_change']:+.0%})"]
                 for r in tokens["rows"]]
        lines += ["", f"A layer-skip draft token over one row after {tokens['context']} cached tokens, with the full "
                  f"LM head and with a draft vocabulary of {tokens['size']} ids: ms measured beside a plain forward "
                  "and scaled to the profile's price of it, priced by the profile in brackets.", "",
                  *_table(["layers skipped", "full head", "draft vocabulary", "change"], cells)]
    return lines


def _suite(data: dict[str, Any]) -> list[str]:
    minutes, seconds = divmod(round(data["seconds"]), 60)
    return [f"The suite: {data['passed']} passed, {data['skipped']} skipped, {data['failed']} failed in {minutes} min "
            f"{seconds} s on {data['workers']} workers (exit code {data['exit_code']})."]


def _gpucheck(data: dict[str, Any]) -> list[str]:
    from specgui.tools.gpucheck import summary_table

    return [summary_table(data)]


def _dispatch(data: dict[str, Any]) -> list[str]:
    found = data["sections"]["dispatch"]["dispatch"]
    rows = [[method, f["programs_per_pass_max"], f"{f['programs_per_pass_mean']:.2f}", f"{f['syncs_per_token']:.2f}",
             "yes" if f["programs_per_pass_max"] <= 1 and f["syncs_per_token"] <= 1.0 else "no",
             f"{f['eager_ops_per_step']:.1f}" if "eager_ops_per_step" in f else "-",
             f"{f['waited_launches_per_step']:.2f}" if "waited_launches_per_step" in f else "-",
             *(f"{f[key]:.3f}" if key in f else "-" for key in ("host_ms", "host_critical_ms"))]
            for method, f in found.items()]
    lines = _table(["method", "programs per pass (most)", "programs per pass (mean)", "host reads per token",
                    "one program a pass, at most one read a token", "device operations between programs a step",
                    "steps launched after every verdict was read", "host ms a step", "of which a GPU waits for"], rows)
    layer = data["sections"]["dispatch"].get("compiled")
    if layer:
        lines += ["", f"A decoder layer: {layer['kernels_per_layer']} kernels compiled, {layer['eager_ops_per_layer']} "
                      f"operations through transformers' modules; a second process "
                      f"{'reused the compile cache' if layer['cache_reused'] else 'compiled again'}."]
    return lines


def _startup(data: dict[str, Any]) -> list[str]:
    def start(kind: str) -> str:
        t = data[kind]
        answers = f"{t['answers_s']:.1f} s to the first answer at its address (the starting page), " \
            if "answers_s" in t else ""
        return f"{answers}{t['running_s']:.0f} s to the page's \"Running on\" and {t['calibrated_s']:.0f} s to the " \
            "end of its calibration"

    cold = (f"From a fresh cache folder (the GGUF converted, the C kernel built, the cost profile measured) a first "
            f"start took {start('cold')}; ") if "cold" in data else ""
    lines = [f"{cold}a later start took {start('warm')}. The first two races after that start, the first preset in "
             "the stage view in headless chromium:", ""]
    rows = [[n, f"`{r['method']}`", _x(r["overall"]), _x(r["predicted"]),
             f"{r['prefill_ms']['method']:.0f} / {r['prefill_ms']['baseline']:.0f}" if r["prefill_ms"] else "-"]
            for n, r in enumerate(data["races"], 1)]
    return lines + _table(["race", "method", "overall", "predicted", "prompt forward ms (method / plain)"], rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "heldout": _heldout, "presets": _presets, "profile": _profile, "suite": _suite, "gpucheck": _gpucheck,
    "floors": _gpucheck, "dispatch": _dispatch, "startup": _startup}
COMMANDS = {  # what to run where a block has no JSON yet
    "heldout": "python -m specgui bench --prompts assets/heldout.jsonl --limit 1 --repeats 3 --max-new-tokens 64 "
               "--methods baseline,hf-generate,pld,clasp,admg,selfdraft,fractal,swift,dv,lookahead --save",
    "presets": "python -m specgui presets --save",
    "profile": "python -m specgui profile --refresh --save",
    "gpucheck": "python -m specgui gpucheck --out out/gpucheck --save",
    "floors": "python -m specgui gpucheck --sections floors --out out/floors --save",
    "dispatch": "python -m specgui gpucheck --sections dispatch --device cpu --out out/dispatch --save",
    "suite": "python -m specgui suite-time --save",
    "startup": "python -m specgui first-minute --save",
}


def provenance_line(data: dict[str, Any]) -> str:
    """The italic line under a table: the command, device, date (to the minute), commit and versions."""
    p = data.get("provenance", {})
    head, dirty, _ = (p.get("commit") or "no commit").partition("-dirty")
    commit = head[:12] + dirty  # a dirty tree's figures belong to no commit exactly: say so
    date = measured_at(data).strftime("%Y-%m-%d %H:%M UTC") if p.get("date") else "?"
    return (f"*Measured by `{p.get('command', '?')}` on {p.get('device', '?')}, {date}, commit "
            f"{commit}, torch {p.get('torch', '?')}, transformers {p.get('transformers', '?')}.*")


def render(name: str, results_dir: Path = RESULTS_DIR) -> str:
    """The text a block named `name` holds (ending in a newline)."""
    data, kind = find_result(name, results_dir)
    if data is None:
        return f"*Not measured yet: run `{COMMANDS[kind]}`, then `python -m specgui report`.*\n"
    return "\n".join([*RENDERERS[kind](data), "", provenance_line(data)]) + "\n"


def render_text(text: str, results_dir: Path = RESULTS_DIR) -> tuple[str, list[str]]:
    """`text` with every block rendered, and the names of the blocks whose text changed."""
    changed: list[str] = []

    def fill(match: re.Match[str]) -> str:
        body = render(match["name"], results_dir)
        if body != match["body"]:
            changed.append(match["name"])
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(fill, text), changed


def render_all(root: Path = REPO_DIR, results_dir: Path = RESULTS_DIR, check: bool = False) -> list[tuple[Path, str]]:
    """Render every block of every document (`check`: write nothing); the (document, block) pairs that changed."""
    stale = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        new, changed = render_text(text, results_dir)
        stale += [(path, name) for name in changed]
        if changed and not check:
            path.write_text(new, encoding="utf-8")
    return stale

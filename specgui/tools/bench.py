"""Benchmark: every prompt with every method, in one process, against `baseline`.

How the numbers are made (Spec-Bench's conventions, paired): one warm-up run per method is excluded; each
(prompt, method) pair runs `repeats` times, in rounds in which the methods take turns per prompt in a rotating
order; tokens/s is total new tokens over the total of each pair's median wall time; speedup pairs every run with
the baseline's run of the same prompt and round (`paired_speedup`: the median ratio per prompt, weighted by the
baseline's time on it), since the machine's speed moves in phases that a run's median alone does not cancel;
tau is tokens per verify forward (the
verifier's own token included); ceiling is the speedup the same runs would have if each step cost a plain
step (`ceiling`: what the drafts allow, whatever the verifies cost). `hf-generate`, `hf-static` and `hf-pld`
are transformers' own greedy `generate` (with its dynamic cache, with a static cache, which it compiles on a
GPU) and prompt-lookup decoding on the same model, so the baseline can be checked against them.

If a method's greedy output differs from baseline's, the report names the prompt, the first differing
position and the baseline's top-1 minus top-2 logit margin there, beside the logit noise between batch
shapes measured once per run in the run's dtype (`specgui.tools.equality`): a margin within the noise is a
numerical near-tie, a larger one is a bug.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from specgui import costs, fastpath, methods
from specgui.core import decode
from specgui.core.sampling import GREEDY, Sampling
from specgui.costs import CostProfile, describe_origin
from specgui.errors import SpecGUIError
from specgui.fastpath import compiled
from specgui.methods.params import parse_setting
from specgui.model.loading import LoadedModel
from specgui.tools import hosttime
from specgui.tools.equality import first_divergence, logit_noise
from specgui.tools.prompts import PromptRow


def _hf_generate(lm: LoadedModel, ids: list[int], max_new: int, sampling: Sampling, lookup: int | None = None,
                 cache: str | None = None) -> tuple:
    from transformers import GenerationConfig

    config = GenerationConfig(cache_implementation=cache,
        max_new_tokens=max_new, do_sample=not sampling.greedy, eos_token_id=sorted(lm.stop_ids) or None,
        pad_token_id=min(lm.stop_ids) if lm.stop_ids else None,
        temperature=sampling.temperature if not sampling.greedy else None,
        top_p=sampling.top_p if not sampling.greedy else None, top_k=sampling.top_k or None,
        prompt_lookup_num_tokens=lookup,
    )
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    inputs = torch.tensor([ids], device=lm.runner.device)
    sync = torch.cuda.synchronize if lm.runner.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        start = time.perf_counter()
        out = lm.model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config)
        sync()
        wall = time.perf_counter() - start
    return out[0, len(ids) :].tolist(), wall


STATIC = "hf-static"  # transformers' generate over a static cache, compiled: on a GPU every method is shown against it
REFERENCES: dict[str, Callable] = {
    "hf-generate": lambda lm, ids, n, s: _hf_generate(lm, ids, n, s),
    "hf-pld": lambda lm, ids, n, s: _hf_generate(lm, ids, n, s, lookup=10),
    # a static cache, which transformers compiles on a GPU (on first use, and again for new prompt lengths)
    "hf-static": lambda lm, ids, n, s: _hf_generate(lm, ids, n, s, cache="static"),
}


@dataclass(frozen=True)
class Entry:
    """One contestant: a method with parameter overrides (None: its presets), named `label` in the report."""

    label: str
    method: str
    params: dict[str, Any] | None = None


@dataclass
class Run:
    """One (prompt, entry) pair: output of the first repeat, wall times of all repeats."""

    prompt_id: str
    category: str
    method: str
    tokens: list[int]
    walls: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # new tokens of each repeat, beside `walls` (sampling varies it)
    steps: int = 0
    emitted_in_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    margins: list[float] = field(default_factory=list)
    phase_ms: dict[str, float] = field(default_factory=dict)  # summed per phase, first repeat
    predicted_s: float = 0.0  # the cost model's price of the first repeat's steps (`Summary.predicted_s`)
    plain_s: float = 0.0  # ... and of plain steps for the same tokens
    host: list[hosttime.StepHost] = field(default_factory=list)  # the first repeat's steps, on the fast path
    divergence: dict[str, Any] | None = None  # set by `report_json`, against baseline
    identical: bool = True

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)


def entries_for(names: Iterable[str], params: dict[str, dict[str, Any]] | None = None) -> list[Entry]:
    """Entries for method names (each labelled by its name, with `params[name]`); `baseline` always comes first. A
    name may add `+KEY=VALUE` overrides (`clasp+draft_vocab=0`): a variant of the method, labelled by the whole name,
    so that one bench compares a method with itself under another setting, in the same run."""
    chosen: dict[str, Entry] = {"baseline": Entry("baseline", "baseline", (params or {}).get("baseline"))}
    for name in names:
        name = name.strip()
        if not name or name in chosen:
            continue
        method, *settings = name.split("+")
        if method not in REFERENCES:
            methods.get(method)  # raises with the list of known methods
        elif settings:
            raise SpecGUIError(f"{name!r}: transformers' references take no parameters")
        own = dict((params or {}).get(method) or {})
        own.update(parse_setting(setting, f"{name!r}: a variant's settings are +KEY=VALUE") for setting in settings)
        chosen[name] = Entry(name, method, own or None)
    return list(chosen.values())


def preparation_line(note: dict[str, Any]) -> str:
    """One untimed preparation of a bench (`bench`'s `prepared`) in words."""
    return (f"{note['what']} in {note['seconds']:.1f} s (fast path: {note['programs']} programs, "
            f"{note['capture_s']:.1f} s capturing them)")


def run_method(lm: LoadedModel, row: PromptRow, ids: list[int], method: str, max_new: int, sampling: Sampling,
               params: dict[str, Any] | None, fast_path: str = "auto", pipeline: bool = True) -> Run:
    """One run of one method on one prompt (`pipeline`: `decode.generate`'s)."""
    if method in REFERENCES:
        tokens, wall = REFERENCES[method](lm, ids, max_new, sampling)
        return Run(row.id, row.category, method, tokens, [wall], [len(tokens)])
    kwargs = {"max_new_tokens": max_new, "sampling": sampling, "params": params, "fast_path": fast_path,
              "pipeline": pipeline}
    if fastpath.resolve(fast_path, lm.runner):  # forwards as programs: the rest of a step is the host's
        result, host = hosttime.measured_run(lm, ids, method, **kwargs)
    else:
        result, host = decode.run(lm, ids, method, **kwargs), []
    s, steps = result.summary, result.steps
    phase: dict[str, float] = {"draft": s.draft_s * 1000, "verify": s.verify_s * 1000, "overhead": s.overhead_s * 1000}
    for step in steps:
        for key, value in step.payload.items():
            if key.endswith(("_ms", "_ratio")) and isinstance(value, (int, float)):
                phase[key] = phase.get(key, 0.0) + value
                phase[key + "_count"] = phase.get(key + "_count", 0) + 1
    return Run(row.id, row.category, method, result.token_ids, [s.wall_s], [len(result.token_ids)], steps=s.steps,
               emitted_in_steps=sum(len(st.emitted) for st in steps), drafted=s.drafted, accepted=s.accepted,
               margins=result.margins, phase_ms=phase, predicted_s=s.predicted_s, plain_s=s.plain_s, host=host)


@dataclass(frozen=True)
class Settings:
    """What every run of one bench shares."""

    max_new_tokens: int = 128
    repeats: int = 1
    sampling: Sampling = GREEDY
    fast_path: str = "auto"
    compile: str = "auto"  # the fast path's programs compiled (`specgui.fastpath.compiled`)
    pipeline: bool = True  # a step's event goes out while the next step's forward runs (`decode.generate`)


def bench(
    lm: LoadedModel,
    rows: list[PromptRow],
    entries: list[Entry],
    settings: Settings = Settings(),
    *,
    progress: Callable[[Entry, PromptRow], None] | None = None,
    partial: Callable[[dict[str, Any]], None] | None = None,
    prepared: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the suite; return the report (see `report_json`). `entries[0]` must be baseline.

    `progress` hears of every finished run, before the next starts; `partial` gets the report of the
    prompts finished so far (`"complete": false`) after each prompt, so a bench stopped part-way keeps
    what it measured; `prepared` hears of each untimed preparation (an entry's warm-up, the logit noise, the
    cost profile: its seconds and the fast path's programs so far, `preparation_line` says it in words), so that a
    bench stopped before its first timed run says where the time went.
    """
    if not entries or entries[0].method != "baseline":
        raise ValueError("a bench's first entry is the baseline every speedup is measured against")
    for entry in entries:  # bad parameters fail here, before anything is timed
        if entry.method not in REFERENCES:
            methods.params_for(entry.method, lm.name, lm.runner.device.type, entry.params)
    fast = fastpath.resolve(settings.fast_path, lm.runner)
    lm.runner.compile_mode = compiled.with_path(settings.fast_path, settings.compile)
    encoded = [row.encode(lm.tokenizer) for row in rows]

    def untimed(what: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        out = fn()
        if prepared is not None:
            made = fastpath.stats(lm.runner)
            prepared({"what": what, "seconds": round(time.perf_counter() - started, 2), "programs": made["programs"],
                      "capture_s": round(made["capture_s"], 2)})
        return out

    for entry in entries:  # warm-up, excluded (on the fast path it also captures the graphs)
        untimed(f"{entry.label} warmed up", lambda entry=entry: run_method(
            lm, rows[0], encoded[0], entry.method, min(16, settings.max_new_tokens), settings.sampling,
            entry.params, settings.fast_path, settings.pipeline))
    if "hf-static" in {e.method for e in entries} and lm.runner.device.type == "cuda":
        # transformers compiles a static cache's step per cache length (prompt + new tokens) on a GPU: warmed on
        # every prompt at the timed length, or the compile would be timed as its decoding
        for row, ids in zip(rows, encoded):
            untimed(f"hf-static compiled for {row.id}", lambda row=row, ids=ids: run_method(
                lm, row, ids, "hf-static", settings.max_new_tokens, settings.sampling, None))
    noise = untimed("logit noise", lambda: logit_noise(lm.runner, encoded[:3], fast_path=fast))
    # the saved profile if a couple of plain steps now agree with it, else measured now (`costs.profile_for`)
    profile = untimed("cost profile", lambda: costs.profile_for(lm, fast, run=decode.run))
    runs: dict[tuple[str, str], Run] = {}
    for repeat in range(settings.repeats):
        for i, (row, ids) in enumerate(zip(rows, encoded)):
            shift = (i + repeat) % len(entries)
            for entry in entries[shift:] + entries[:shift]:
                run = run_method(lm, row, ids, entry.method, settings.max_new_tokens, settings.sampling,
                                 entry.params, settings.fast_path, settings.pipeline)
                key = (row.id, entry.label)
                if key in runs:
                    runs[key].walls.extend(run.walls)
                    runs[key].counts.extend(run.counts)
                else:
                    runs[key] = run
                if progress is not None:
                    progress(entry, row)
            if partial is not None and (repeat, i) != (settings.repeats - 1, len(rows) - 1):
                done = rows if repeat else rows[: i + 1]
                partial(report_json(lm, done, entries, runs, settings, noise=noise, profile=profile, complete=False))
    return report_json(lm, rows, entries, runs, settings, noise=noise, profile=profile, complete=True)


def _profile_json(profile: CostProfile) -> dict[str, Any]:
    """The profile as JSON; its file as "file", since a "path" key makes gradio's client fetch it as an upload."""
    data = profile.to_dict()
    data["file"] = data.pop("path")
    return data


def _divergence(run: Run, base: Run, noise: float) -> dict[str, Any] | None:
    found = first_divergence(run.tokens, base.tokens, base.margins, noise)
    return None if found is None else dataclasses.asdict(found)


def ceiling(group: list[Run], base: list[Run]) -> float | None:
    """The speedup these runs would have if each of their steps cost what a plain step cost on the same prompt (the
    baseline's mean step there), all else as measured: the prompt's forward, the loop between steps. A speculative
    step costs at least a plain step (its verify is a forward over at least one row), so this is what the method's
    drafts allow, whatever its verifies cost: a method near it can gain only by drafting better (or by a faster
    prompt forward, which every method shares). From each run's first repeat, whose phase times the runs keep; None
    for transformers' references and runs without steps. `group` and `base` list the same prompts in order."""
    if not group or any(r.method in REFERENCES or not r.steps for r in (*group, *base)):
        return None
    def own_s(r: Run) -> float:  # the run's steps: drafting and verify forwards
        return (r.phase_ms.get("draft", 0.0) + r.phase_ms.get("verify", 0.0)) / 1000

    plain_wall = sum(b.walls[0] for b in base)
    at_plain_cost = sum(r.walls[0] - own_s(r) + r.steps * own_s(b) / b.steps for r, b in zip(group, base))
    return plain_wall / at_plain_cost if at_plain_cost > 0 else None


def paired_speedup(group: list[Run], base: list[Run]) -> float:
    """The speedup of `group` over `base` (the same prompts in order), each run paired with the baseline's run of the
    same prompt and round: per prompt the median over rounds of the ratio of the two runs' rates (new tokens over wall
    time), over all prompts the baseline's median time divided by what the method took at those ratios.

    Why paired: a round's runs follow each other within seconds, while this kind of machine runs in phases of minutes
    whose speeds differ by tens of percent; a method's median and the baseline's median can each land in another
    phase, and a method that decodes exactly as the baseline does can measure well under 1x on a prompt whose
    rounds' ratios say 1x."""
    base_s = method_s = 0.0
    for run, ref in zip(group, base):
        rounds = [(n / wall) / (ref_n / ref_wall) for wall, n, ref_wall, ref_n
                  in zip(run.walls, _counts(run), ref.walls, _counts(ref)) if wall > 0 and ref_wall > 0 and ref_n]
        if not rounds:
            continue
        base_s += ref.wall
        method_s += ref.wall / statistics.median(rounds)
    return base_s / method_s if method_s > 0 else 1.0


def _counts(run: Run) -> list[int]:
    """New tokens of each repeat (a run made by hand may give only its first repeat's tokens)."""
    return run.counts or [len(run.tokens)] * len(run.walls)


def _aggregate(group: list[Run], greedy: bool, base: list[Run]) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in group)
    wall = sum(r.wall for r in group)
    rate = tokens / wall if wall else 0.0
    steps = sum(r.steps for r in group)
    drafted = sum(r.drafted for r in group)
    native = all(r.method not in REFERENCES for r in group)
    predicted = native and all(r.predicted_s > 0 for r in group)
    return {
        "tokens_per_s": rate,
        "speedup": paired_speedup(group, base),
        "predicted_speedup": sum(r.plain_s for r in group) / sum(r.predicted_s for r in group) if predicted else None,
        "ceiling": ceiling(group, base),
        "mean_accepted": (sum(r.emitted_in_steps for r in group) / steps if steps else None) if native else None,
        "acceptance_rate": (sum(r.accepted for r in group) / drafted if drafted else None) if native else None,
        "identical": sum(1 for r in group if r.identical) if greedy else None,
        "ties": sum(1 for r in group if r.divergence and r.divergence["near_tie"]) if greedy else None,
        "total": len(group),
        "new_tokens": tokens,
        "wall_s": wall,
    }


def report_json(lm: LoadedModel, rows: list[PromptRow], entries: list[Entry], runs: dict[tuple[str, str], Run],
                settings: Settings, *, noise: float, profile: CostProfile, complete: bool) -> dict[str, Any]:
    """The bench report: per entry label, overall ("methods") and per category, plus every prompt's row.

    `logit_noise` is the measured disagreement of two batch shapes (`specgui.tools.equality.logit_noise`): a
    greedy divergence where the baseline's top-2 margin is within it counts as a near-tie ("ties").
    `predicted_speedup` is what the cost model (`cost_profile`: checked against a couple of plain steps at the
    start of the bench, measured again then if it no longer held; its `measured_at` and device say when and
    where it was measured) predicts from the steps each method took: how far measured and predicted differ is
    how well the model explains the method's speed.
    """
    sampling = settings.sampling
    base_label = entries[0].label
    for row in rows:
        for entry in entries:
            run = runs[(row.id, entry.label)]
            run.divergence = _divergence(run, runs[(row.id, base_label)], noise)
            run.identical = run.divergence is None
    categories = list(dict.fromkeys(r.category for r in rows))
    labels = [e.label for e in entries]
    by_label = {label: [runs[(r.id, label)] for r in rows] for label in labels}
    report: dict[str, Any] = {
        "model": lm.name, "device": str(lm.runner.device), "dtype": str(lm.runner.dtype).removeprefix("torch."),
        "fast_path": profile.key["fast_path"], "compiled": bool(profile.key.get("compiled")),
        "pipeline": settings.pipeline,
        "max_new_tokens": settings.max_new_tokens, "repeats": settings.repeats,
        "sampling": sampling.to_dict(), "prompts": len(rows), "complete": complete, "logit_noise": noise,
        "methods": {}, "categories": {}, "per_prompt": [], "profile": {}, "cost_profile": _profile_json(profile),
        "entries": {e.label: {"method": e.method, "params": e.params or {}} for e in entries},
    }
    for label in labels:
        report["methods"][label] = _aggregate(by_label[label], sampling.greedy, by_label[base_label])
        report["profile"][label] = _profile(by_label[label])
        if STATIC in by_label:  # the reference a GPU user knows: transformers' compiled static-cache generate
            report["methods"][label]["vs_hf_static"] = paired_speedup(by_label[label], by_label[STATIC])
    for cat in categories:
        base_runs = [r for r in by_label[base_label] if r.category == cat]
        report["categories"][cat] = {
            label: _aggregate([r for r in by_label[label] if r.category == cat], sampling.greedy, base_runs)
            for label in labels
        }
    for row in rows:
        for label in labels:
            run = runs[(row.id, label)]
            report["per_prompt"].append({
                "id": row.id, "category": row.category, "method": label, "new_tokens": len(run.tokens),
                "wall_s": run.wall, "walls": run.walls, "tokens_per_s": len(run.tokens) / run.wall if run.wall else 0,
                "mean_accepted": run.emitted_in_steps / run.steps if run.steps else None,
                "identical": run.identical if sampling.greedy else None, "divergence": run.divergence,
            })
    return report


def _profile(group: list[Run]) -> dict[str, float]:
    """Mean ms per verify step of each phase, the mean of every `*_ms` / `*_ratio` payload figure per report
    (e.g. CLaSp's DP time, Fractal's compressed-vs-full cost ratio), and on the fast path the medians a step of
    the host's time and of its part a GPU waits for (`specgui.tools.hosttime`)."""
    steps = sum(r.steps for r in group)
    totals: dict[str, float] = {}
    for r in group:
        for key, value in r.phase_ms.items():
            totals[key] = totals.get(key, 0.0) + value
    out = {}
    for key, value in totals.items():
        if key.endswith("_count"):
            continue
        if key in ("draft", "verify", "overhead"):
            out[f"{key}_ms_per_step"] = value / steps if steps else 0.0
        else:
            out[f"{key}_mean"] = value / max(1, totals.get(key + "_count", 1))
    figures = hosttime.medians([step for r in group for step in r.host])
    out.update({f"{key}_per_step": figures[key] for key in ("host_ms", "host_critical_ms") if key in figures})
    return out


def format_report(report: dict[str, Any], *, profile: bool = False) -> str:
    """Plain-text tables: per method, per category, divergences (and phase profile)."""
    path = ("fast path, compiled" if report.get("compiled") else "fast path") if report["fast_path"] else "eager"
    path += "" if report.get("pipeline", True) else ", serial steps"
    lines = [f"model {report['model']} on {report['device']} ({report['dtype']}, {path}), {report['prompts']} "
             f"prompts, max {report['max_new_tokens']} new tokens, {report['repeats']} repeat(s) paired by round, "
             f"temperature {report['sampling']['temperature']}",
             f"logit noise between batch shapes: {report['logit_noise']:.3g} (a divergence whose baseline top-2 "
             "margin is within it is a near-tie)"]
    priced = report.get("cost_profile")
    if priced:  # the profile every "predicted" figure comes from: when and where it was measured, and its file
        origin = describe_origin(priced["key"].get("device", ""), priced.get("measured_at", 0.0))
        lines.append(f"predicted by the cost profile {origin}" + (f" ({priced['file']})" if priced.get("file") else ""))
    if not report["complete"]:
        lines.append("INCOMPLETE: the bench stopped before every prompt ran")
    static = any("vs_hf_static" in agg for agg in report["methods"].values())
    header = (f"{'method':<12} {'tok/s':>7} {'speedup':>8} {'predicted':>9} {'ceiling':>8} {'tau':>6} {'accept':>7} "
              f"{'identical':>10} {'ties':>5}" + (f" {'vs ' + STATIC:>13}" if static else ""))

    def row(name: str, agg: dict[str, Any]) -> str:
        tau = f"{agg['mean_accepted']:.2f}" if agg["mean_accepted"] is not None else "-"
        acc = f"{agg['acceptance_rate']:.0%}" if agg["acceptance_rate"] is not None else "-"
        ident = f"{agg['identical']}/{agg['total']}" if agg["identical"] is not None else "n/a"
        ties = str(agg["ties"]) if agg["ties"] is not None else "-"
        pred = f"{agg['predicted_speedup']:.2f}x" if agg.get("predicted_speedup") is not None else "-"
        top = f"{agg['ceiling']:.2f}x" if agg.get("ceiling") is not None else "-"
        versus = f" {agg['vs_hf_static']:>12.2f}x" if "vs_hf_static" in agg else (" " * 14 if static else "")
        return (f"{name:<12} {agg['tokens_per_s']:>7.2f} {agg['speedup']:>7.2f}x {pred:>9} {top:>8} {tau:>6} "
                f"{acc:>7} {ident:>10} {ties:>5}" + versus)

    lines += ["", "overall", header] + [row(n, a) for n, a in report["methods"].items()]
    for cat, per in report["categories"].items():
        lines += ["", f"category {cat}", header] + [row(n, a) for n, a in per.items()]
    diverged = [p for p in report["per_prompt"] if p["divergence"]]
    if diverged and report["sampling"]["temperature"] == 0:
        lines += ["", "divergences from baseline (greedy):"]
        for p in diverged:
            d = p["divergence"]
            margin = f"{d['baseline_margin']:.4g}" if d["baseline_margin"] is not None else "?"
            verdict = ("a reference on its own kernels, not held to this path's logit noise"  # transformers' kernels
                       if p["method"] in REFERENCES else "a near-tie (within the logit noise)" if d["near_tie"]
                       else "NOT within the logit noise: a bug")
            lines.append(f"  {p['method']} on {p['id']}: first differs at token {d['position']} "
                         f"(baseline {d['baseline_token']}, method {d['method_token']}), "
                         f"baseline top-2 margin {margin} -> {verdict}")
    if profile:
        lines += ["", "profile (ms)"]
        for name, figures in report["profile"].items():
            text = ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            lines.append(f"  {name}: {text or '-'}")
    return "\n".join(lines)

"""`python -m specgui gpucheck --out DIR`: validate the fast path on whatever device is here, in one command.

Why: few sessions are lent a GPU, and the fast path (static cache, buckets, CUDA graphs) is written for
one. A session that gets a GPU must be able to check all of it (CUDA tests, token identity, the bf16 tie
audit, speed against targets, graph floors, syncs and launches, capture cost, memory on a model switch,
attention kernels) in one call and paste the result into README. The same checks run on a CPU at CPU
scale, and CI runs the short form (`--quick`), so the command cannot rot between GPU sessions.

Each section is a function of a `Context` returning a dict: figures, one table (`headers`, `rows`) and
its `targets` (what was promised, what was measured, PASS/FAIL; `None` where a target is for CUDA and
this is a CPU). A section that raises records its error and the others still run; a section that cannot
run here says why (`Skipped`). `run` writes `report.json` and `report.md`; `summary_table` is the table
printed to stdout (README's table).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import json
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specgui import REPO_DIR, fastpath, methods
from specgui.core import decode
from specgui.cpu import attention
from specgui.cpu import layers as cpu_layers
from specgui.model.loading import EMBEDDED, LoadedModel, ModelSpec, load
from specgui.tools import bench
from specgui.tools.equality import first_divergence, logit_noise
from specgui.tools.prompts import PromptRow, load_prompts, select

HELDOUT = REPO_DIR / "assets" / "heldout.jsonl"
CATEGORY_ORDER = ("code", "summarization", "multi-turn", "qa", "rag", "math", "translation")
BENCH_CATEGORIES = ("code", "multi-turn")  # the GPU issue's bench: HumanEval and MT-bench prompts, in turn
SPEEDUP_TARGETS = {"pld": 1.35, "selfdraft": 1.5, "lookahead": 1.2, "admg": 1.15, "fractal": 1.15}  # the rest: 1x
BASELINE_MS_TARGET = 1.8  # the embedded model on an H200: 1.2x its compiled floor (1.51 ms)
FLOOR_RATIO_TARGET = 1.15  # a random 3B/8B shape's plain step against its compiled floor
EMBEDDED_FLOOR_TARGET = 1.2  # the embedded model's (its step is short: the host's share of it is larger)
STATIC_RATIO_TARGET = 0.6  # plain decoding's ms a token against transformers' compiled static-cache generate
SYNC_TOKENS = 8  # new tokens per run counted by syncs_launches
# methods whose drafting needs no forward of its own, and the most host work (draft + overhead, ms) a GPU step may add
HOST_LIGHT, HOST_MS_TARGET = ("pld", "selfdraft", "lookahead"), 0.25
EAGER_OPS_SLACK = 2  # device operations a drafting step may add to a plain step's, between its programs
KERNELS_PER_LAYER = 10  # norm, q/k/v, rotary + cache write, attention, output, norm, gate/up, SiLU, down, add
# A step's host time a GPU waits for (`specgui.tools.hosttime`), at most, ms on CI's CPU kind: plain and prompt-lookup
# steps are to chain on the device, host drafters to leave little before the next launch, layer skip a little more
HOST_CRITICAL_MS = {"baseline": 0.05, "pld": 0.05, "selfdraft": 0.25, "lookahead": 0.25}
HOST_CRITICAL_OTHERS_MS = 0.15  # every layer-skip method, and fractal
HOST_MS = 1.0  # a step's whole host time, every method: it must fit under a 1.5 ms forward
HOST_REPEATS = 3  # passes over the prompts that each host figure is the median of (`host_figures`)
SWITCH_SLACK_BYTES = 16 * 2**20  # allocator rounding and small caches the switch may leave behind
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


class Skipped(Exception):
    """A section that cannot run here (e.g. CUDA only, on a CPU); the message says why."""


@dataclass(frozen=True)
class Options:
    """Sizes of every section: full (GPU scale, or the same on a CPU) or quick (CI on a CPU)."""

    device: torch.device
    quick: bool
    methods: tuple[str, ...]
    identity_prompts: int
    identity_tokens: int
    bench_prompts: int
    bench_tokens: int
    shape_tokens: int
    bench_model: str  # the model bench, capture, syncs and switch run (embedded, or a toy in quick CPU form)
    identity_model: str  # the model every method's identity runs on (the same choice)
    shape_models: tuple[str, ...]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> str:
        """What the speed sections run in: bf16 on a GPU (what users run), fp32 on a CPU."""
        return "bfloat16" if self.cuda else "float32"


def options(device: str = "auto", quick: bool = False, method_names: list[str] | None = None,
            prompts: int | None = None, tokens: int | None = None) -> Options:
    """Section sizes for this device and form (`prompts`, `tokens`: the bench's, where given)."""
    from specgui.model.loading import resolve_device

    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    chosen = tuple(method_names) if method_names else tuple(methods.names())
    for name in chosen:
        methods.get(name)
    if "baseline" not in chosen:
        chosen = ("baseline", *chosen)
    toy = quick and not cuda
    return Options(
        device=dev, quick=quick, methods=chosen,
        identity_prompts=1 if quick else 4, identity_tokens=8 if quick else 32,
        bench_prompts=prompts or ((2 if quick else 8) if cuda else (1 if quick else 4)),
        bench_tokens=tokens or ((32 if quick else 64) if cuda else (8 if quick else 48)),
        shape_tokens=16 if quick else 64,
        bench_model="random:tiny" if toy else EMBEDDED, identity_model="random:tiny" if toy else EMBEDDED,
        shape_models=(EMBEDDED, "random:llama-3b", "random:llama-8b") if cuda else
                     (("random:tiny",) if quick else ("random:smollm2-135m",)),
    )


@dataclass
class Context:
    """What the sections share: options, the output folder, loaded models and prompts."""

    opts: Options
    out: Path
    held: dict[tuple[str, str], LoadedModel] = field(default_factory=dict)
    deadline: float = float("inf")  # `time.perf_counter()` by which the running section should wrap up

    def over_budget(self) -> bool:
        """Whether the running section has spent its time budget (`BUDGET_S`): loops over models or methods check it
        between items and leave the rest out, said so in the report, so that the whole run fits a lease."""
        return time.perf_counter() > self.deadline

    def model(self, name: str, dtype: str) -> LoadedModel:
        """A model loaded once for every section that reads it."""
        key = (name, dtype)
        if key not in self.held:
            self.held[key] = load(ModelSpec(name=name, dtype=dtype, device=str(self.opts.device)))
        return self.held[key]

    def rows(self, n: int, categories: tuple[str, ...] = CATEGORY_ORDER) -> list[PromptRow]:
        """`n` held-out prompts taken from `categories` in turn, in their order."""
        rank = {c: i for i, c in enumerate(categories)}
        taken: dict[str, int] = {}
        keyed = []
        for row in select(load_prompts(HELDOUT), categories=list(categories)):
            turn = taken[row.category] = taken.get(row.category, -1) + 1  # the row's index within its category
            keyed.append((turn, rank.get(row.category, len(rank)), row))
        return [row for *_, row in sorted(keyed, key=lambda k: k[:2])][:n]

    def cuda_only(self, what: str) -> None:
        if not self.opts.cuda:
            raise Skipped(f"CUDA only ({what}); this device is {self.opts.device}")


def target(name: str, measured: str, ok: bool | None) -> dict[str, Any]:
    """One promise: `ok` None where it does not apply on this device."""
    return {"target": name, "measured": measured, "pass": ok}


def table(headers: list[str], rows: list[list[Any]], targets: list[dict[str, Any]] | None = None,
          **data: Any) -> dict[str, Any]:
    return {"headers": headers, "rows": rows, "targets": targets or [], **data}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drafting(method: str, gpu_like: bool = False) -> dict[str, Any] | None:
    """The paper's fixed draft schedule where a method has a policy: identity means something only if it drafts.
    `gpu_like`: drafts also score the whole vocabulary, as on a GPU (a draft vocabulary is a CPU preset)."""
    fields = {f.name for f in dataclasses.fields(methods.get(method).Params)}
    wanted = {"policy": "fixed", **({"draft_vocab": 0} if gpu_like else {})}
    return {k: v for k, v in wanted.items() if k in fields} or None


def _step_ms_per_token(result: decode.Result) -> float:
    """Decoding ms per generated token after the prefill: every step's draft, verify and overhead time."""
    steps = result.steps
    tokens = sum(len(s.emitted) for s in steps)
    return sum(s.draft_ms + s.verify_ms + s.overhead_ms for s in steps) / tokens if tokens else float("nan")


# -- 1. tests ------------------------------------------------------------------------------------------------


def section_tests(ctx: Context) -> dict[str, Any]:
    """The CUDA tests of the fast path, the pipeline and Fractal, in a subprocess (they skip themselves without CUDA),
    within the section's budget: a run stopped at it says which tests it left out."""
    ctx.cuda_only("the CUDA tests skip themselves on a CPU")
    tests = REPO_DIR / "tests"
    if not (tests / "test_fastpath.py").is_file():
        raise Skipped(f"no tests beside the package ({tests})")
    files = ["tests/test_fastpath.py", "tests/test_pipeline.py", "tests/test_fractal.py"]
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *files, "-k", "cuda"]
    started = time.perf_counter()
    listed = subprocess.run([*base, "-q", "--collect-only"], cwd=REPO_DIR, capture_output=True, text=True,
                            timeout=120)
    wanted = [line.strip() for line in listed.stdout.splitlines() if "::" in line]
    cmd = [*base, "-v", "-rN"]
    try:
        done = subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True,
                              timeout=max(5.0, ctx.deadline - time.perf_counter()))
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as stopped:
        output, code = _text(stopped.stdout) + _text(stopped.stderr), None
    (ctx.out / "tests.log").write_text(output, encoding="utf-8")
    verdicts = dict(re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", output, flags=re.MULTILINE))
    counts = {kind: list(verdicts.values()).count(kind.upper()) for kind in ("passed", "failed", "skipped", "error")}
    left = [name for name in wanted if name not in verdicts]
    passed, failed = counts["passed"], counts["failed"] + counts["error"]
    stopped_at = "" if code is not None else f", stopped at the section's budget ({BUDGET_S['tests']} s)"
    return table(["passed", "failed", "skipped", "left out", "seconds", "exit"],
                 [[passed, failed, counts["skipped"], len(left), round(time.perf_counter() - started, 1),
                   "budget" if code is None else code]],
                 [target(f"CUDA tests ({', '.join(files)} -k cuda) pass",
                         f"{passed} passed, {failed} failed, {len(left)} left out{stopped_at}",
                         code == 0 and passed > 0 and not left)],
                 counts=counts, left_out=left, command=" ".join(cmd[1:]), log="tests.log")


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# -- 2. identity ---------------------------------------------------------------------------------------------


def _identity_of(lm: LoadedModel, encoded: list[list[int]], bases: list[decode.Result], method: str,
                 n: int) -> dict[str, Any]:
    started = time.perf_counter()
    identical, drafted, accepted, first = 0, 0, 0, None
    for ids, base in zip(encoded, bases):
        got = decode.run(lm, ids, method, max_new_tokens=n, params=_drafting(method), fast_path="on")
        drafted += got.summary.drafted
        accepted += got.summary.accepted
        found = first_divergence(got.token_ids, base.token_ids, base.margins)
        identical += found is None
        first = first or (found and dataclasses.asdict(found))
    return {"identical": identical, "total": len(encoded), "drafted": drafted, "accepted": accepted,
            "first_divergence": first, "seconds": round(time.perf_counter() - started, 2)}


def section_identity(ctx: Context) -> dict[str, Any]:
    """Every method on the fast path, fp32, greedy, against the eager baseline, token for token; again with
    every program call overwriting every other program's output (`fastpath.overwrite_check`)."""
    opts = ctx.opts
    lm = ctx.model(opts.identity_model, "float32")
    encoded = [row.encode(lm.tokenizer) for row in ctx.rows(opts.identity_prompts)]
    n = opts.identity_tokens
    bases = [decode.run(lm, ids, "baseline", max_new_tokens=n, fast_path="off") for ids in encoded]
    per: dict[str, dict[str, Any]] = {}
    for mode, scope in (("fast path", contextlib.nullcontext), ("overwrite check", fastpath.overwrite_check)):
        for method in opts.methods:
            with scope():
                per[f"{method} / {mode}"] = {"method": method, "mode": mode,
                                             **_identity_of(lm, encoded, bases, method, n)}
    all_same = all(v["identical"] == v["total"] for v in per.values())
    rows = [[v["method"], v["mode"], f"{v['identical']}/{v['total']}", v["drafted"], v["accepted"],
             "-" if v["first_divergence"] is None else f"token {v['first_divergence']['position']}"]
            for v in per.values()]
    targets = [target("fp32 fast path token-identical to eager baseline (every method, plain and under the "
                      "overwrite check)",
                      f"{sum(v['identical'] for v in per.values())}/{sum(v['total'] for v in per.values())} runs",
                      all_same)]
    return table(["method", "mode", "identical", "drafted", "accepted", "first divergence"], rows, targets,
                 methods=per, prompts=len(encoded), new_tokens=n)


# -- 3. bf16 tie audit ---------------------------------------------------------------------------------------


def section_bf16(ctx: Context) -> dict[str, Any]:
    """bf16 on the fast path: every method against the bf16 baseline; a divergence must be a near-tie, i.e.
    the baseline's top-2 margin there within the logit noise measured between batch shapes
    (`specgui.tools.equality`, as the bench judges it)."""
    ctx.cuda_only("bf16 ties are a GPU matter; fp32 on a CPU is checked by identity")
    opts = ctx.opts
    lm = ctx.model(EMBEDDED, "bfloat16")
    encoded = [row.encode(lm.tokenizer) for row in ctx.rows(opts.identity_prompts)]
    n = opts.bench_tokens
    noise = logit_noise(lm.runner, encoded[:3], fast_path=True)
    bases = [decode.run(lm, ids, "baseline", max_new_tokens=n, fast_path="on") for ids in encoded]
    rows, found = [], []
    for method in ["baseline (eager)", *opts.methods[1:]]:
        eager = method == "baseline (eager)"
        for ids, base in zip(encoded, bases):
            got = decode.run(lm, ids, "baseline" if eager else method, max_new_tokens=n,
                             fast_path="off" if eager else "on")
            d = first_divergence(got.token_ids, base.token_ids, base.margins, noise)
            if d is not None:
                found.append({"method": method, **dataclasses.asdict(d)})
        mine = [d for d in found if d["method"] == method]
        rows.append([method, len(encoded) - len(mine), len(mine), sum(d["near_tie"] for d in mine),
                     max((d["baseline_margin"] or 0.0 for d in mine), default=0.0)])
    ties = all(d["near_tie"] for d in found)
    return table(["method", "identical", "diverged", "near-ties", "largest margin"], rows,
                 [target("every bf16 divergence within the measured logit noise",
                         f"{sum(d['near_tie'] for d in found)}/{len(found)} divergences within {noise:.3g}", ties)],
                 logit_noise=noise, divergences=found, new_tokens=n)


# -- 4. bench ------------------------------------------------------------------------------------------------


def _bench_row(label: str, agg: dict[str, Any], path: str) -> list[Any]:
    rate = agg["tokens_per_s"]
    pred = agg.get("predicted_speedup")
    tau = agg.get("mean_accepted")
    return [label, path, round(1000 / rate, 2) if rate else "-", round(rate, 1), round(agg["speedup"], 2),
            "-" if pred is None else round(pred, 2), "-" if tau is None else round(tau, 2),
            f"{agg['identical']}/{agg['total']}" if agg.get("identical") is not None else "-"]


def _bench_targets(on: dict[str, Any], cuda: bool) -> list[dict[str, Any]]:
    figures, profile = on["methods"], on.get("profile", {})
    base_ms = 1000 / figures["baseline"]["tokens_per_s"]
    out = [target(f"baseline at most {BASELINE_MS_TARGET:g} ms/token (fast path)", f"{base_ms:.2f} ms",
                  base_ms <= BASELINE_MS_TARGET if cuda else None)]
    if bench.STATIC in figures:
        static_ms = 1000 / figures[bench.STATIC]["tokens_per_s"]
        out.append(target(f"baseline at most {STATIC_RATIO_TARGET:g}x {bench.STATIC}'s time a token",
                          f"{base_ms / static_ms:.2f}x ({base_ms:.2f} vs {static_ms:.2f} ms)",
                          base_ms <= STATIC_RATIO_TARGET * static_ms if cuda else None))
    for label, agg in figures.items():
        if label == "baseline" or label in bench.REFERENCES:
            continue
        want = SPEEDUP_TARGETS.get(label, 1.0)
        out.append(target(f"{label} at least {want:g}x baseline", f"{agg['speedup']:.2f}x",
                          agg["speedup"] >= want if cuda else None))
        if "vs_hf_static" in agg:
            out.append(target(f"{label} at least 1x {bench.STATIC}", f"{agg['vs_hf_static']:.2f}x",
                              agg["vs_hf_static"] >= 1.0 if cuda else None))
        host = profile.get(label, {})
        if label in HOST_LIGHT and "draft_ms_per_step" in host:
            ms = host["draft_ms_per_step"] + host["overhead_ms_per_step"]
            out.append(target(f"{label}: draft + overhead at most {HOST_MS_TARGET:g} ms a step", f"{ms:.2f} ms "
                              f"({host['draft_ms_per_step']:.2f} + {host['overhead_ms_per_step']:.2f})",
                              ms <= HOST_MS_TARGET if cuda else None))
        pred = agg.get("predicted_speedup")
        if pred:
            off = abs(pred / agg["speedup"] - 1)
            out.append(target(f"{label} predicted within 10% of measured", f"{pred:.2f}x predicted, "
                              f"{agg['speedup']:.2f}x measured ({off:.0%})", off <= 0.10 if cuda else None))
    return out


def _dv_searched(lm: LoadedModel) -> bool:
    """Whether dv's skip set for this model, device and setting is on disk: its first run on a GPU searches it (212 s
    on an H200, beyond the bench's share of a lease), which belongs to `dv-search` ahead of time, not to a check."""
    from specgui.methods.layerskip import dv

    return dv.cache_path(lm.runner, methods.params_for("dv", lm.name, lm.runner.device.type)).exists()


def section_bench(ctx: Context) -> dict[str, Any]:
    """`specgui.tools.bench` with the fast path on and off: ms/token, speedup, tau, predicted vs measured."""
    opts = ctx.opts
    lm = ctx.model(opts.bench_model, opts.dtype)
    rows = ctx.rows(opts.bench_prompts, BENCH_CATEGORIES)
    # on a GPU transformers' dynamic-cache generate runs ~25x slower than a step (a lease's 40 s for nothing):
    # the compiled static-cache one is the reference users know there
    refs = ["hf-static"] if opts.cuda else ["hf-generate"]
    dv_left_out = opts.cuda and "dv" in opts.methods and not _dv_searched(lm)
    entries = bench.entries_for([*refs, *(m for m in opts.methods if not (dv_left_out and m == "dv"))])
    reports, out_rows, prepared = {}, [], []

    def note(found: dict[str, Any]) -> None:  # a section stopped by a timeout still says where its time went
        prepared.append(found)
        print(f"gpucheck bench: {bench.preparation_line(found)}", file=sys.stderr, flush=True)

    def write(report: dict[str, Any], path: str) -> None:  # after every prompt: a lease's timeout keeps what was timed
        (ctx.out / f"bench-fast-{path}.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        (ctx.out / f"bench-fast-{path}.txt").write_text(bench.format_report(report, profile=True), encoding="utf-8")

    for path in ("on",) if opts.cuda else ("on", "off"):  # eager on a GPU is dispatch-bound: nothing to learn
        settings = bench.Settings(max_new_tokens=opts.bench_tokens, fast_path=path)
        report = bench.bench(lm, rows, entries, settings, prepared=note,
                             partial=functools.partial(write, path=path))
        write(report, path)
        reports[path] = {"methods": report["methods"], "logit_noise": report["logit_noise"],
                         "profile": report["profile"]}
        out_rows += [_bench_row(label, agg, path) for label, agg in report["methods"].items()]
    targets = _bench_targets(reports["on"], opts.cuda)
    if dv_left_out:
        targets.append(target("dv benched", "left out: its skip set is not searched on this machine yet (an offline "
                              "search of minutes on a GPU: run `python -m specgui dv-search` in a call of its own "
                              "first)", None))
    return table(["method", "fast path", "ms/token", "tok/s", "speedup", "predicted", "tau", "identical"],
                 out_rows, targets, model=lm.name, dtype=opts.dtype,
                 prompts=len(rows), new_tokens=opts.bench_tokens, reports=reports, prepared=prepared,
                 files=[f"bench-fast-{path}.json" for path in reports])


# -- 5. shapes against their graph floor ---------------------------------------------------------------------


def _time_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median ms of `fn` after one warm-up call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def graph_floor_ms(lm: LoadedModel, context: int, repeats: int = 20, compile: bool = False) -> float:
    """One whole forward of one token over a transformers `StaticCache` of `context` tokens, captured as one
    CUDA graph and replayed (on a CPU: the same forward called): what a decoding step cannot beat. `compile`: the
    forward compiled by inductor first (the compiled floor: what a user's compiled transformers step costs).

    transformers 5.23's static cache advances its own write position on the device at every call (replays
    included), so it has room for every call made here; each call still reads the whole static buffer.
    """
    from transformers import StaticCache

    model, device = lm.model, lm.runner.device
    cache = StaticCache(config=model.config, max_cache_len=context + repeats + 8)
    ids = torch.randint(0, int(model.config.vocab_size), (1, context), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    token, position = ids[:, -1:].clone(), torch.tensor([context], device=device)
    with torch.inference_mode():
        model(ids, past_key_values=cache, cache_position=torch.arange(context, device=device), use_cache=True)

        def forward() -> torch.Tensor:
            return model(token, past_key_values=cache, cache_position=position, position_ids=position[None],
                         use_cache=True).logits

        step = torch.compile(forward, fullgraph=False, dynamic=False) if compile else forward

        if device.type != "cuda":
            return _time_ms(step, device, repeats)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return _time_ms(graph.replay, device, repeats)


def _floor_row(ctx: Context, name: str) -> dict[str, Any]:
    opts = ctx.opts
    lm = load(ModelSpec(name=name, dtype=opts.dtype, device=str(opts.device)))
    try:
        ids = ctx.rows(1)[0].encode(lm.tokenizer)
        decode.run(lm, ids, "baseline", max_new_tokens=4, fast_path="on")  # warm-up: captures, profile
        result = decode.run(lm, ids, "baseline", max_new_tokens=opts.shape_tokens, fast_path="on")
        ms = _step_ms_per_token(result)
        context = len(ids) + opts.shape_tokens // 2
        eager = graph_floor_ms(lm, context)
        started = time.perf_counter()
        floor = graph_floor_ms(lm, context, compile=True) if opts.cuda else eager  # a CPU has no compiled floor
        return {"model": name, "layers": lm.runner.num_layers, "params_m": lm.info["params_m"], "ms_per_token": ms,
                "compiled": fastpath.stats(lm.runner)["compiled"], "eager_floor_ms": eager, "floor_ms": floor,
                "floor_compile_s": time.perf_counter() - started, "ratio": ms / floor}
    finally:
        del lm
        _free(opts.device)


def section_floors(ctx: Context) -> dict[str, Any]:
    """Per model (the embedded one, then random 3B and 8B shapes on a GPU): plain decoding's ms a token on the fast
    path (compiled where `--compile` says) against two floors of transformers' own one-token forward over a static
    cache, each captured as one CUDA graph: its eager kernels, and the same forward compiled by inductor (the
    compiled floor, what a step must approach). Models past the section's time budget are left out, and said so."""
    found, left = [], []
    for name in ctx.opts.shape_models:
        if found and ctx.over_budget():
            left.append(name)
            continue
        found.append(_floor_row(ctx, name))
    rows = [[f["model"], f["layers"], f["params_m"], round(f["ms_per_token"], 2), round(f["eager_floor_ms"], 2),
             round(f["floor_ms"], 2), round(f["ratio"], 2)] for f in found]
    targets = []
    for f in found:
        want = EMBEDDED_FLOOR_TARGET if f["model"] == EMBEDDED else FLOOR_RATIO_TARGET
        targets.append(target(f"{f['model']} plain decoding within {want:g}x its compiled floor",
                              f"{f['ratio']:.2f}x ({f['ms_per_token']:.2f} vs {f['floor_ms']:.2f} ms)",
                              f["ratio"] <= want if ctx.opts.cuda else None))
    targets += [target(f"{name} measured", "left out: past the section's time budget", False) for name in left]
    floor = ("one-token forward over a StaticCache as one CUDA graph: eager kernels, and compiled by inductor"
             if ctx.opts.cuda else "eager forward (no compiled floor on a CPU)")
    return table(["model", "layers", "params (M)", "plain ms/token", "eager-kernel floor ms", "compiled floor ms",
                  "plain / compiled floor"], rows, targets, shapes=found, floor=floor, dtype=ctx.opts.dtype,
                 new_tokens=ctx.opts.shape_tokens, left_out=left)


# -- 6. syncs and launches -----------------------------------------------------------------------------------


def count_syncs(fn: Callable[[], Any]) -> int:
    """Host synchronisations `fn` makes, as `torch.cuda.set_sync_debug_mode("warn")` reports them."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def count_launches(fn: Callable[[], Any]) -> dict[str, int]:
    """Kernel launches, graph launches and async copies `fn` issues (CUDA runtime events in torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    counts = {"kernels": 0, "graphs": 0, "copies": 0}
    for event in prof.events():
        if event.name in LAUNCH_EVENTS:
            counts["kernels"] += 1
        elif event.name == "cudaGraphLaunch":
            counts["graphs"] += 1
        elif event.name.startswith("cudaMemcpy"):
            counts["copies"] += 1
    return counts


def section_syncs_launches(ctx: Context) -> dict[str, Any]:
    """Per generated token: host syncs and launches of every method's run on the fast path (its own schedule)."""
    ctx.cuda_only("host syncs and kernel launches are CUDA runtime events")
    opts = ctx.opts
    lm = ctx.model(opts.bench_model, opts.dtype)
    ids = ctx.rows(1)[0].encode(lm.tokenizer)
    rows, found = [], {}
    for method in opts.methods:
        if ctx.over_budget():
            break

        def go(method: str = method) -> decode.Result:  # a few steps: the profiler's cost grows with the run
            return decode.run(lm, ids, method, max_new_tokens=SYNC_TOKENS, fast_path="on")

        tokens = len(go().token_ids)  # warm-up (captures), and the token count every run below repeats
        syncs = count_syncs(go)
        launches = count_launches(go)
        found[method] = {"tokens": tokens, "syncs": syncs, **launches}
        rows.append([method, tokens, round(syncs / tokens, 1), round(launches["kernels"] / tokens, 1),
                     round(launches["graphs"] / tokens, 1), round(launches["copies"] / tokens, 1)])
    worst = max(found, key=lambda m: found[m]["syncs"] / found[m]["tokens"])
    per = found[worst]["syncs"] / found[worst]["tokens"]
    return table(["method", "tokens", "syncs/token", "kernel launches/token", "graph launches/token",
                  "memcpy/token"], rows,
                 [target("host syncs per token at most 1 (set_sync_debug_mode, whole runs)",
                         f"{per:.2f} at most ({worst})", per <= 1.0)],
                 runs=found, note=f"runs of {SYNC_TOKENS} new tokens, prefill included; methods past the section's "
                                  f"budget left out ({len(found)} of {len(opts.methods)} counted)")


def section_dispatch(ctx: Context) -> dict[str, Any]:
    """Per method on the fast path, greedy: programs per forward pass and host reads per generated token
    (`specgui.tools.dispatch`), counted on whatever device runs, since they are properties of the path. On a GPU a pass
    of one program and a step of one read is what makes a verify of several tokens cost about one token. Methods
    that size their drafts run the paper's fixed schedule here: a method the cost model paused on this device
    would count plain steps only, not the drafting path the figures are about; and drafts score the whole vocabulary,
    as on a GPU (a draft vocabulary is a CPU preset, whose head runs outside the programs)."""
    from specgui.fastpath import compiled

    opts = ctx.opts
    lm = ctx.model(EMBEDDED, "float32") if not opts.quick else ctx.model(opts.bench_model, opts.dtype)
    prompts = [row.encode(lm.tokenizer) for row in ctx.rows(1 if opts.quick else 2)]
    tokens = 8 if opts.quick else 48
    rows, found, targets = [], {}, []
    for method in opts.methods:
        f = {**dispatch_counts(lm, method, prompts, tokens),
             **host_figures(lm, method, prompts, tokens, repeats=1 if opts.quick else HOST_REPEATS)}
        found[method] = f
        rows.append([method, f["passes"], f["programs_per_pass_max"], round(f["programs_per_pass_mean"], 2),
                     round(f["syncs_per_token"], 2), round(f["eager_ops_per_step"], 1),
                     round(f["waited_launches_per_step"], 2), round(f["host_ms"], 3),
                     round(f["host_critical_ms"], 3), ", ".join(f"{k} {v}" for k, v in sorted(f["reads"].items()))])
        targets.append(target(f"{method}: one program per pass, at most one host read per token",
                              f"{f['programs_per_pass_max']} programs per pass at most, "
                              f"{f['syncs_per_token']:.2f} reads per token",
                              f["programs_per_pass_max"] <= 1 and f["syncs_per_token"] <= 1.0))
        critical = HOST_CRITICAL_MS.get(method, HOST_CRITICAL_OTHERS_MS)
        targets.append(target(f"{method}: host time a step at most {HOST_MS} ms, the part a GPU waits for at most "
                              f"{critical} ms", f"{f['host_ms']:.3f} ms, {f['host_critical_ms']:.3f} ms waited for",
                              f["host_ms"] <= HOST_MS and f["host_critical_ms"] <= critical))
    plain = found["baseline"]["eager_ops_per_step"]
    for method, f in found.items():
        if method != "baseline":
            targets.append(target(f"{method}: eager device operations a step at most plain decoding's + "
                                  f"{EAGER_OPS_SLACK}", f"{f['eager_ops_per_step']:.1f} against {plain:.1f}",
                                  f["eager_ops_per_step"] <= plain + EAGER_OPS_SLACK))
    missing = compiled.available(lm.runner.device.type)
    figures = None if missing else compiled_figures(lm)
    if figures is None:
        targets.append(target("a compiled decoder layer's kernels counted", f"skipped: {missing}", None))
    else:
        rows.append(["(a decoder layer)", "-", f"compiled: {figures['kernels_per_layer']} kernels",
                     f"eager: {figures['eager_ops_per_layer']} operations", "-", "-", "-",
                     f"compile cache reused by a new process: {figures['cache_reused']}"])
        targets.append(target(f"a compiled decoder layer runs at most {KERNELS_PER_LAYER} kernels",
                              f"{figures['kernels_per_layer']} ({', '.join(figures['calls'])})",
                              figures["kernels_per_layer"] <= KERNELS_PER_LAYER))
        targets.append(target("a second process compiles nothing (inductor's cache reused)",
                              f"hits {figures['second_process']['cache_hits']}, "
                              f"misses {figures['second_process']['cache_misses']}", figures["cache_reused"]))
    return table(["method", "passes", "programs/pass max", "programs/pass mean", "host reads/token",
                  "eager ops/step", "waited launches/step", "host ms/step", "waited-for ms/step", "reads by kind"],
                 rows, targets,
                 dispatch=found, compiled=figures,
                 note=f"{len(prompts)} prompts x {tokens} new tokens, fast path, greedy; host times the median of "
                      f"{1 if opts.quick else HOST_REPEATS} passes' medians a step")


def dispatch_counts(lm: LoadedModel, method: str, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """`dispatch.Counts.summary` of `method`'s runs of `tokens` new tokens from each of `prompts` on the fast path,
    greedy, drafting as on a GPU (the fixed schedule, the whole vocabulary), after a warm-up run (programs made)."""
    from specgui.tools import dispatch

    run = functools.partial(decode.run, lm, method=method, fast_path="on", params=_drafting(method, gpu_like=True))
    run(prompts[0], max_new_tokens=8)  # warm-up: programs made, setup done
    with dispatch.counting() as counts:
        for ids in prompts:
            result = run(ids, max_new_tokens=tokens)
            counts.tokens += len(result.token_ids)
            counts.steps += len(result.steps)
    return counts.summary()


def host_figures(lm: LoadedModel, method: str, prompts: list[list[int]], tokens: int,
                 repeats: int = HOST_REPEATS) -> dict[str, float]:
    """`hosttime.medians` of `method`'s steps, drafting as `dispatch_counts` does (timed apart from its counting,
    whose torch modes would be timed too), after a warm-up run: each figure the median of `repeats` passes over the
    prompts (a pass's medians moved by 0.05-0.15 ms from one minute to the next on a shared 2-core CPU, a target's
    verdict with them)."""
    from specgui.tools import hosttime

    run = functools.partial(hosttime.measured_run, lm, method=method, fast_path="on",
                            params=_drafting(method, gpu_like=True))
    run(prompts[0], max_new_tokens=8)
    passes = [hosttime.medians([step for ids in prompts for step in run(ids, max_new_tokens=tokens)[1]])
              for _ in range(repeats)]
    return {key: statistics.median(p[key] for p in passes) for key in passes[0]}


def compiled_figures(lm: LoadedModel) -> dict[str, Any]:
    """A decoder layer of `lm` in the compiled programs against the eager ones: the kernels inductor's code for the
    whole layer calls (one row; counted in a fresh process, then again in another, which must find every compiled
    graph in the cache), and the operations the eager program's layer dispatches (views, which launch nothing, left
    out)."""
    from specgui.fastpath import compiled
    from specgui.tools import dispatch

    spec = compiled.probe_spec(lm.runner)
    first = compiled.probe_in_subprocess(spec)
    second = compiled.probe_in_subprocess(spec)
    runner, ops = lm.runner, collections.Counter()

    cache = fastpath.StaticKVCache(runner, 256)
    cache.programs.graphs = cache.programs.compiled = False  # the eager program's function, called as it is
    inputs = cache.inputs_for(1)
    with torch.inference_mode(), cpu_layers.suspended():  # transformers' modules, as a program on a GPU runs them
        inputs.load(None, np.zeros(1, dtype=np.int64), *cache.bounds(1),
                    np.ones((1, 1), dtype=bool))
        h = runner.embed(torch.zeros(1, 1, dtype=torch.long, device=runner.device))
        with dispatch.EagerOps(ops, lambda: runner.device, lambda: 0):
            fastpath.units(cache, runner.layers[0], 0, (0, 1), h, inputs)
    return {"kernels_per_layer": len(first["calls"]), "calls": first["calls"],
            "eager_ops_per_layer": sum(ops.values()), "eager_ops": dict(ops),
            "cache_reused": second["cache_misses"] == 0 and second["cache_hits"] > 0,
            "first_process": {k: first[k] for k in ("cache_hits", "cache_misses")},
            "second_process": {k: second[k] for k in ("cache_hits", "cache_misses")}}


# -- 7. capture ----------------------------------------------------------------------------------------------


def section_capture(ctx: Context) -> dict[str, Any]:
    """Capture time and graph memory after warm-up, on a freshly loaded model (its captures are all new)."""
    opts = ctx.opts
    lm = load(ModelSpec(name=opts.bench_model, dtype=opts.dtype, device=str(opts.device)))
    try:
        ids = ctx.rows(1)[0].encode(lm.tokenizer)
        walls = []
        for _ in range(2):  # the first run warms up (captures), the second replays
            _sync(opts.device)
            began = time.perf_counter()
            decode.run(lm, ids, "baseline", max_new_tokens=opts.shape_tokens, fast_path="on")
            _sync(opts.device)
            walls.append(time.perf_counter() - began)
        stats = fastpath.stats(lm.runner)
    finally:
        del lm
        _free(opts.device)
    rows = [[key, value] for key, value in stats.items()]
    rows += [["first run s", round(walls[0], 2)], ["second run s", round(walls[1], 2)]]
    targets = [target("no failed captures", f"{stats['failed']} failed", stats["failed"] == 0 if opts.cuda else None)]
    return table(["figure", "value"], rows, targets, stats=stats, walls=walls)


# -- 8. model switch -----------------------------------------------------------------------------------------


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def section_switch(ctx: Context) -> dict[str, Any]:
    """Load a model, run it on the fast path, drop it: the model must die and (CUDA) its memory come back."""
    opts = ctx.opts
    _free(opts.device)
    before = _allocated(opts.device)
    lm = load(ModelSpec(name=opts.bench_model, dtype=opts.dtype, device=str(opts.device)))
    ids = ctx.rows(1)[0].encode(lm.tokenizer)
    decode.run(lm, ids, "baseline", max_new_tokens=4, fast_path="on")
    loaded = _allocated(opts.device)
    ref = weakref.ref(lm.model)
    del lm
    _free(opts.device)
    after = _allocated(opts.device)
    freed = ref() is None
    targets = [target("model freed after a fast-path run and a switch", "freed" if freed else "still alive", freed)]
    if opts.cuda:
        targets.append(target("CUDA memory back after a switch", f"{(after - before) / 2**20:+.1f} MiB",
                              after - before <= SWITCH_SLACK_BYTES))
    mib = [round(x / 2**20, 1) for x in (before, loaded, after)] if opts.cuda else ["-", "-", "-"]
    return table(["model", "freed", "MiB before", "MiB loaded", "MiB after"],
                 [[opts.bench_model, freed, *mib]], targets, before=before, loaded=loaded, after=after, freed=freed)


# -- 9. attention kernels ------------------------------------------------------------------------------------

VERIFY_ROWS = 8  # the verify the attention forms are timed on: a pld or Self-Draft step's size
SDPA_OPS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "math": "MATH"}


def _which_sdpa(lm: LoadedModel, ids: list[int], rows: int) -> str:
    """The SDPA op a forward of `rows` tokens after `ids` calls when no backend is forced, as the profiler sees it:
    a forward over a static cache of the fast path with graphs off (a graph replay shows the profiler no ops)."""
    from torch.profiler import ProfilerActivity, profile

    cache = fastpath.StaticKVCache(lm.runner, 256 * (1 + (len(ids) + fastpath.SLACK) // 256))
    cache.programs.graphs = False
    n = len(ids)
    with torch.inference_mode():
        lm.runner.forward(torch.tensor(ids), torch.arange(n), cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            lm.runner.forward(torch.tensor((ids * rows)[:rows]), torch.arange(n, n + rows), cache.view(n))
    names = {e.name.removeprefix("aten::_scaled_dot_product_") for e in prof.events()
             if e.name.startswith("aten::_scaled_dot_product_")}
    return ", ".join(sorted(names)) or "none seen"


def section_sdpa(ctx: Context) -> dict[str, Any]:
    """Each SDPA backend forced in turn: whether the fast path's forwards (a bool mask over the static cache) can
    run on it, and what a baseline step then costs with its programs captured anew under it; which op runs
    when none is forced, for one token and an 8-token verify; and the two forms of masked grouped-query
    attention (`_attention_forms`) timed and compared on a verify. The questions are a GPU's (flash kernels
    refuse a bool mask; grouped heads with a mask may leave the fused kernels); a CPU answers them for its own
    kernels, so the code cannot rot."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    opts = ctx.opts
    lm = ctx.model(opts.bench_model, opts.dtype)
    ids = ctx.rows(1)[0].encode(lm.tokenizer)
    rows, found = [], {}
    try:  # "default" first: the cost profile is measured (and saved) under no forced backend
        for label, backend in [("default", None), *SDPA_OPS.items()]:
            lm.runner.static_cache = None  # programs made (captured) anew under this backend
            scope = contextlib.nullcontext() if backend is None else sdpa_kernel(getattr(SDPBackend, backend))
            try:
                with scope:
                    for _ in range(2):  # the first run makes the programs, the second is timed
                        result = decode.run(lm, ids, "baseline", max_new_tokens=opts.shape_tokens, fast_path="on")
                found[label] = {"ms_per_token": _step_ms_per_token(result)}
                rows.append([label, "works", round(found[label]["ms_per_token"], 2)])
            except RuntimeError as exc:
                found[label] = {"error": str(exc).splitlines()[0][:200]}
                rows.append([label, "fails", "-"])
    finally:
        lm.runner.static_cache = None  # later sections capture under no forced backend
    chosen = {f"{t} token(s)": _which_sdpa(lm, ids, t) for t in (1, 8)}
    forms = _attention_forms(lm, ids, VERIFY_ROWS)
    for name, figures in forms.items():
        rows.append([f"{name} attention, {VERIFY_ROWS}-token verify", figures["logits"], round(figures["ms"], 2)])
    grouped_used = opts.device.type in attention.GROUPED_DEVICES
    faster = forms["grouped"]["ms"] < forms["stock"]["ms"]
    note = ("unforced, the op is " + "; ".join(f"{k}: {v}" for k, v in chosen.items())
            + f"; masked attention over grouped heads runs as {'grouped' if grouped_used else 'stock'} here")
    targets = [target(f"the faster exact attention form (a verify of {VERIFY_ROWS} tokens) is the one used",
                      f"grouped {forms['grouped']['ms']:.2f} ms, stock {forms['stock']['ms']:.2f} ms, "
                      f"logits {forms['grouped']['logits']}",
                      (grouped_used == (faster and forms["grouped"]["exact"])) if opts.cuda else None)]
    return table(["backend or form", "result", "baseline ms/token (verify: ms)"], rows, targets, results=found,
                 default_op=chosen, forms=forms, note=note)


def _attention_forms(lm: LoadedModel, ids: list[int], rows: int, repeats: int = 15) -> dict[str, dict[str, Any]]:
    """transformers' masked attention (keys and values repeated to every query head: "stock") against
    `attention.grouped` (torch's kernel told the grouping: "grouped") for a fast-path verify of `rows` tokens
    after `ids`: the median ms of each, and whether the grouped form's logits equal the stock form's (`exact`;
    `logits` says by how much they differ). On a GPU this says whether `attention.GROUPED_DEVICES` should include it."""
    runner, device = lm.runner, lm.runner.device
    n = len(ids)
    tokens, positions = torch.tensor((ids * rows)[:rows]), torch.arange(n, n + rows)
    found: dict[str, dict[str, Any]] = {}
    logits: dict[str, torch.Tensor] = {}
    try:
        for name in ("stock", "grouped"):
            with attention.grouped_on(device.type, name == "grouped"), torch.inference_mode():
                runner.static_cache = None  # programs made (captured) anew under this form
                cache = fastpath.cache_for(runner, n + rows)
                runner.forward(torch.tensor(ids), torch.arange(n), cache)
                verify = functools.partial(runner.forward, tokens, positions, cache.view(n))
                logits[name] = verify().float().cpu().clone()  # the first call makes (captures) the programs
                found[name] = {"ms": _time_ms(verify, device, repeats)}
    finally:
        runner.static_cache = None  # later sections capture under the form this device uses
    gap = float((logits["grouped"] - logits["stock"]).abs().max())
    found["stock"]["logits"] = "reference"
    found["grouped"].update(exact=gap == 0, logits="equal" if gap == 0 else f"max |diff| {gap:.3g}")
    return found


SECTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "bench": section_bench, "floors": section_floors, "dispatch": section_dispatch, "tests": section_tests,
    "identity": section_identity, "bf16": section_bf16, "syncs_launches": section_syncs_launches,
    "capture": section_capture, "switch": section_switch, "sdpa": section_sdpa,
}


# -- running and reporting -----------------------------------------------------------------------------------


# seconds each section may take on a GPU before its loops stop taking new items: the default run (every section)
# fits in about 8 minutes of a 15-minute lease, start and transfers included. A CPU has no budget.
BUDGET_S = {"tests": 60, "identity": 60, "bf16": 45, "bench": 150, "floors": 120, "syncs_launches": 40,
            "capture": 20, "switch": 15, "sdpa": 30, "dispatch": 40}


def run_section(name: str, ctx: Context) -> dict[str, Any]:
    """One section, never raising: status ok, skipped (with the reason) or error (with the error)."""
    started = time.perf_counter()
    ctx.deadline = started + BUDGET_S.get(name, 60) if ctx.opts.cuda else float("inf")
    try:
        result: dict[str, Any] = {"status": "ok", **SECTIONS[name](ctx)}
    except Skipped as exc:
        result = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # a failing section is a finding; the other sections still run
        result = {"status": "error", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def targets_of(sections: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target with its section; a section that errored is a failed target, a skipped one says why."""
    out = []
    for name, result in sections.items():
        if result["status"] == "error":
            out.append({"section": name, **target(f"section {name} runs", result["error"], False)})
        elif result["status"] == "skipped":
            out.append({"section": name, **target(f"section {name}", f"skipped: {result['reason']}", None)})
        else:
            out += [{"section": name, **t} for t in result["targets"]]
    return out


def verdict(ok: bool | None) -> str:
    return "PASS" if ok else ("n/a" if ok is None else "FAIL")


def _md_table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        return str(value).replace("|", "/").replace("\n", " ")

    return ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)] + \
        ["| " + " | ".join(map(cell, row)) + " |" for row in rows]


def summary_table(report: dict[str, Any]) -> str:
    """README's table: every target, what was measured, PASS / FAIL (n/a: a CUDA target on a CPU, or skipped)."""
    rows = [[t["section"], t["target"], t["measured"], verdict(t["pass"])] for t in report["targets"]]
    return "\n".join(_md_table(["section", "target", "measured", "result"], rows))


def format_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# gpucheck on {env['device_name']}", "",
             f"{'quick' if report['quick'] else 'full'} form, torch {env['torch']}, transformers "
             f"{env['transformers']}, python {env['python']}, {report['seconds']:.0f} s; "
             f"command `{report['command']}`", "", "## Targets", "", summary_table(report)]
    for name, result in report["sections"].items():
        lines += ["", f"## {name} ({result['status']}, {result['seconds']} s)", ""]
        if result["status"] == "ok":
            lines += _md_table(result["headers"], result["rows"])
            if result.get("note"):
                lines += ["", result["note"]]
        else:
            lines.append(result.get("reason") or result.get("error", ""))
    return "\n".join(lines) + "\n"


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'cpu'}, " \
        f"{torch.get_num_threads()} threads)"
    return {"device": str(device), "device_name": name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__, "python": platform.python_version()}


def run(out: Path, opts: Options, names: list[str] | None = None, command: str = "",
        progress: Callable[[str], None] | None = None, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the chosen sections (all by default) and write `out/report.json` and `out/report.md`; `provenance`
    (`specgui.tools.results.provenance`) leads report.json, as in every measured result."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(opts, out)
    started = time.perf_counter()
    sections: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {}
    for name in names or list(SECTIONS):
        if progress is not None:
            progress(name)
        sections[name] = run_section(name, ctx)
        report = _write(out, opts, sections, command, provenance, time.perf_counter() - started)
    ctx.held.clear()
    return report


def _write(out: Path, opts: Options, sections: dict[str, dict[str, Any]], command: str,
           provenance: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    """report.json and report.md of the sections run so far: rewritten after every section, so that a run stopped
    at a lease's end keeps what it measured."""
    report = {"provenance": provenance, "quick": opts.quick, "command": command,
              "environment": environment(opts.device),
              "options": {k: str(v) if isinstance(v, torch.device) else v for k, v in dataclasses.asdict(opts).items()},
              "seconds": seconds, "sections": sections}
    report["targets"] = targets_of(sections)
    dispatch = sections.get("dispatch", {})
    if dispatch.get("status") == "ok" and dispatch.get("compiled"):
        report["compiled"] = {k: dispatch["compiled"][k] for k in ("kernels_per_layer", "eager_ops_per_layer",
                                                                     "cache_reused")}
    if dispatch.get("status") == "ok":
        report["dispatch"] = {m: {k: f[k] for k in ("programs_per_pass_max", "programs_per_pass_mean",
                                                     "syncs_per_token", "eager_ops_per_step", "host_ms",
                                                     "host_critical_ms")}
                              for m, f in dispatch["dispatch"].items()}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    (out / "report.md").write_text(format_markdown(report), encoding="utf-8")
    return report

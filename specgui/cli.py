"""Command line: `python -m specgui generate | bench | presets | methods | profile | dv-search | gpucheck | smoke |
suite-time | stage-picture | first-minute | report`.

Every input problem (unknown method, bad number, missing file, malformed JSONL, unloadable model) exits
with status 2 and one line on stderr; arguments are checked before the model loads, so mistakes are
reported at once.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from specgui import methods
from specgui.errors import SpecGUIError
from specgui.methods.params import parse_setting, specs
from specgui.methods.presets import decoding_defaults


class Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SpecGUIError(message)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="'embedded' (default), a hub id, a local directory, or "
                   "random:SHAPE (real shape, random weights: smollm2-135m, llama-1b, llama-3b, llama-8b; tiny: a toy)")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--device-map", default=None, help="'auto' to spread a large model over devices (accelerate)")
    p.add_argument("--quantization", default=None, help="8bit or 4bit (bitsandbytes)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--small-batch-matmul", choices=("on", "off"), default="on",
                   help="CPU: compute 1-64 row products in the form measured fastest per shape (torch's, "
                   "transposed, or the skinny kernel; specgui/cpu/kernels.py); off: torch's kernel only")


def _output_args(p: argparse.ArgumentParser, kind: str, with_json: bool = True) -> None:
    """Where a measuring command writes its results (with their provenance): `--json` anywhere, `--save` to this
    machine's `results/<machine>/<kind>.json`, which `python -m specgui report` renders into the docs."""
    if with_json:
        p.add_argument("--json", default=None, metavar="OUT.json", help="write the results (with provenance) here")
    p.add_argument("--save", action="store_true", help=f"also write results/<machine>/{kind}.json (what the docs "
                   "render)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    defaults = decoding_defaults()  # configs/decoding.yaml, shared with the app
    p.add_argument("--max-new-tokens", type=int, default=defaults["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=defaults["temperature"], help="0 = greedy")
    p.add_argument("--top-p", type=float, default=defaults["top_p"])
    p.add_argument("--top-k", type=int, default=defaults["top_k"], help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--pipeline", choices=("on", "off"), default="on",
                   help="on: a step's event goes out while the next step's forward runs; off: the serial loop, each "
                        "step's event before the next step begins (for comparison; see specgui/core/decode.py)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="method parameter override (bench: METHOD.KEY=VALUE); repeatable")
    _path_args(p)


def _path_args(p: argparse.ArgumentParser) -> None:
    """The decoding path: the fast path (static shapes, CUDA graphs) and whether its programs are compiled."""
    p.add_argument("--fast-path", choices=("auto", "on", "off"), default="auto",
                   help="static shapes and CUDA graphs (auto: on a CUDA GPU; see specgui/fastpath/)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="the fast path's programs as inductor's kernels, compiled once per machine (auto: on a CUDA "
                        "GPU; on: a CPU too, slow to compile; see specgui/fastpath/compiled.py)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m specgui", description="Self-speculative decoding, step by step.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    gen = sub.add_parser("generate", help="generate text with one method")
    gen.add_argument("--method", default="baseline")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--trace", default=None, metavar="FILE.json", help="write every event as JSON")
    add_model_args(gen)
    _sampling_args(gen)

    bench = sub.add_parser("bench", help="benchmark methods on a prompt suite")
    bench.add_argument("--methods", default="baseline,pld", help="comma-separated; METHOD+KEY=VALUE adds a variant "
                       "(e.g. clasp,clasp+draft_vocab=0: a method against itself under another setting)")
    bench.add_argument("--preset", default=None, help="a paper's comparison (configs/papers/): its methods and "
                       "categories, and its table beside ours (e.g. clasp-paper, selfdraft-paper, asd-paper)")
    bench.add_argument("--prompts", default="suite", help="JSONL file, or 'suite' for the built-in suite")
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep")
    bench.add_argument("--limit", type=int, default=None, help="at most this many prompts per category")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--profile", action="store_true", help="print time per phase and method figures")
    _output_args(bench, "heldout")  # run it on assets/heldout.jsonl
    add_model_args(bench)
    _sampling_args(bench)

    demos = sub.add_parser("presets", help="measure every demo preset (configs/demos.yaml) against plain decoding")
    demos.add_argument("--repeats", type=int, default=3)
    _output_args(demos, "presets")
    _path_args(demos)
    add_model_args(demos)

    sub.add_parser("methods", help="list methods and their parameters")

    prof = sub.add_parser("profile", help="the cost model's measured profile of a model on this device")
    prof.add_argument("--refresh", action="store_true", help="measure again instead of reading the saved profile")
    _path_args(prof)
    prof.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                      help="also time a layer-skip draft token with the full LM head and over a draft vocabulary of N "
                           "ids (0: not)")
    _output_args(prof, "profile")
    add_model_args(prof)

    search = sub.add_parser("dv-search", help="search (or show the cached) Draft & Verify skip set for a model")
    search.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="dv parameter override (search settings: iterations, init_points, calibration, ...)")
    add_model_args(search)

    _device_checks(sub)

    suite = sub.add_parser("suite-time", help="run the test suite as README's test command does and time it")
    _output_args(suite, "suite")

    shot = sub.add_parser("stage-picture", help="take README's picture again: a finished race in the stage view")
    shot.add_argument("--out", default="assets/stage-race.png", metavar="FILE.png")
    shot.add_argument("--preset", default=None, help="a demo preset's name (default: the first)")

    first = sub.add_parser("first-minute", help="time app.py's cold and warm starts and its first two races in "
                           "headless chromium (results/<machine>/startup.json)")
    first.add_argument("--port", type=int, default=7870, help="where the measured app listens")
    first.add_argument("--cache", default=None, help="a cache folder to start on (default: a fresh one); with it the "
                       "cold start is left out unless it is empty")
    _output_args(first, "startup")

    rep = sub.add_parser("report", help="render results/*.json into README.md and docs/ between report markers")
    rep.add_argument("--check", action="store_true", help="change nothing; exit 1 if a rendered block is stale")
    return parser


def _device_checks(sub: Any) -> None:
    """The fast path's checks on this device: gpucheck (its figures and targets) and the smoke (every method's first
    run on a fresh cache)."""
    check = sub.add_parser("gpucheck", help="validate the fast path on this device (GPU or CPU): report.md and .json")
    check.add_argument("--out", required=True, metavar="DIR", help="folder for report.md, report.json and logs")
    check.add_argument("--quick", action="store_true", help="the short form (CI on a CPU): few tokens, toy shapes")
    check.add_argument("--sections", default=None, help="comma-separated subset (default: all): "
                       "bench, floors, dispatch, tests, identity, bf16, syncs_launches, capture, switch, sdpa")
    check.add_argument("--methods", default=None, help="comma-separated methods (default: every method)")
    check.add_argument("--device", default="auto", help="auto, cpu or cuda")
    check.add_argument("--prompts", type=int, default=None, help="bench prompts (default: 8 on a GPU, 4 on a CPU)")
    check.add_argument("--tokens", type=int, default=None, help="bench new tokens (default: 64 on a GPU, 48 on a CPU)")
    _output_args(check, "gpucheck", with_json=False)  # --out holds its report.json

    smoke = sub.add_parser("smoke", help="the GPU path's first check: every method first on a fresh cache, pipelined "
                           "and serially, its tokens against plain decoding's, its cache free of NaN; one line a check")
    smoke.add_argument("--emulate", action="store_true", help="on a CPU: the emulated CUDA device "
                       "(specgui/fastpath/emulation.py)")
    smoke.add_argument("--model", default="tiny", help="tiny (in-process, no weights; default) or embedded")
    smoke.add_argument("--dtypes", default=None, help="comma-separated (default: float32,bfloat16 on a GPU; float32 "
                       "emulated)")
    smoke.add_argument("--methods", default=None, help="comma-separated methods (default: every method)")
    smoke.add_argument("--tokens", type=int, default=24, help="new tokens a run (default 24)")
    smoke.add_argument("--sequence", action="store_true", help="also every method after every other on one runner, "
                       "a compile toggle, a growing cache and plan changes inside a run")


def _overrides(items: list[str], scoped: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, value = parse_setting(item, f"--param {item!r}: expected KEY=VALUE")
        if scoped:
            method, dot, key = key.partition(".")
            if not dot:
                raise SpecGUIError(f"--param {item!r}: bench expects METHOD.KEY=VALUE")
            methods.get(method)
            out.setdefault(method, {})[key] = value
        else:
            out[key] = value
    return out


def _sampling(args: argparse.Namespace):
    from specgui.core.sampling import Sampling

    if args.max_new_tokens < 1:
        raise SpecGUIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def load_model(args: argparse.Namespace):
    from specgui.fastpath import compiled
    from specgui.model.loading import ModelSpec, load

    lm = load(ModelSpec(name=args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                        quantization=args.quantization, trust_remote_code=args.trust_remote_code,
                        small_batch_matmul=args.small_batch_matmul == "on"))
    lm.runner.compile_mode = compiled.with_path(getattr(args, "fast_path", "auto"), getattr(args, "compile", "auto"))
    return lm


def cmd_generate(args: argparse.Namespace) -> None:
    from specgui.core import decode
    from specgui.core.events import Summary, save_trace
    from specgui.core.text import encode_prompt

    methods.get(args.method)
    sampling = _sampling(args)
    overrides = _overrides(args.param, scoped=False)
    device = args.device if args.device != "auto" else "cpu"  # presets per device; ranges are the same
    methods.params_for(args.method, args.model, device.split(":")[0], overrides)  # before the model loads
    if not args.prompt.strip():
        raise SpecGUIError("the prompt is empty: pass some text with --prompt")
    if args.trace:
        parent = Path(args.trace).resolve().parent
        if not parent.is_dir():
            raise SpecGUIError(f"cannot write trace: folder {str(parent)!r} does not exist")
    lm = load_model(args)
    ids = encode_prompt(lm.tokenizer, args.prompt, chat=not args.raw)
    events = list(decode.generate(lm, ids, args.method, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  params=overrides, prompt_text=args.prompt, fast_path=args.fast_path,
                                  pipeline=args.pipeline == "on"))
    summary: Summary = events[-1]
    print(summary.text)
    print(f"[{args.method}] {summary.new_tokens} tokens in {summary.wall_s:.2f} s = {summary.tokens_per_s:.1f} tok/s, "
          f"tau {summary.tau:.2f}, acceptance {summary.acceptance_rate:.0%}, {summary.steps} steps, "
          f"stop: {summary.stop}", file=sys.stderr)
    if args.trace:
        save_trace(events, args.trace)


def cmd_bench(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from specgui.tools import bench, papers, results
    from specgui.tools.prompts import PromptRow, load_prompts, select

    sampling = _sampling(args)
    preset = papers.load(args.preset) if args.preset else None
    names = list(preset.methods) if preset else args.methods.split(",")
    entries = bench.entries_for(names, _overrides(args.param, scoped=True))
    if args.repeats < 1:
        raise SpecGUIError(f"--repeats must be >= 1, got {args.repeats}")
    categories = args.categories.split(",") if args.categories else (preset.categories if preset else None)
    rows = select(load_prompts(args.prompts), categories, args.limit)
    results.writable(args.json)
    lm = load_model(args)
    settings = bench.Settings(max_new_tokens=args.max_new_tokens, repeats=args.repeats, sampling=sampling,
                              fast_path=args.fast_path, compile=args.compile, pipeline=args.pipeline == "on")
    device = str(lm.runner.device)
    origin = results.provenance(device, args.argv)

    def save(report: dict, standard: bool = False) -> None:  # after every prompt: a stopped bench keeps its rows
        report["provenance"] = origin
        results.write("heldout", report, device, args.json, standard)

    with tqdm(total=len(rows) * len(entries) * args.repeats, desc="bench", unit="run", file=sys.stderr) as bar:

        def progress(entry: bench.Entry, row: PromptRow) -> None:
            bar.set_postfix_str(f"{entry.label} on {row.id}", refresh=False)
            bar.update()

        report = bench.bench(lm, rows, entries, settings, progress=progress, partial=save,
                             prepared=lambda note: bar.write(f"bench: {bench.preparation_line(note)}", file=sys.stderr))
    print(bench.format_report(report, profile=args.profile))
    if preset:
        headers, table = papers.table(report, preset)
        report["paper"] = {"preset": preset.name, "caption": papers.caption(report, preset), "headers": headers,
                           "rows": table}
        print("\n" + papers.format_table(report, preset))
    save(report, args.save)


def cmd_presets(args: argparse.Namespace) -> None:
    """Each demo preset's method against plain decoding on the preset's prompt, budget and parameters, `--repeats`
    times (paired by round, as `bench` takes them): the table the README shows beside the preset picker."""
    from specgui.tools import bench, results
    from specgui.ui.controls import examples, presets

    if args.repeats < 1:
        raise SpecGUIError(f"--repeats must be >= 1, got {args.repeats}")
    chosen = presets(examples())  # checked before the model loads
    results.writable(args.json)
    lm = load_model(args)
    device = str(lm.runner.device)
    out: dict[str, Any] = {"provenance": results.provenance(device, args.argv), "model": lm.name,
                           "repeats": args.repeats, "presets": []}
    for preset in chosen:
        settings = bench.Settings(max_new_tokens=preset.max_new_tokens, repeats=args.repeats, fast_path=args.fast_path,
                                  compile=args.compile)
        entries = bench.entries_for([preset.method], {preset.method: preset.params})
        report = bench.bench(lm, [preset.example.row], entries, settings)
        row = {"name": preset.name, "method": preset.method, "prompt": preset.example.row.id,
               "max_new_tokens": preset.max_new_tokens, "params": preset.params,
               "baseline_tokens_per_s": report["methods"]["baseline"]["tokens_per_s"],
               **{k: report["methods"][preset.method][k] for k in
                  ("speedup", "predicted_speedup", "ceiling", "mean_accepted", "identical", "total")}}
        out["presets"].append(row)
        print(f"{preset.method:<10} {preset.example.row.id:<16} {row['speedup']:.2f}x  tau "
              f"{row['mean_accepted'] or 1.0:.2f}  {preset.name}", flush=True)
        results.write("presets", out, device, args.json, standard=False)  # a stopped run keeps its rows
    results.write("presets", out, device, args.json, args.save)


def cmd_methods(args: argparse.Namespace) -> None:
    for name in methods.names():
        cls = methods.get(name)
        print(f"{name:<10} {cls.summary}")
        for spec in specs(cls.Params):
            bounds = f"[{spec['low']}, {spec['high']}]" if spec.get("low") is not None else ""
            choices = "{" + ", ".join(map(str, spec["choices"])) + "}" if spec.get("choices") else ""
            print(f"    {spec['name']:<18} {bounds or choices:<14} {spec['help']}")


def cmd_profile(args: argparse.Namespace) -> None:
    """Measure (or read) the profile, let every method measure its mechanism on a short run, print it all."""
    from specgui import costs, fastpath
    from specgui.core import decode, vocab
    from specgui.core.text import encode_prompt
    from specgui.cpu import kernels
    from specgui.tools import results

    results.writable(args.json)
    lm = load_model(args)
    simd = kernels.simd_label() if lm.runner.device.type == "cpu" else None
    if simd is not None:
        print(f"skinny kernels: {simd}" + (" (forced by SPECGUI_SIMD)" if results.simd_forced() else ""))
    fast = fastpath.resolve(args.fast_path, lm.runner)
    profile = costs.profile_for(lm, fast, refresh=args.refresh, run=decode.run)
    ids = encode_prompt(lm.tokenizer, "Summarise: the cost model measures what each forward costs.")
    for name in methods.names():
        decode.run(lm, ids, name, max_new_tokens=8, fast_path=args.fast_path, profile=profile)
    # before the summary: the draft vocabulary's head price it measures is one of the profile's mechanisms
    tokens = vocab.draft_token_costs(profile, lm.runner, args.draft_vocab) if args.draft_vocab > 0 else []
    print(profile.summary())
    if tokens:
        print(f"\na layer-skip draft token (ms, one row after {profile.contexts[0]} cached tokens), the full LM head "
              f"against a draft vocabulary of {args.draft_vocab} ids, measured beside a plain forward at the "
              "profile's price of it (priced):")
        for row in tokens:
            print(f"  {row['layers']:>3} layers skipped: {row['full_ms']:6.2f} ({row['full_priced_ms']:6.2f}) -> "
                  f"{row['vocab_ms']:6.2f} ({row['vocab_priced_ms']:6.2f}), {row['change']:+.0%} "
                  f"({row['priced_change']:+.0%})")
    data = {"provenance": results.provenance(str(lm.runner.device), args.argv), "model": lm.name,
            **profile.curve(), "head": profile.head, "key": profile.key, **({"simd": simd} if simd else {}),
            **({"draft_tokens": {"size": args.draft_vocab, "context": profile.contexts[0], "rows": tokens}}
               if tokens else {})}
    results.write("profile", data, str(lm.runner.device), args.json, args.save)


def cmd_dv_search(args: argparse.Namespace) -> None:
    from specgui import costs, fastpath
    from specgui.core import decode
    from specgui.methods.layerskip import dv

    overrides = _overrides(args.param, scoped=False)
    device = args.device if args.device != "auto" else "cpu"
    methods.params_for("dv", args.model, device.split(":")[0], overrides)  # before the model loads
    lm = load_model(args)
    params = methods.params_for("dv", lm.name, lm.runner.device.type, overrides)
    profile = costs.profile_for(lm, fastpath.resolve("auto", lm.runner), run=decode.run)  # measured on a fresh cache
    result, cached = dv.load_or_search(lm.runner, lm.tokenizer, params, profile)
    print(f"{'cached' if cached else 'searched'}: {dv.cache_path(lm.runner, params)}")
    print(f"skip attention {result.attn}, MLP {result.mlp}; predicted speedup {result.objective:.3f} at K = "
          f"{result.draft_len} (matchness {result.matchness:.3f}, draft cost {result.draft_cost:.3f}); "
          f"{result.iterations} sets scored in {result.seconds:.1f} s")


def cmd_gpucheck(args: argparse.Namespace) -> int:
    """Run the checks; exit 1 when a target fails or a section errs (the report says which)."""
    from specgui.tools import gpucheck, results

    names = [n.strip() for n in args.sections.split(",") if n.strip()] if args.sections else None
    unknown = [n for n in names or [] if n not in gpucheck.SECTIONS]
    if unknown or names == []:
        raise SpecGUIError(f"unknown section {', '.join(map(repr, unknown)) or repr(args.sections)}: choose from "
                           f"{', '.join(gpucheck.SECTIONS)}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SpecGUIError(f"--out {args.out!r} is a file, not a folder")
    chosen = [n.strip() for n in args.methods.split(",") if n.strip()] if args.methods else None
    opts = gpucheck.options(args.device, args.quick, chosen, prompts=args.prompts, tokens=args.tokens)
    flags = [("--quick", args.quick), (f"--sections {args.sections}", args.sections),
             (f"--methods {args.methods}", args.methods), (f"--device {args.device}", args.device != "auto"),
             (f"--prompts {args.prompts}", args.prompts), (f"--tokens {args.tokens}", args.tokens)]
    command = " ".join(["python -m specgui gpucheck --out", args.out] + [flag for flag, given in flags if given])
    device = "cuda" if opts.cuda else "cpu"
    report = gpucheck.run(out, opts, names, command=command, provenance=results.provenance(device, args.argv),
                          progress=lambda name: print(f"gpucheck: {name} ...", file=sys.stderr, flush=True))
    print(gpucheck.summary_table(report))
    print(f"\n{report['seconds']:.0f} s; report in {out / 'report.md'} and {out / 'report.json'}")
    # the dispatch counts alone (any device, CI's CPU included) are a result of their own: not a GPU's check
    kind = names[0] if names in (["dispatch"], ["floors"]) else "gpucheck"  # results of their own
    results.write(kind, report, device, None, args.save)
    return 1 if any(t["pass"] is False for t in report["targets"]) else 0


def cmd_suite_time(args: argparse.Namespace) -> int:
    """Run the pytest part of README's test command, time it, count the outcomes; exit as the suite did."""
    import subprocess
    import time

    from specgui import REPO_DIR
    from specgui.tools import results

    command = results.suite_command()
    results.writable(args.json)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_DIR, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n")
    workers = int(command[command.index("-n") + 1]) if "-n" in command else 1
    data = {"provenance": results.provenance("cpu", args.argv), "command": " ".join(command[1:]), "seconds": seconds,
            "exit_code": done.returncode, **results.suite_counts(done.stdout), "workers": workers}
    print(f"suite: {seconds:.0f} s, {data['passed']} passed, {data['failed']} failed, {data['skipped']} skipped")
    results.write("suite", data, "cpu", args.json, args.save)
    return done.returncode


def cmd_stage_picture(args: argparse.Namespace) -> None:
    from specgui.tools import picture

    print(f"saved {picture.take(Path(args.out), args.preset)}")


def cmd_first_minute(args: argparse.Namespace) -> None:
    from specgui.tools import firstminute, results

    results.writable(args.json)
    cache = Path(args.cache) if args.cache else None
    cold = cache is None or not (cache.is_dir() and any(cache.iterdir()))
    data = {"provenance": results.provenance("cpu", args.argv), **firstminute.measure(cache, args.port, cold)}
    results.write("startup", data, "cpu", args.json, args.save)


def cmd_report(args: argparse.Namespace) -> int:
    from specgui.tools import report

    stale = report.render_all(check=args.check)
    for path, name in stale:
        print(f"{path}: block {name!r} {'differs from its results JSON' if args.check else 'rendered'}")
    return 1 if args.check and stale else 0


def cmd_smoke(args: argparse.Namespace) -> int:
    from specgui.tools import smoke

    return smoke.main(args)


def main(argv: list[str] | None = None) -> int:
    warnings.simplefilter("once")  # a library warning raised on every forward (bitsandbytes' casts) is shown once
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(argv) if argv is not None else sys.argv[1:]  # a result's provenance names the command
        commands = {"generate": cmd_generate, "bench": cmd_bench, "presets": cmd_presets, "methods": cmd_methods,
                    "profile": cmd_profile, "dv-search": cmd_dv_search, "gpucheck": cmd_gpucheck,
                    "suite-time": cmd_suite_time, "stage-picture": cmd_stage_picture, "report": cmd_report,
                    "first-minute": cmd_first_minute, "smoke": cmd_smoke}
        status = commands[args.command](args)
    except SpecGUIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status or 0

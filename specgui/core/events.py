"""Events: the only thing the decoding core tells the world.

`decode.generate` yields `Start`, one `Prefill`, one `Step` per draft -> verify cycle, and a final
`Summary`. Front ends (CLI, bench, app) build everything they show from these; a trace is the list of
events as JSON and loads back into the same dataclasses, so a recorded run replays without a model.
Token text is included (`*_pieces`) for that reason: a replay has no tokenizer.

Method payloads (`Prefill.payload`, `Step.payload`) are JSON-ready dicts. Keys any front end may rely
on; a method sets the ones that apply, and new keys are fine:

  "skip":          {"attn": [layer, ...], "mlp": [layer, ...]} sub-layers the draft skipped (layer skip)
  "reoptimized":   true when the skip set was recomputed this step (CLaSp), with "dp_score" (cosine of
                   the DP's final state to the full model's) and "dp_ms"
  "acs":           [cosine per layer] attention in/out similarity over the prompt (ADMG, in Prefill)
  "exit":          {"threshold": t, "confidences": [top-1 prob per draft token], "reason": why the
                   draft stopped ("threshold", "limit", "budget"), or "paused" when it drafted nothing}
  "draft_len":     the draft length the cost model chose (0: paused)
  "plan":          the cost model's sizing decision (`specgui.methods.policy.Sizing`): {"size", "mode" (draft,
                   probe, paused, fixed), "predicted" and "best" speedups of a step, "expected" accepted}
  "fractal_layers": [layer, ...] where compressed passes are spliced in (Fractal, in Prefill and Step)
  "origin":        [fractal layer per draft node] which fractal layer produced the node's final token
  "branches":      [[token, ...] per branch] Self-Draft's draft branches as fed to this forward
  "candidates":    [{"nodes": [node, ...], "source": "context" | "corpus" | "pool", "key": [token, ...]}]
  "hit":           {"candidate": index, "tokens": accepted count} the candidate the verifier kept
  "cache_sizes":   {"context": n, "corpus": n} n-gram cache sizes
  "ngram":         length of the matched suffix (prompt lookup)
  "search":        the skip-set search. SWIFT, every step: {"phase": "optimizing" | "done", "iteration": n,
                   "best": matchness}, plus on a step that scored a proposal "kind" ("random" | "bayes"),
                   "score" and "kept". Draft & Verify, in Prefill: {"cached", "iterations", "seconds",
                   "objective" (predicted speedup), "matchness", "draft_cost", "draft_len"}
  "proposal":      {"attn": [...], "mlp": [...]} the skip set SWIFT scored this step (not the one that drafted)
  "window":        [[token, ...] per level] Lookahead's window as fed; level 0 starts with the pending token
  "harvested":     n-grams the lookahead window added to its pool this step ("cache_sizes": {"pool": n})
Any key ending in "_ms" is a per-call time that `bench --profile` averages.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from specgui.errors import SpecGUIError

TRACE_FORMAT = "specgui-trace"
TRACE_VERSION = 1
MAX_TRACE_BYTES = 32 * 1024 * 1024
MAX_DEPTH = 32  # JSON nesting a trace may have (a real one: ~6)
MAX_LAYERS = 1024  # a trace's num_layers sizes its layer strips and heat maps: no model has more


@dataclass(frozen=True)
class Start:
    """The run's header: what ran, on what, with which settings."""

    kind: ClassVar[str] = "start"
    method: str
    model: str
    device: str
    num_layers: int
    params: dict[str, Any]
    sampling: dict[str, Any]
    max_new_tokens: int
    prompt_ids: tuple[int, ...]
    prompt_text: str
    fast_path: bool = False  # static shapes and, on a GPU, CUDA graphs (`specgui.fastpath`)
    compiled: bool = False  # the fast path's programs run inductor's kernels (`specgui.fastpath.compiled`)
    costs: dict[str, Any] = field(default_factory=dict)  # the cost profile's forward curve (`CostProfile.curve`)


@dataclass(frozen=True)
class Prefill:
    """The prompt forward, which also yields the first new token."""

    kind: ClassVar[str] = "prefill"
    prompt_tokens: int
    token: int
    piece: str
    margin: float
    ms: float
    overhead_ms: float
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One draft -> verify cycle.

    The draft is a tree: `draft_parents[i]` is the parent node of node i (-1: the pending token), a
    chain when every node's parent is the one before. `path` lists the accepted nodes; `token` is the
    verifier's own token, a correction when `corrected` (a draft token was rejected there), else a
    bonus. `emitted` is what this step appended to the output, `margins` the target's top-1 minus
    top-2 logit for each emitted token (small margins flag numerical near-ties).
    """

    kind: ClassVar[str] = "step"
    index: int
    draft_tokens: tuple[int, ...]
    draft_parents: tuple[int, ...]
    draft_pieces: tuple[str, ...]
    path: tuple[int, ...]
    token: int
    corrected: bool
    emitted: tuple[int, ...]
    emitted_pieces: tuple[str, ...]
    margins: tuple[float, ...]
    forward_tokens: int
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    payload: dict[str, Any] = field(default_factory=dict)
    predicted_ms: float = 0.0  # the cost model's price of this step (draft work + a verify of forward_tokens)
    plain_ms: float = 0.0  # the cost model's price of a plain step at this context
    capture_ms: float = 0.0  # programs captured inside this step (a plan adopted): left out of its draft and verify ms

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def drafted(self) -> int:
        return len(self.draft_tokens)

    @property
    def proposal(self) -> tuple[int, ...]:
        """The draft line shown to a reader: the accepted path, then the drafter's first choice onward."""
        line = list(self.path)
        node = line[-1] if line else -1
        while True:
            child = next((i for i, p in enumerate(self.draft_parents) if p == node), None)
            if child is None:
                return tuple(line)
            line.append(child)
            node = child

    @property
    def rejected(self) -> tuple[int, ...]:
        """Nodes of `proposal` after the accepted ones (first rejected first)."""
        return self.proposal[self.accepted :]


@dataclass(frozen=True)
class Summary:
    """Totals of a finished (or stopped) run."""

    kind: ClassVar[str] = "summary"
    new_tokens: int
    steps: int
    wall_s: float
    tokens_per_s: float
    tau: float  # tokens per verify forward, verifier's own token included (plain decoding: 1.0)
    drafted: int
    accepted: int
    acceptance_rate: float
    histogram: tuple[int, ...]  # histogram[k] = steps that accepted k draft tokens
    prefill_s: float
    draft_s: float
    verify_s: float
    overhead_s: float
    stop: str  # "eos", "length" or "cancelled"
    token_ids: tuple[int, ...]
    text: str
    predicted_s: float = 0.0  # the prompt forward as measured + every step as the cost model prices it
    plain_s: float = 0.0  # the prompt forward as measured + plain steps for the same tokens, priced alike
    prompt_s: float = 0.0  # the prompt forward as measured, in both of the above (0: a trace from before it was kept)

    @property
    def predicted_speedup(self) -> float | None:
        """The overall speedup the cost model predicts for this run, prompt forward included, as the measured
        tokens/s ratio counts it (None without a prediction)."""
        return self.plain_s / self.predicted_s if self.predicted_s > 0 and self.plain_s > 0 else None

    @property
    def predicted_per_step(self) -> float | None:
        """The speedup the cost model predicts over the decode steps alone, the measured per-step figure's
        counterpart (None without a prediction or in a trace that did not record the prompt forward)."""
        if self.predicted_speedup is None or self.prompt_s <= 0 or self.predicted_s <= self.prompt_s:
            return None
        return (self.plain_s - self.prompt_s) / (self.predicted_s - self.prompt_s)


Event = Start | Prefill | Step | Summary
EVENT_TYPES: dict[str, type] = {cls.kind: cls for cls in (Start, Prefill, Step, Summary)}


def summarize(
    steps: list[Step],
    prefill: Prefill,
    *,
    wall_s: float,
    stop: str,
    token_ids: tuple[int, ...],
    text: str,
) -> Summary:
    """Fold a run's events into its totals (also used to rebuild a summary from a partial trace)."""
    drafted = sum(s.drafted for s in steps)
    accepted = sum(s.accepted for s in steps)
    emitted_in_steps = sum(len(s.emitted) for s in steps)
    counts = Counter(s.accepted for s in steps)
    histogram = tuple(counts.get(k, 0) for k in range(max(counts, default=-1) + 1))
    new_tokens = len(token_ids)
    predicted = all(s.predicted_ms > 0 for s in steps) and bool(steps)
    prompt_s = (prefill.ms + prefill.overhead_ms) / 1000
    return Summary(
        new_tokens=new_tokens,
        steps=len(steps),
        wall_s=wall_s,
        tokens_per_s=new_tokens / wall_s if wall_s > 0 else 0.0,
        tau=emitted_in_steps / len(steps) if steps else 1.0,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        histogram=histogram,
        prefill_s=prefill.ms / 1000,
        draft_s=sum(s.draft_ms for s in steps) / 1000,
        verify_s=sum(s.verify_ms for s in steps) / 1000,
        overhead_s=(prefill.overhead_ms + sum(s.overhead_ms for s in steps)) / 1000,
        stop=stop,
        token_ids=token_ids,
        text=text,
        predicted_s=prompt_s + sum(s.predicted_ms for s in steps) / 1000 if predicted else 0.0,
        plain_s=prompt_s + sum(len(s.emitted) * s.plain_ms for s in steps) / 1000 if predicted else 0.0,
        prompt_s=prompt_s,
    )


# -- JSON -------------------------------------------------------------------------------------------------


# What a run measured, and nothing else: the phases' ms (a step's, the prefill's) and the Summary's sums and rates of
# them. The cost model's prices (a Step's predicted_ms and plain_ms) are no measurement under an uncalibrated profile.
# The Summary's predicted_s and plain_s add the measured prompt forward (prompt_s) to those prices. In payloads, what
# methods time themselves: every `*_ms` and `*_ratio` (a DP's or a search's ms, Fractal's measured over priced cost),
# and CLaSp's plan prices, which count its last DP's measured time (`dp_ms`) as its overhead.
TIMED: dict[type, tuple[str, ...]] = {
    Start: (), Prefill: ("ms", "overhead_ms"), Step: ("draft_ms", "verify_ms", "overhead_ms", "capture_ms"),
    Summary: ("wall_s", "tokens_per_s", "prefill_s", "draft_s", "verify_s", "overhead_s", "prompt_s", "predicted_s",
              "plain_s")}
PRICED_BY_OWN_CLOCK = {"clasp": ("predicted", "best")}


def untimed(event: Event, method: str) -> Event:
    """`event` of a run of `method` with what was measured cleared (`TIMED`; the Summary's prices less the measured
    prompt forward, rounded): two runs that decoded alike give equal untimed events, whatever their clocks read."""
    cleared: dict[str, Any] = {name: 0.0 for name in TIMED[type(event)]}
    if isinstance(event, Summary):
        for name in ("predicted_s", "plain_s"):  # 0: no prediction (no step)
            priced = getattr(event, name)
            cleared[name] = round(priced - event.prompt_s, 9) if priced else 0.0
    if isinstance(event, Prefill | Step):
        cleared["payload"] = _untimed_payload(event.payload, PRICED_BY_OWN_CLOCK.get(method, ()))
    return dataclasses.replace(event, **cleared)


def _untimed_payload(value: Any, priced: tuple[str, ...], key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _untimed_payload(v, priced, k) for k, v in value.items()
                if not k.endswith(("_ms", "_ratio")) and not (key == "plan" and k in priced)}
    if isinstance(value, list):
        return [_untimed_payload(v, priced) for v in value]
    return value


def to_json(event: Event) -> dict[str, Any]:
    """An event as a JSON-ready dict with a "type" tag."""
    return {"type": event.kind, **dataclasses.asdict(event)}


def from_json(data: Any) -> Event:
    """Rebuild an event from `to_json` output, checking every field's type (traces are untrusted input)."""
    if not isinstance(data, dict) or data.get("type") not in EVENT_TYPES:
        raise SpecGUIError(f"not a SpecGUI event: {str(data)[:80]!r}")
    cls = EVENT_TYPES[data["type"]]
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue  # a trace from before this field existed
            raise SpecGUIError(f"{data['type']} event is missing field {f.name!r}")
        values[f.name] = _coerce(data[f.name], hints[f.name], f"{data['type']}.{f.name}")
    return cls(**values)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, list):
            return tuple(_coerce(v, args[0], where) for v in value)
    elif origin is dict and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return value
    raise SpecGUIError(f"trace field {where} has the wrong type ({type(value).__name__})")


def check_step(step: Step) -> None:
    """Refuse a step whose parts do not fit together (a trace is untrusted: front ends index by these)."""
    n = step.drafted
    if len(step.draft_parents) != n or len(step.draft_pieces) != n or len(step.emitted_pieces) != len(step.emitted):
        raise SpecGUIError(f"trace step {step.index}: draft or emitted lists differ in length")
    if any(not -1 <= parent < i for i, parent in enumerate(step.draft_parents)):
        raise SpecGUIError(f"trace step {step.index}: a draft node's parent is not an earlier node")
    if any(not 0 <= node < n or step.draft_parents[node] != parent
           for node, parent in zip(step.path, (-1, *step.path))):
        raise SpecGUIError(f"trace step {step.index}: the accepted path is not a path through the draft")


def dumps_trace(events: list[Event]) -> str:
    return json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION, "events": [to_json(e) for e in events]})


def loads_trace(text: str | bytes) -> list[Event]:
    """Parse a trace, refusing anything too large, malformed, or out of order."""
    if len(text) > MAX_TRACE_BYTES:
        raise SpecGUIError(f"trace is larger than {MAX_TRACE_BYTES // 2**20} MiB")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecGUIError(f"trace is not valid JSON: {exc}") from None
    except RecursionError:
        raise SpecGUIError(f"trace is nested deeper than {MAX_DEPTH} levels") from None
    if _depth(data) > MAX_DEPTH:  # what reads it later recurses: 500 levels broke the replay outside any check
        raise SpecGUIError(f"trace is nested deeper than {MAX_DEPTH} levels")
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT or not isinstance(data.get("events"), list):
        raise SpecGUIError("not a SpecGUI trace (expected an object with format 'specgui-trace' and events)")
    if data.get("version") != TRACE_VERSION:
        raise SpecGUIError(f"unsupported trace version {data.get('version')!r} (this build reads {TRACE_VERSION})")
    events = [from_json(e) for e in data["events"]]
    for event in events:
        if isinstance(event, Step):
            check_step(event)
    if not events or not isinstance(events[0], Start) or sum(isinstance(e, Start) for e in events) != 1:
        raise SpecGUIError("trace must begin with exactly one start event")
    if not 1 <= events[0].num_layers <= MAX_LAYERS:
        raise SpecGUIError(f"trace's num_layers must lie in 1..{MAX_LAYERS}, got {events[0].num_layers}")
    return events


def _depth(data: Any) -> int:
    """How deeply JSON data nests (a scalar: 0), without recursion."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, level = todo.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in children)
    return deepest


def save_trace(events: list[Event], path: str | Path) -> None:
    Path(path).write_text(dumps_trace(events), encoding="utf-8")


def load_trace(path: str | Path) -> list[Event]:
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise SpecGUIError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
    if size > MAX_TRACE_BYTES:
        raise SpecGUIError(f"trace is larger than {MAX_TRACE_BYTES // 2**20} MiB")
    try:
        text = path.read_bytes()
    except OSError as exc:  # a directory, a file gone meanwhile
        raise SpecGUIError(f"cannot read trace {str(path)[:200]!r}: {exc.strerror}") from None
    return loads_trace(text)

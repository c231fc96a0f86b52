"""Events -> what the page shows, with no gradio or plotly in sight.

A `RunView` folds one run's events (live or replayed) into token marks, running totals and per-step
records; `compare` puts a method's view next to baseline's, `spread` summarises the speedups of repeated
pairs, and `why` decomposes one pair's speedup into what the runs measured. `render` and `charts` only
read these, so tests can check every component against hand-built events without launching anything.

Payloads come from methods and, in a replay, from an untrusted file: `parse_internals` reads the keys
listed in `specgui.core.events` defensively and drops any value of the wrong shape instead of trusting it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specgui.core.events import Event, Prefill, Start, Step, Summary
from specgui.costs import describe_origin
from specgui.methods.policy import MARGIN, PRIOR_ALPHA
from specgui.tools.equality import Divergence, first_divergence

# Token kinds in the method pane: how each piece of text came to be there.
ACCEPTED, BONUS, CORRECTION, REJECTED = "accepted", "bonus", "correction", "rejected"
DISCARDED = "discarded"  # a draft node below a rejected one (inspector only)
KIND_HELP = {
    ACCEPTED: "accepted draft token",
    BONUS: "verifier's own token (bonus: the whole draft was accepted)",
    CORRECTION: "verifier's own token (correction: replaces a rejected draft token)",
    REJECTED: "rejected draft token (never part of the output)",
}
# Payload keys `parse_internals` understands; any other key is shown as is.
KNOWN_KEYS = frozenset({"skip", "reoptimized", "dp_score", "acs", "exit", "draft_len", "fractal_layers", "origin",
                        "branches", "candidates", "hit", "cache_sizes", "ngram", "search", "proposal", "window",
                        "harvested", "vocab"})
# Keys a method may state once, in the Prefill payload, for the whole run (ADMG's per-prompt skip set and
# the attention similarities it was chosen from; Fractal's insertion points; Draft & Verify's offline search).
RUN_WIDE_KEYS = ("skip", "acs", "fractal_layers", "search")
# The skip-set search facts the inspector shows (SWIFT per step, Draft & Verify per run), in this order.
SEARCH_KEYS = ("phase", "iteration", "kind", "score", "best", "kept", "cached", "iterations", "seconds", "objective",
               "matchness", "draft_cost", "draft_len")

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class Mark:
    """One piece of the method pane: an output token, or a rejected draft token where it was rejected."""

    text: str
    kind: str
    step: int  # 0: the prompt forward
    origin: int | None = None  # the fractal layer that produced this draft token


@dataclass(frozen=True)
class Candidate:
    """One of Self-Draft's n-gram candidates: the draft nodes it became, where it came from, its key."""

    nodes: tuple[int, ...]
    source: str
    key: tuple[int, ...]


@dataclass(frozen=True)
class Internals:
    """A step's method payload, checked and typed (fields a method did not set stay empty)."""

    skip_attn: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()
    has_skip: bool = False
    reoptimized: bool = False
    dp_score: float | None = None
    acs: tuple[float, ...] = ()
    fractal_layers: tuple[int, ...] = ()
    origin: tuple[int | None, ...] = ()
    branches: tuple[tuple[int, ...], ...] = ()
    candidates: tuple[Candidate, ...] = ()
    hit: tuple[int, int] | None = None  # (candidate index, tokens accepted from it)
    cache_sizes: tuple[tuple[str, int], ...] = ()
    search: tuple[tuple[str, str | int | float | bool], ...] = ()  # SEARCH_KEYS present, in that order
    proposal_attn: frozenset[int] = frozenset()  # the skip set a search scored this step (SWIFT)
    proposal_mlp: frozenset[int] = frozenset()
    has_proposal: bool = False
    window: tuple[tuple[int, ...], ...] = ()  # Lookahead's levels as fed (level 0 starts with the pending token)
    harvested: int | None = None
    exit_reason: str | None = None  # "paused": the cost policy drafted nothing this step
    exit_threshold: float | None = None
    confidences: tuple[float, ...] = ()
    draft_len: int | None = None
    vocab: tuple[int, int, bool, int] | None = None  # a draft vocabulary: ids, low ids, target's token outside, so far
    ngram: int | None = None
    timings: tuple[tuple[str, float], ...] = ()  # every "*_ms" key
    other: tuple[tuple[str, str], ...] = ()  # unknown keys, as short JSON

    @property
    def paused(self) -> bool:
        """Drafting was paused this step (the cost policy): nothing was drafted, nothing skipped."""
        return self.exit_reason == "paused"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) and all(_is_int(v) for v in value) else ()


def _nums(value: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, list) and all(_is_num(v) for v in value) else ()


def _candidate(value: Any) -> Candidate | None:
    if not isinstance(value, dict) or not isinstance(value.get("source"), str):
        return None
    return Candidate(_ints(value.get("nodes")), value["source"], _ints(value.get("key")))


def _rounded(value: Any) -> Any:
    """Floats to 3 significant digits, inside lists and dicts too (0.8333333 reads as 0.833)."""
    if isinstance(value, float):
        return float(f"{value:.3g}") if math.isfinite(value) else value
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _short_json(value: Any, limit: int = 160) -> str:
    text = json.dumps(_rounded(value), default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_internals(payload: dict[str, Any], run_wide: dict[str, Any] | None = None) -> Internals:
    """Typed internals of one step; `run_wide` (the Prefill payload) supplies skip / fractal layers it lacks."""
    p = {**{k: v for k, v in (run_wide or {}).items() if k in RUN_WIDE_KEYS}, **payload}
    fields: dict[str, Any] = {}
    skip = p.get("skip")
    if isinstance(skip, dict):
        fields.update(skip_attn=frozenset(_ints(skip.get("attn"))), skip_mlp=frozenset(_ints(skip.get("mlp"))),
                      has_skip=True)
    fields["reoptimized"] = p.get("reoptimized") is True
    if _is_num(p.get("dp_score")):
        fields["dp_score"] = float(p["dp_score"])
    fields["acs"] = _nums(p.get("acs"))
    fields["fractal_layers"] = _ints(p.get("fractal_layers"))
    origin = p.get("origin")
    if isinstance(origin, list) and all(o is None or _is_int(o) for o in origin):
        fields["origin"] = tuple(origin)
    branches = p.get("branches")
    if isinstance(branches, list):
        fields["branches"] = tuple(_ints(b) for b in branches if isinstance(b, list))
    candidates = p.get("candidates")
    if isinstance(candidates, list):
        fields["candidates"] = tuple(c for c in map(_candidate, candidates) if c is not None)
    hit = p.get("hit")
    if isinstance(hit, dict) and _is_int(hit.get("candidate")) and _is_int(hit.get("tokens")):
        fields["hit"] = (hit["candidate"], hit["tokens"])
    sizes = p.get("cache_sizes")
    if isinstance(sizes, dict):
        fields["cache_sizes"] = tuple((str(k), v) for k, v in sizes.items() if _is_int(v))
    search = p.get("search")
    if isinstance(search, dict):
        fields["search"] = tuple((k, search[k]) for k in SEARCH_KEYS
                                 if isinstance(search.get(k), (bool, str)) or _is_num(search.get(k)))
    proposal = p.get("proposal")
    if isinstance(proposal, dict):
        fields.update(proposal_attn=frozenset(_ints(proposal.get("attn"))),
                      proposal_mlp=frozenset(_ints(proposal.get("mlp"))), has_proposal=True)
    window = p.get("window")
    if isinstance(window, list):
        fields["window"] = tuple(_ints(level) for level in window if isinstance(level, list))
    exit_info = p.get("exit")
    if isinstance(exit_info, dict):
        if isinstance(exit_info.get("reason"), str):
            fields["exit_reason"] = exit_info["reason"]
        if _is_num(exit_info.get("threshold")):
            fields["exit_threshold"] = float(exit_info["threshold"])
        fields["confidences"] = _nums(exit_info.get("confidences"))
    vocab = p.get("vocab")
    if isinstance(vocab, dict) and all(_is_int(vocab.get(k)) for k in ("size", "low_ids", "outside_so_far")):
        fields["vocab"] = (vocab["size"], vocab["low_ids"], vocab.get("outside") is True, vocab["outside_so_far"])
    for key in ("draft_len", "ngram", "harvested"):
        if _is_int(p.get(key)):
            fields[key] = p[key]
    fields["timings"] = tuple((k, float(v)) for k, v in p.items() if k.endswith("_ms") and _is_num(v))
    fields["other"] = tuple((k, _short_json(v)) for k, v in payload.items()
                            if k not in KNOWN_KEYS and not k.endswith("_ms"))
    return Internals(**fields)


@dataclass(frozen=True)
class NodeVerdict:
    """What became of one draft node: on the accepted path, the rejected one, or discarded below it."""

    node: int
    text: str
    depth: int
    verdict: str  # ACCEPTED, REJECTED or DISCARDED
    origin: int | None


def node_verdicts(step: Step, origin: tuple[int | None, ...] = ()) -> list[NodeVerdict]:
    """Every draft node with its verdict: accepted on the path, rejected where the target chose otherwise."""
    on_path = set(step.path)
    depth: list[int] = []
    out = []
    for i, parent in enumerate(step.draft_parents):
        depth.append(1 if parent < 0 else depth[parent] + 1)
        if i in on_path:
            verdict = ACCEPTED
        elif parent < 0 or parent in on_path:  # the target picked another token at this position
            verdict = REJECTED
        else:  # below a rejected node: never judged, dropped with it
            verdict = DISCARDED
        text = step.draft_pieces[i] if i < len(step.draft_pieces) else ""
        out.append(NodeVerdict(i, text, depth[i], verdict, origin[i] if i < len(origin) else None))
    return out


@dataclass
class RunView:
    """One run as the page sees it, built up event by event."""

    cached_at: float | None = None  # set when the events were reused from the baseline cache
    start: Start | None = None
    prefill: Prefill | None = None
    steps: list[Step] = field(default_factory=list)
    summary: Summary | None = None
    marks: list[Mark] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # text of each output token, aligned with token_ids
    margins: list[float] = field(default_factory=list)
    elapsed_ms: float = 0.0  # decoding time so far (the core's clock: rendering excluded)
    race: list[tuple[float, int]] = field(default_factory=lambda: [(0.0, 0)])  # (seconds, tokens so far)
    fractal_layers: list[int] = field(default_factory=list)  # every fractal layer seen, sorted (tint order)

    def add(self, event: Event) -> None:
        if isinstance(event, Start):
            self.start = event
        elif isinstance(event, Prefill):
            self.prefill = event
            self._note_fractal(parse_internals(event.payload).fractal_layers)
            self._emit([event.token], [event.piece], [event.margin], event.ms + event.overhead_ms)
            self.marks.append(Mark(event.piece, BONUS, 0))
        elif isinstance(event, Step):
            self._add_step(event)
        elif isinstance(event, Summary):
            self.summary = event

    def extend(self, events: list[Event]) -> None:
        for event in events:
            self.add(event)

    def _emit(self, tokens: list[int], pieces: list[str], margins: list[float], ms: float) -> None:
        self.token_ids += tokens
        self.pieces += pieces
        self.margins += margins
        self.elapsed_ms += ms
        self.race.append((self.elapsed_ms / 1000, len(self.token_ids)))

    def _add_step(self, step: Step) -> None:
        self.steps.append(step)
        internals = self.internals(len(self.steps) - 1)
        origin = internals.origin
        self._note_fractal(internals.fractal_layers + tuple(o for o in origin if o is not None))
        n = step.index
        for i, piece in enumerate(step.emitted_pieces[: step.accepted]):
            node = step.path[i]
            self.marks.append(Mark(piece, ACCEPTED, n, origin[node] if node < len(origin) else None))
        for node in step.rejected:  # shown where they were rejected: after the accepted ones
            self.marks.append(Mark(step.draft_pieces[node], REJECTED, n, origin[node] if node < len(origin) else None))
        if len(step.emitted) > step.accepted:  # the verifier's own token (absent when the budget cut it)
            self.marks.append(Mark(step.emitted_pieces[-1], CORRECTION if step.corrected else BONUS, n))
        self._emit(list(step.emitted), list(step.emitted_pieces), list(step.margins),
                   step.draft_ms + step.verify_ms + step.overhead_ms)

    def _note_fractal(self, layers: tuple[int, ...]) -> None:
        if not set(layers) <= set(self.fractal_layers):
            self.fractal_layers = sorted(set(self.fractal_layers) | set(layers))

    # -- reading --------------------------------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        """The run's events again, in order (for saving a trace)."""
        head = [e for e in (self.start, self.prefill) if e is not None]
        return head + list(self.steps) + ([self.summary] if self.summary else [])

    @property
    def method(self) -> str:
        return self.start.method if self.start else ""

    @property
    def num_layers(self) -> int:
        return self.start.num_layers if self.start else 0

    @property
    def done(self) -> bool:
        return self.summary is not None

    @property
    def greedy(self) -> bool:
        return bool(self.start) and self.start.sampling.get("temperature") == 0

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seconds(self) -> float:
        return self.summary.wall_s if self.summary else self.elapsed_ms / 1000

    @property
    def tokens_per_s(self) -> float:
        if self.summary:
            return self.summary.tokens_per_s
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        if self.summary:
            return self.summary.tau
        return sum(len(s.emitted) for s in self.steps) / len(self.steps) if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(s.drafted for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else 0.0

    def internals(self, index: int) -> Internals:
        """Parsed payload of step `index` (0-based), with run-wide keys from the prompt forward."""
        return parse_internals(self.steps[index].payload, self.prefill.payload if self.prefill else None)


@dataclass(frozen=True)
class Comparison:
    """The verdict shown after both runs: `identical` is None where token identity does not apply."""

    speedup: float | None
    identical: bool | None
    divergence: Divergence | None
    note: str  # why identity does not apply, or ""
    texts: tuple[str | None, str | None] = (None, None)  # (method, baseline) text at the divergence


def compare(method: RunView, baseline: RunView) -> Comparison:
    """Speedup and identity of a finished method run against a finished baseline run."""
    speedup = method.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else None
    m, b = method.start, baseline.start
    if m is None or b is None or m.prompt_ids != b.prompt_ids or m.model != b.model:
        return Comparison(None, None, None, "the two runs have different models or prompts")
    if m.sampling != b.sampling or m.max_new_tokens != b.max_new_tokens:
        return Comparison(speedup, None, None, "the two runs used different decoding settings")
    if "cancelled" in (method.summary.stop, baseline.summary.stop):
        return Comparison(None, None, None, "a run was stopped before the end")
    if not method.greedy:
        return Comparison(speedup, None, None, "sampling: outputs are samples (lossless in distribution)")
    found = first_divergence(method.token_ids, baseline.token_ids, baseline.margins)
    if found is None:
        return Comparison(speedup, True, None, "")

    def text(view: RunView) -> str | None:
        return view.pieces[found.position] if found.position < len(view.pieces) else None

    return Comparison(speedup, False, found, "", (text(method), text(baseline)))


def comparable(method: RunView, baseline: RunView) -> bool:
    """Both runs finished (not stopped) with usable rates, so their timings can be set against each other (a
    replayed trace may carry any numbers)."""
    return (method.done and baseline.done and "cancelled" not in (method.summary.stop, baseline.summary.stop)
            and all(math.isfinite(v.tokens_per_s) and v.tokens_per_s > 0 for v in (method, baseline)))


@dataclass(frozen=True)
class Spread:
    """Speedups of N alternating method / baseline pairs: their median and range (N = 1: no range)."""

    median: float
    low: float
    high: float
    n: int


def spread(speedups: list[float]) -> Spread | None:
    if not speedups:
        return None
    ordered = sorted(speedups)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return Spread(median, ordered[0], ordered[-1], len(ordered))


def median_index(speedups: list[float]) -> int:
    """The pair to show and replay: the one whose speedup is nearest the median (the first of ties)."""
    middle = spread(speedups)
    if middle is None:
        raise ValueError("no speedups")
    return min(range(len(speedups)), key=lambda i: abs(speedups[i] - middle.median))


@dataclass(frozen=True)
class Why:
    """Why the speedup is what it is, from what the two runs measured, beside what the cost model predicted.

    Over the decode steps the speedup is exactly `tau / cost` (times baseline's tokens per step, 1 for plain
    decoding): tokens per method step over the method's time per step counted in plain steps (baseline's
    time per step). The cost splits into the draft, the verify forward (over `forward_tokens` tokens on
    average) and `other` (acceptance, cache cropping, the method's bookkeeping). `overall` is the measured
    tokens/s ratio, which also counts each run's prompt forward. The break-even tau is `cost`: the tokens a
    step must yield to pay for itself. Each measured figure stands beside the prediction of the same thing:
    `predicted_per_step` (the run's steps priced by the cost profile, `Summary.predicted_per_step`) beside
    `per_step`, `predicted` (the same with the prompt forward as measured, `Summary.predicted_speedup`) beside
    `overall`; None where the run has none. `uncalibrated`: the profile's prices had not yet been corrected by any
    measured step when the run began (`costs.Calibration`), and the prediction says so.
    `priced_by` names that profile (when and where it was measured, from the run's Start event), so a
    prediction from an old or foreign profile shows it. `why` is the one place that builds these fields.
    """

    tau: float
    per_step: float
    cost: float
    draft: float
    verify: float
    other: float
    forward_tokens: float
    overall: float
    lost: str | None  # on a losing run, the term that lost
    noise_check: bool = False  # baseline against itself: any difference from 1x is the machine's noise
    predicted: float | None = None
    priced_by: str = ""  # e.g. "measured 2026-11-24 19:20 UTC on cpu AMD EPYC x2"
    predicted_per_step: float | None = None
    uncalibrated: bool = False

    def sentence(self) -> str:
        """E.g. '1.31× per step (predicted 1.35×): tau 2.10; a step costs 1.60 plain steps (draft 0.50, verify of
        6 tokens 1.10); break-even tau 1.60.'"""
        if self.noise_check:
            return (f"The same decode timed twice: {self.overall:.2f}× ({self.per_step:.2f}× per step). "
                    f"Its distance from 1.00× is this machine's timing noise.")
        parts = [f"draft {self.draft:.2f}"] if self.draft >= 0.005 else []
        tokens = _count(self.forward_tokens)
        parts.append(f"verify of {tokens} token{'' if tokens == '1' else 's'} {self.verify:.2f}")
        parts += [f"other {self.other:.2f}"] if self.other >= 0.005 else []
        text = (f"{self.per_step:.2f}× per step{self._predicted(self.predicted_per_step)}: tau {self.tau:.2f}; a "
                f"step costs {self.cost:.2f} plain steps ({', '.join(parts)}); break-even tau {self.cost:.2f}.")
        if self.lost:
            text += f" Lost: {self.lost}."
        if self._overall_differs():
            text += f" Counting the prompt forward: {self.overall:.2f}× overall{self._predicted(self.predicted)}."
        if (self.predicted or self.predicted_per_step) and self.priced_by:
            text += f" Priced by the cost profile {self.priced_by}."
        return text

    def _overall_differs(self) -> bool:
        """Whether counting the prompt forward changes a figure as shown: the measured one or its prediction."""
        shown = [f"{self.overall:.2f}", self._predicted(self.predicted)]
        return shown != [f"{self.per_step:.2f}", self._predicted(self.predicted_per_step)]

    def _predicted(self, figure: float | None) -> str:
        """' (predicted 1.35×)', with ', uncalibrated' where no measured step had corrected the profile yet."""
        if not figure:
            return ""
        return f" (predicted {figure:.2f}×{', uncalibrated' if self.uncalibrated else ''})"


def _count(x: float) -> str:
    return f"{round(x)}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def _step_ms(view: RunView) -> float:
    return sum(s.draft_ms + s.verify_ms + s.overhead_ms for s in view.steps) / len(view.steps)


def why(method: RunView, baseline: RunView) -> Why | None:
    """The measured decomposition of the method's speedup over baseline (None until both runs have steps)."""
    if not comparable(method, baseline) or not method.steps or not baseline.steps:
        return None
    plain = _step_ms(baseline) / baseline.tau  # ms per token of plain decoding: a plain step
    if not (math.isfinite(plain) and plain > 0 and math.isfinite(_step_ms(method)) and _step_ms(method) > 0):
        return None  # timings that cannot be divided (a hand-made trace)
    n = len(method.steps)
    draft = sum(s.draft_ms for s in method.steps) / n / plain
    verify = sum(s.verify_ms for s in method.steps) / n / plain
    other = sum(s.overhead_ms for s in method.steps) / n / plain
    cost = draft + verify + other
    tau = method.tau
    forward = sum(s.forward_tokens for s in method.steps) / n
    noise_check = method.method == "baseline"
    lost = _lost(method, draft, verify - 1, other, forward) if tau < cost and not noise_check else None
    predicted = method.summary.predicted_speedup if method.summary else None
    per_step = method.summary.predicted_per_step if method.summary else None
    curve = method.start.costs if method.start is not None else {}
    priced_by = describe_origin(curve["device"], curve.get("measured_at", 0.0)) if curve.get("device") else ""
    return Why(tau, tau / cost, cost, draft, verify, other, forward, method.tokens_per_s / baseline.tokens_per_s, lost,
               noise_check, predicted, priced_by, per_step, curve.get("uncalibrated") is True)


def _lost(method: RunView, draft: float, extra_verify: float, other: float, forward: float) -> str:
    """The term that lost: acceptance when less than half the draft depth was accepted, else the largest cost."""
    drafting = [s for s in method.steps if s.drafted]
    if not drafting:
        plans = [s.payload.get("plan") for s in method.steps]
        paused = [p for p in plans if isinstance(p, dict) and _is_num(p.get("prior"))]
        if paused and max(p["prior"] for p in paused) < 1 + MARGIN:
            alpha = paused[0].get("alpha", PRIOR_ALPHA)
            return (f"nothing was drafted: on this device a draft accepted at {alpha:.0%} per token would "
                    f"reach only {max(p['prior'] for p in paused):.2f}× per step, so the cost model decoded plainly")
        return "nothing was drafted"
    depth = sum(max(n.depth for n in node_verdicts(s)) for s in drafting) / len(drafting)
    accepted = sum(s.accepted for s in drafting) / len(drafting)
    if accepted < depth / 2:
        return f"acceptance too low ({accepted:.2f} of {depth:.2f} drafted tokens accepted per drafting step)"
    costs = {"draft too costly": draft, f"verify of {_count(forward)} tokens too costly": extra_verify,
             "other work too costly": other}
    return max(costs, key=lambda k: costs[k])

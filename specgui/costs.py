"""The cost model: what forwards, sub-layers and drafting mechanisms cost on this model and device, measured,
and what a draft -> verify step is therefore predicted to cost.

Why: whether speculative decoding pays depends on the hardware, the model size and the prompt, and "I
cannot reproduce the speedup" is the commonest complaint about it. A step that emits tau tokens pays
off only if it costs less than tau plain steps; what a step costs is a property of the device (a verify
forward of 8 tokens costs about one token on a GPU, a third more on this CPU) and of the method (a
layer-skip draft forward costs most of a full one on a small model). So the costs are measured, not
assumed, and every prediction and every method's draft size comes from them.

A `CostProfile` is measured once per (model, device, dtype, fast path) in a few seconds and cached on
disk beside the converted weights (`cache_root()/profiles/`); `python -m specgui profile` prints it,
`--refresh` measures again. Its key names the CPU model (or the GPU), and it records when it was measured:
a saved profile is checked when a process first reads it (`check`: a couple of plain steps against its
plain step) and measured again when it no longer holds (another CPU sharing the cache folder, a profile
taken on a busy machine). It holds, as median milliseconds:

  forward[c][T]  a target forward of T new tokens (T = 1 ... 64) over a cached context of c tokens, at a
                 short and a long context (prices read each context's non-decreasing fit: `monotone_forward`)
  step           a whole plain decoding step (baseline: forward, verdict, bookkeeping) at the short context:
                 the unit speedups are counted in (timed in turns with a one-token forward and priced as its
                 ratio to that forward, so that it is of the same moment as the forward curve)
  attn[l], mlp[l] each sub-layer over one token, from which a layer-skip draft forward's cost follows
  head           the final norm and LM head over one row
  mechanisms     each method's own drafting work (n-gram lookup, compressed pass, skip-set search ...),
                 measured by the method on its first use and saved with the profile

Predictions: a step that drafts with extra work `extra_ms` and verifies `rows` tokens costs
`extra_ms + verify_ms(rows)`, where `verify_ms` is the forward plus the loop's own per-step cost; it pays
off when tau / (its cost / `step`) > 1, i.e. when tau exceeds the break-even tau (its cost / `step`).

What the steps then measure corrects those prices (`Calibration`, one per profile, saved with it after every run,
so that a fresh process starts from what earlier runs on this profile learnt, and a profile measured again starts
afresh; the app warms it up to the moment before its first run, `specgui.ui.runs.calibrate`): a profile is a
few seconds of one moment, and on a shared CPU the moment moves (one-row forwards of 15.9 and 26.1 ms minutes
apart, AMD EPYC) and moves the shape of the curve with it (in a fast moment the extra rows' arithmetic shows, in a
slow one the weights' traffic hides it): the profile of 09:24 UTC priced an 8-row verify 1.09x a plain step where
the decode loop's 8-row verifies measured 1.47x (prompt lookup, held-out prompts), and drafts sized by it drafted
more than paid.

The plain step is timed by running the decode loop, which is handed in (`Decode`, `specgui.core.decode.run`;
`decode` hands itself over on import through `use_decoder`), so this module imports nothing above the parts
it measures.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import torch

from specgui import __version__, fastpath
from specgui.core import progress
from specgui.core.kvcache import KVCache, wait_for_devices
from specgui.core.runner import ATTN, MLP, Runner, SkipPlan
from specgui.cpu import layers as cpu_layers
from specgui.cpu.kernels import build, cpu_name, signature, simd
from specgui.model.cachedir import cache_root, exclusive

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)  # new tokens per measured forward: finest where CPUs turn
CONTEXTS = (128, 1024)  # the short and the long context, in cached tokens
REPEATS = 5  # each figure is the median of this many timed calls, after one warm-up
# A saved profile is measured again when a plain step now costs more than TOLERANCE times its plain step, or
# less than 1 / TOLERANCE of it. Timing noise on these machines is 10-20%: two readings each off by 20% in
# opposite directions differ by 1.2 / 0.8 = 1.5x, so a tighter bound would re-measure on noise alone, while
# the two CI CPUs the field guide measured differ by 1.75x in a one-token forward (33.6 vs 59.0 ms), which
# this bound catches.
TOLERANCE = 1.5
CALIBRATION_DECAY = 0.9  # weight of a step's predecessors in a calibration ratio, per new step of its kind
CALIBRATION_PRIOR = 0.25  # a ratio starts from what the other row counts show, with this many steps' weight
CALIBRATION_CLIP = math.log(2.0)  # an observation counts as at most this far (in log) from the ratio it meets
WORK_SHARE = 0.1  # a step's own work below this share of its verify's price teaches the verify ratio
FORWARD_MEMO = 4096  # prices `CostProfile.forward_ms` keeps (a run asks for a few hundred: its contexts x draft sizes)
# per runner, by (fast path, compiled programs)
_PROFILES: weakref.WeakKeyDictionary[Runner, dict[tuple[bool, bool], CostProfile]] = weakref.WeakKeyDictionary()
_BY_FILE: dict[str, CostProfile] = {}  # every profile this process measured or checked, by file: one per shape
Decode = Callable[..., Any]  # `specgui.core.decode.run`: (lm, prompt ids, method, **options) -> a result with `steps`
_decoder: Decode | None = None


@dataclass
class CostProfile:
    """Measured costs of one model on one device (see the module docstring), and predictions from them."""

    key: dict[str, Any]
    sizes: list[int]
    contexts: list[int]
    forward: list[list[float]]  # [context index][size index] ms
    step: float
    attn: list[float]
    mlp: list[float]
    head: float
    mechanisms: dict[str, float] = field(default_factory=dict)
    measure_s: float = 0.0
    path: str = ""  # where it is saved ("" for none)
    measured_at: float = 0.0  # when it was measured (Unix time; 0: unknown, e.g. built by hand)
    # what decoded steps measured against these prices (saved with the profile: `to_dict`, `_read`)
    calibration: Calibration = field(default_factory=lambda: Calibration(), init=False, repr=False, compare=False)

    # -- predictions ----------------------------------------------------------------------------------------

    def forward_ms(self, rows: int, context: int) -> float:
        """A target forward of `rows` new tokens over `context` cached ones (interpolated, linear beyond). Never
        priced below the LM head, which every forward runs: a noisy profile (a long-context reading inflated
        by a busy machine) extrapolated down to a short prompt once priced a step at 0 ms."""
        memo = self._forward_memo
        price = memo.get((rows, context))
        if price is None:
            per_context = [interpolate(self.sizes, costs, rows) for costs in self.monotone_forward]
            price = max(self.head, interpolate(self.contexts, per_context, context))
            if len(memo) >= FORWARD_MEMO:
                memo.clear()
            memo[rows, context] = price
        return price

    @cached_property  # as `monotone_forward`: prices never change after construction
    def _forward_memo(self) -> dict[tuple[int, int], float]:
        """`forward_ms`'s prices asked for so far: a policy prices every draft size a step (each price interpolates a
        curve per measured context), at the step's context, where a GPU waits for the host."""
        return {}

    @cached_property  # `forward` is never changed after construction (`dataclasses.replace` builds anew)
    def monotone_forward(self) -> list[list[float]]:
        """`forward` as prices read it: per context, the closest curve (least squares) that never falls as rows grow
        (`_monotone`). A forward over more rows streams the same weights and adds arithmetic, so a dip is a noisy
        median; priced as measured, a dip makes a 2-row verify cheaper than a plain step, and the n-gram drafters
        then draft at any acceptance. The measured medians stay in `forward` (what `profile` prints)."""
        return [_monotone(costs) for costs in self.forward]

    @property
    def loop_ms(self) -> float:
        """What a decoding step costs beyond its forward (the verdict, the cache, the bookkeeping): the measured
        plain step less the one-token forward (the step priced by its ratio to that forward). With their noise it
        can come out below zero; it is
        kept so, so that a plain step is priced at what it measured, not above it (clamped at zero, every plain step
        is priced above its measure and every prediction comes out optimistic)."""
        return self.step - self._one_token_ms

    @cached_property  # of `forward`, `contexts` and `head`, never changed after construction; `step` is set later
    def _one_token_ms(self) -> float:
        """The one-token forward at the short context: every price reads it (`loop_ms`), a second interpolation per
        price when computed each time (Self-Draft prices ~50 forwards a step at a GPU's sizes)."""
        return self.forward_ms(1, self.contexts[0])

    def verify_ms(self, rows: int, context: int) -> float:
        """A step's verify phase: one forward of `rows` tokens plus the loop's own cost."""
        return max(self.head, self.forward_ms(rows, context) + self.loop_ms)

    def plain_ms(self, context: int) -> float:
        """A plain decoding step at `context`: what every method is measured against."""
        return self.verify_ms(1, context)

    def skip_forward_ms(self, plan: SkipPlan, context: int, head: float | None = None) -> float:
        """A one-token forward with `plan`'s sub-layers skipped (a layer-skip draft token); its norm and head at
        `head` ms where the draft computes part of the head only (a draft vocabulary: `specgui.core.vocab.head_ms`)."""
        saved = sum(self.attn[layer] for layer in plan.attn) + sum(self.mlp[layer] for layer in plan.mlp)
        full = self.forward_ms(1, context)
        head = self.head if head is None else head
        return max(head, full - saved * full / self.forward_ms(1, self.contexts[0]) - (self.head - head))

    # -- what steps measured against these prices (`Calibration`) ------------------------------------------------

    @property
    def calibrated(self) -> bool:
        """Whether steps correct these prices: a measured profile's, not one built by hand (no moment to have drifted
        from: a what-if price list, a replay's, a test's, taken as given)."""
        return self.measured_at > 0

    def verify_ratio(self, rows: int) -> float:
        """What a verify of `rows` tokens has measured against its price, lately (1: as priced)."""
        return self.calibration.verify_ratio(rows) if self.calibrated else 1.0

    def work_ratio(self, method: str) -> float:
        """What `method`'s own drafting work has measured against its price, lately (1: as priced)."""
        return self.calibration.work_ratio(method) if self.calibrated else 1.0

    def chained_ms(self, context: int) -> float:
        """A plain step chained on the device (`fastpath.PlainSteps`: launched before the step before is read, no host
        work between the two forwards) at `context`: the measured plain step (`step` is timed on the loop that chains)
        as chained steps have corrected it (`Calibration.chained_ratio`)."""
        return self.plain_ms(context) * (self.calibration.chained_ratio() if self.calibrated else 1.0)

    def own_ms(self, method: str, work_ms: float, rows: int) -> float:
        """What a step's own drafting work costs as measured: `work_ms` (the profile's price of it) at `method`'s work
        ratio, plus the method's host work a drafting step measured beyond its price (`Calibration.host_ms`) where
        this step drafts (verifies more than its pending token)."""
        host = self.calibration.host_ms(method) if self.calibrated and rows > 1 else 0.0
        return work_ms * self.work_ratio(method) + host

    def learn(self, method: str, rows: int, measured_ms: float, work_ms: float, verify_ms: float,
              draft_ms: float | None = None, chained: bool = False) -> None:
        """Fold a decoded step into the calibration (`Calibration.learn`; a step chained on the device,
        `Calibration.learn_chained`, against its price `verify_ms`)."""
        if self.calibrated and chained:
            self.calibration.learn_chained(measured_ms, verify_ms)
        elif self.calibrated:
            self.calibration.learn(method, rows, measured_ms, work_ms, verify_ms, draft_ms)

    def mechanism(self, name: str, measure: Callable[[], float]) -> float:
        """The cost of a method's own mechanism `name` (ms), measured by `measure` on first use and saved (under
        the file's lock, taking what other processes sharing the file measured meanwhile)."""
        if name not in self.mechanisms:
            with exclusive(Path(self.path)) if self.path else contextlib.nullcontext():
                saved = _read(Path(self.path), self.key) if self.path else None
                if saved is not None and saved.measured_at == self.measured_at:
                    self.mechanisms = {**saved.mechanisms, **self.mechanisms}
                if name not in self.mechanisms:
                    self.mechanisms[name] = measure()
                    self.save()
        return self.mechanisms[name]

    def curve(self) -> dict[str, Any]:
        """The forward curve and the plain step, for events: what the app draws, even in a replay; and whether no
        measured step had corrected these prices yet (`uncalibrated`: the why line says so beside a prediction)."""
        return {"sizes": self.sizes, "contexts": self.contexts, "forward": self.forward, "step": self.step,
                "loop": self.loop_ms, "device": self.key.get("device", ""), "measured_at": self.measured_at,
                "uncalibrated": self.calibrated and not self.calibration.learnt}

    def origin(self) -> str:
        """Where and when it was measured, e.g. 'measured 2026-11-24 19:20 UTC on cpu AMD EPYC 7B13 x2': what
        the why line and the bench report name, so a figure priced by an old or foreign profile shows it."""
        return describe_origin(self.key.get("device", ""), self.measured_at)

    # -- storage --------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The measured profile as plain data with what its calibration has learnt (what is saved)."""
        return {**{k: v for k, v in asdict(self).items() if k != "calibration"},
                "calibration": self.calibration.to_dict()}

    def keep_learnt(self) -> None:
        """Save what the calibration has learnt with the profile it corrects (the decode loop does after each run,
        outside its timed phases), so that the next process's first run starts from it rather than from the raw
        profile. Under the file's lock, and only while the file still holds this measurement: another process may
        have measured the profile again meanwhile (prices this calibration does not correct: the new file stays), or
        measured a mechanism (taken into this copy, not overwritten). A read-only cache keeps nothing."""
        if not (self.path and self.calibrated and self.calibration.learnt):
            return
        with contextlib.suppress(OSError), exclusive(Path(self.path)):
            saved = _read(Path(self.path), self.key)
            if saved is not None and saved.measured_at != self.measured_at:
                return
            self.mechanisms = {**(saved.mechanisms if saved else {}), **self.mechanisms}
            self.save()

    def save(self) -> None:
        if not self.path:
            return
        target = Path(self.path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")
            tmp.replace(target)
        except OSError:
            pass  # a read-only cache: the profile still serves this process

    def summary(self) -> str:
        """The profile as text (what `python -m specgui profile` prints)."""
        k = self.key
        lines = [f"cost profile of {k['model']} on {k['device']} ({k['dtype']}, "
                 f"{'fast path' if k['fast_path'] else 'eager'}), measured in {self.measure_s:.1f} s",
                 self.origin(),
                 f"plain step {self.step:.2f} ms (forward {self.forward_ms(1, self.contexts[0]):.2f} + loop "
                 f"{self.loop_ms:.2f}), LM head {self.head:.2f} ms", "",
                 "forward ms by new tokens T (rows) and cached context (columns):",
                 f"{'T':>4} " + " ".join(f"{'ctx ' + str(c):>10}" for c in self.contexts) + "   vs T=1"]
        for i, t in enumerate(self.sizes):
            cells = " ".join(f"{self.forward[j][i]:>10.2f}" for j in range(len(self.contexts)))
            lines.append(f"{t:>4} {cells}   {self.forward[0][i] / self.forward[0][0]:>5.2f}x")
        lines += ["", "sub-layers over one token (ms), per layer:",
                  "  attn " + " ".join(f"{x:.2f}" for x in self.attn),
                  "  mlp  " + " ".join(f"{x:.2f}" for x in self.mlp)]
        if self.mechanisms:
            lines += ["", "drafting mechanisms (ms):"]
            lines += [f"  {k:<28} {v:.3f}" for k, v in sorted(self.mechanisms.items())]
        if self.path:
            lines += ["", f"saved in {self.path}"]
        return "\n".join(lines)


class Calibration:
    """Measured against priced, learnt from every step decoded with one profile (in this process, and in earlier ones:
    it is saved with the profile, `CostProfile.keep_learnt`, and read back with it): a ratio per verify of
    `rows` tokens (the forward and the loop, shared by every method: it is the machine's) and one per method for the
    method's own drafting work (draft forwards, compressed passes, searches). Each is a decayed mean of log ratios
    (`CALIBRATION_DECAY` per observation: about the last ten), each observation clipped to `CALIBRATION_CLIP`
    either way of the ratio it meets (a stall or a page redraw is not a price), and shrunk by `CALIBRATION_PRIOR`
    observations' weight towards what the other row counts show (linear in rows between them, flat beyond; none:
    the profile as it is), so a row count never seen is priced by its neighbours' correction, not the profile's
    moment.

    A step whose own work is small beside its verify (`WORK_SHARE`) teaches the verify ratio of its rows, its work
    taken at the method's ratio; any other step teaches the method's work ratio, its verify taken at the verify
    ratio: the two never learn from the same step, so one cannot absorb the other's error and drift without bound.

    A ratio cannot correct a price near zero: a method's host work timed alone (Self-Draft's retrieval) is priced at
    almost nothing where, on a GPU, its drafting phase is a real share of the step, and the policy oversizes. So a
    drafting step (one that verifies more than its pending token) whose work is small beside its verify also teaches
    the method's host cost, in ms: its measured drafting phase less its work as priced (`host_ms`, a decayed mean like
    the ratios, shrunk towards 0 by `CALIBRATION_PRIOR`, each observation at most a verify's price from the cost it
    meets), and its verify ratio learns from the step less that cost, so the machine's verify prices, shared by every
    method, stay clear of one method's host work. Steps of larger work keep it in the work ratio, as before.
    """

    def __init__(self) -> None:
        self.verify: dict[int, tuple[float, float]] = {}  # rows -> (decayed sum of log ratios, decayed weight)
        self.chained = (0.0, 0.0)  # the same, for plain steps chained on the device (`learn_chained`)
        self.work: dict[str, tuple[float, float]] = {}  # method -> the same
        self.host: dict[str, tuple[float, float]] = {}  # method -> (decayed sum of ms, decayed weight)
        # verify ratios read since the last step was learnt: a step's sizing prices every size, Self-Draft's every
        # branch count of every size, each through `verify_ratio`; and the learnt ratios by rows, sorted once a step
        # for all of them (sorted for each, they were most of a wide draft's pricing)
        self._read: dict[int, float] = {}
        self._points: list[tuple[int, float]] | None = None
        self.learnt_steps = 0  # steps folded in so far: what prices kept elsewhere hold for (`DecodeState.verify_ms`)

    def verify_ratio(self, rows: int) -> float:
        """Measured over priced for a verify of `rows` tokens."""
        if rows not in self._read:
            if self._points is None:
                self._points = sorted((r, s / w) for r, (s, w) in self.verify.items() if w > 0)
            others = [point for point in self._points if point[0] != rows]
            s, w = self.verify.get(rows, (0.0, 0.0))
            self._read[rows] = math.exp((s + CALIBRATION_PRIOR * _level(others, rows)) / (w + CALIBRATION_PRIOR))
        return self._read[rows]

    @property
    def learnt(self) -> bool:
        """Whether any step has been learnt: a profile's prices before that are uncalibrated."""
        return bool(self.verify or self.work or self.host or self.chained[1])

    def to_dict(self) -> dict[str, Any]:
        """What was learnt, as JSON (saved with the profile it corrects)."""
        return {"verify": {str(rows): list(v) for rows, v in self.verify.items()},
                "work": {method: list(v) for method, v in self.work.items()},
                "host": {method: list(v) for method, v in self.host.items()}, "chained": list(self.chained)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """A calibration read back (anything malformed reads as nothing learnt)."""
        found = cls()
        try:
            found.verify = {int(rows): (float(s), float(w)) for rows, (s, w) in data.get("verify", {}).items()}
            found.work = {str(method): (float(s), float(w)) for method, (s, w) in data.get("work", {}).items()}
            found.host = {str(method): (float(s), float(w)) for method, (s, w) in data.get("host", {}).items()}
            s, w = data.get("chained", (0.0, 0.0))
            found.chained = (float(s), float(w))
        except (AttributeError, TypeError, ValueError):
            return cls()
        return found

    def work_ratio(self, method: str) -> float:
        """Measured over priced for `method`'s own drafting work."""
        s, w = self.work.get(method, (0.0, 0.0))
        return math.exp(s / (w + CALIBRATION_PRIOR))

    def chained_ratio(self) -> float:
        """Measured over priced for a plain step chained on the device."""
        s, w = self.chained
        return math.exp(s / (w + CALIBRATION_PRIOR))

    def learn_chained(self, measured_ms: float, priced_ms: float) -> None:
        """Fold in a plain step chained on the device: its own ratio, apart from a verify of one token launched after
        the step before was read (a method's step that drafts nothing), which pays the host's work between the two
        forwards; learnt as one, a paused method's chained steps priced its unchained ones too cheap, and plain
        decoding (what drafting must beat) too dear."""
        if measured_ms <= 0 or priced_ms <= 0:
            return
        now = math.log(self.chained_ratio())
        sample = min(now + CALIBRATION_CLIP, max(now - CALIBRATION_CLIP, math.log(measured_ms / priced_ms)))
        s, w = self.chained
        self.chained = (CALIBRATION_DECAY * s + sample, CALIBRATION_DECAY * w + 1.0)

    def host_ms(self, method: str) -> float:
        """`method`'s host work a drafting step measured beyond the price of its work (never below nothing)."""
        s, w = self.host.get(method, (0.0, 0.0))
        return max(0.0, s / (w + CALIBRATION_PRIOR))

    def learn(self, method: str, rows: int, measured_ms: float, work_ms: float, verify_ms: float,
              draft_ms: float | None = None) -> None:
        """Fold in one step: `measured_ms` (its draft and verify phases; `draft_ms` the first alone, where known)
        against the profile's prices of its own work (`work_ms`) and of its verify over `rows` tokens (`verify_ms`)."""
        drafted = rows > 1
        if work_ms <= WORK_SHARE * verify_ms:
            if drafted and draft_ms is not None:
                self._learn_host(method, draft_ms - work_ms * self.work_ratio(method), verify_ms)
            table, key, now = self.verify, rows, self.verify_ratio(rows)
            own = work_ms * self.work_ratio(method) + (self.host_ms(method) if drafted else 0.0)
            part, priced = measured_ms - own, verify_ms
        else:
            table, key, now = self.work, method, self.work_ratio(method)
            host = self.host_ms(method) if drafted else 0.0
            part, priced = measured_ms - host - verify_ms * self.verify_ratio(rows), work_ms
        if part <= 0 or priced <= 0:
            return
        sample = min(math.log(now) + CALIBRATION_CLIP, max(math.log(now) - CALIBRATION_CLIP, math.log(part / priced)))
        s, w = table.get(key, (0.0, 0.0))
        table[key] = (CALIBRATION_DECAY * s + sample, CALIBRATION_DECAY * w + 1.0)
        self._read.clear()
        self._points = None
        self.learnt_steps += 1

    def _learn_host(self, method: str, extra_ms: float, verify_ms: float) -> None:
        """Fold in a drafting step's host work beyond its priced work, at most `verify_ms` (its verify's price) either
        way of the cost it meets: a stall is not a price."""
        now = self.host_ms(method)
        s, w = self.host.get(method, (0.0, 0.0))
        self.host[method] = (CALIBRATION_DECAY * s + min(now + verify_ms, max(now - verify_ms, extra_ms)),
                             CALIBRATION_DECAY * w + 1.0)


def _level(points: list[tuple[int, float]], x: int) -> float:
    """Linear between the points (x ascending), flat beyond the first and the last; 0 with none."""
    if not points:
        return 0.0
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def describe_origin(device: str, measured_at: float) -> str:
    """'measured <UTC time> on <device>' (the time left out when unknown)."""
    when = time.strftime(" %Y-%m-%d %H:%M UTC", time.gmtime(measured_at)) if measured_at > 0 else ""
    return f"measured{when} on {device or 'an unknown device'}"


def _monotone(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `ys` in squared error (pool adjacent violators: a run that falls is
    replaced by its mean, merged backwards until the means rise)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [mean for mean, count in blocks for _ in range(int(count))]


def interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), continued linearly past both ends with a slope of at least zero: a
    cost never falls as rows or context grow, whatever two noisy readings say."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    slope = (y1 - y0) / (x1 - x0)
    if not xs[0] <= x <= xs[-1]:
        slope = max(0.0, slope)
    return y1 + slope * (x - x1) if x > x1 else y0 + slope * (x - x0)


# -- measuring ------------------------------------------------------------------------------------------------


def use_decoder(run: Decode) -> None:
    """Hand over the decode loop that plain steps are timed with (`specgui.core.decode` does so on import), for
    callers that do not pass one to `profile_for`."""
    global _decoder
    _decoder = run


@dataclass(frozen=True)
class Drift:
    """A saved profile's plain step beside one timed now: `stale` when they differ by more than TOLERANCE."""

    saved_ms: float
    now_ms: float

    @property
    def ratio(self) -> float:
        return self.now_ms / self.saved_ms if self.saved_ms > 0 else math.inf

    @property
    def stale(self) -> bool:
        return not 1 / TOLERANCE <= self.ratio <= TOLERANCE

    def sentence(self) -> str:
        return (f"a plain step now takes {self.now_ms:.2f} ms against the profile's {self.saved_ms:.2f} ms "
                f"({self.ratio:.2f}x; re-measured beyond {TOLERANCE:g}x either way)")


def profile_for(lm: Any, fast_path: bool, *, refresh: bool = False, run: Decode | None = None) -> CostProfile:
    """The cost profile of a loaded model on the path it decodes with: from memory, from disk (checked against
    a couple of plain steps now, and measured again if it no longer holds), or measured. `run` times the plain
    steps (default: the decode loop `specgui.core.decode` handed over)."""
    profile, drift = (None, None) if refresh else lookup(lm, fast_path, run=run)
    if profile is None or (drift is not None and drift.stale):
        profile = remeasure(lm, fast_path, run=run)
    return profile


def lookup(lm: Any, fast_path: bool, *, run: Decode | None = None) -> tuple[CostProfile | None, Drift | None]:
    """The profile this process already holds for the model (None: no check needed), else the saved one with
    its `Drift` measured now (kept for the process only when not stale), else (None, None)."""
    known = _PROFILES.setdefault(lm.runner, {})
    which = _which(lm, fast_path)
    if which in known:
        return known[which], None
    key = profile_key(lm, fast_path)
    path = _path(lm, key)
    if str(path) in _BY_FILE and _BY_FILE[str(path)].key == key:
        known[which] = _BY_FILE[str(path)]
        return known[which], None
    profile = _read(path, key)
    if profile is None:
        return None, None
    drift = check(lm, profile, run=run)
    if not drift.stale:
        known[which] = _BY_FILE[str(path)] = profile
    return profile, drift


def remeasure(lm: Any, fast_path: bool, *, run: Decode | None = None) -> CostProfile:
    """Measure the profile now, save it (replacing any saved one) and hold it for the process. Under the saved
    file's lock: a process that waited on another one measuring the same profile takes what it just saved."""
    key = profile_key(lm, fast_path)
    path = _path(lm, key)
    asked = time.time()
    with exclusive(path):
        profile = _read(path, key)
        if profile is None or profile.measured_at < asked:
            profile = measure(lm, fast_path, run=run)
        profile.path = str(path)  # a profile read back names its file too (mechanisms are saved into it)
        profile.save()
    _PROFILES.setdefault(lm.runner, {})[_which(lm, fast_path)] = _BY_FILE[str(path)] = profile
    return profile


def check(lm: Any, profile: CostProfile, *, run: Decode | None = None) -> Drift:
    """A couple of plain steps timed now (the least of two short runs' medians, at the profile's short
    context) beside the profile's plain step."""
    vocab = int(lm.runner.config.vocab_size)
    prompt = torch.randint(0, vocab, (profile.contexts[0],), generator=torch.Generator().manual_seed(0)).tolist()
    with progress.phase("checking the saved cost profile against a few plain steps"):
        return Drift(profile.step, _plain_step_ms(lm, prompt, profile, run=run, rounds=2, new_tokens=4))


def measure(lm: Any, fast_path: bool, *, run: Decode | None = None) -> CostProfile:
    """Measure a profile: forwards at every size and both contexts, sub-layers, the head, a plain step."""
    runner = lm.runner
    started = time.perf_counter()
    room = max(1, lm.max_context - SIZES[-1])  # a context and the largest forward must fit the model
    contexts = sorted({min(c, room) for c in CONTEXTS})
    vocab = int(runner.config.vocab_size)
    tokens = torch.randint(0, vocab, (contexts[-1] + SIZES[-1],), generator=torch.Generator().manual_seed(0))
    with progress.phase(f"measuring the cost profile of {lm.name} on this machine (once per machine and code)",
                        total=len(contexts) + 2) as phase:
        return _measure(lm, fast_path, run, contexts, tokens, phase, started)


def _measure(lm: Any, fast_path: bool, run: Decode | None, contexts: list[int], tokens: torch.Tensor,
             phase: progress.Phase, started: float) -> CostProfile:
    """`measure`'s forwards, sub-layers and plain step, each a step of its `phase`."""
    runner = lm.runner
    sync = _sync(runner.device)
    forward: list[list[float]] = []
    if fast_path:  # the cache for the longest context first: every context then shares it, and its captures
        fastpath.cache_for(runner, contexts[-1] + SIZES[-1])
    with torch.inference_mode():
        for c in contexts:
            cache = fastpath.cache_for(runner, c + SIZES[-1]) if fast_path else KVCache()
            runner.forward(tokens[:c], torch.arange(c), cache)
            calls = [lambda t=t, c=c, cache=cache: runner.forward(tokens[c : c + t], torch.arange(c, c + t),
                                                                    cache.view(c)) for t in SIZES]
            forward.append(_medians_ms(calls, sync))
            progress.advance(phase, f"forwards at {c} cached tokens")
            if c == contexts[0]:
                one_token = calls[0]  # a one-token forward at the short context: what a plain step is timed beside
        attn, mlp, head = _sublayers(runner, tokens, contexts[0], sync, fast_path)
        progress.advance(phase, "sub-layers and head")
    profile = CostProfile(key=profile_key(lm, fast_path), sizes=list(SIZES), contexts=contexts, forward=forward,
                          step=0.0, attn=attn, mlp=mlp, head=head)
    profile.step = _plain_step_ms(lm, tokens[: contexts[0]].tolist(), profile, run=run, beside=one_token)
    progress.advance(phase, "a plain step")
    profile.measure_s = time.perf_counter() - started
    profile.measured_at = time.time()
    return profile


def _sublayers(runner: Runner, tokens: torch.Tensor, context: int, sync: Callable[[], None], fast_path: bool):
    """Each attention and MLP sub-layer, and the head, over one token at `context`, on the path runs take
    (on the fast path each is its program's replay: what a layer-skip draft pays there)."""
    cache = fastpath.cache_for(runner, context + 1) if fast_path else KVCache()
    runner.forward(tokens[:context], torch.arange(context), cache)
    step = runner.new_pass(torch.tensor([context]), cache.view(context))
    h = runner.embed(tokens[context : context + 1].to(runner.embed_device).view(1, 1))
    units = [lambda layer=layer, kind=kind: step.run_unit(h, layer, kind)
             for kind in (ATTN, MLP) for layer in range(runner.num_layers)]
    *times, head = _medians_ms([*units, lambda: runner.logits(h)], sync)
    return times[: runner.num_layers], times[runner.num_layers :], head


def _plain_step_ms(lm: Any, prompt: list[int], profile: CostProfile, *, run: Decode | None = None,
                   rounds: int = 3, new_tokens: int = 8, beside: Callable[[], Any] | None = None) -> float:
    """The median whole step of a short baseline run: what plain decoding costs per token, loop included.

    The run gets the profile being measured (its steps need no more than the forwards already in it). Alone, the
    least of the rounds' medians (another process's burst only ever slows a run down). With `beside` (a one-token
    forward at the profile's short context), each round also times that forward, and the step is priced as the
    median of the rounds' ratios of step to forward times the profile's own one-token forward: timed apart, a step
    measured in a faster moment than the forward curve can come out under a one-token forward (a negative loop,
    every verify priced that much too cheap).
    """
    run = run or _decoder
    if run is None:
        raise RuntimeError("timing a plain step needs the decode loop: pass `run` or import specgui.core.decode")
    path = "on" if profile.key["fast_path"] else "off"
    run(lm, prompt[:16], "baseline", max_new_tokens=4, fast_path=path, profile=profile)  # warm-up
    medians, ratios = [], []
    for _ in range(rounds):
        result = run(lm, prompt, "baseline", max_new_tokens=new_tokens, fast_path=path, profile=profile)
        medians.append(statistics.median(s.draft_ms + s.verify_ms + s.overhead_ms for s in result.steps))
        if beside is not None:
            with torch.inference_mode():
                ratios.append(medians[-1] / _median_ms(beside, _sync(lm.runner.device)))
    if beside is None:
        return min(medians)
    return statistics.median(ratios) * profile.forward_ms(1, profile.contexts[0])


def _medians_ms(calls: list[Callable[[], Any]], sync: Callable[[], None], repeats: int = REPEATS) -> list[float]:
    """Median ms of each call, timed in rounds of every call once, so that a drift in machine load touches
    every call alike (after a warm-up round: lazy initialisations and, on the fast path, graph captures)."""
    samples: list[list[float]] = [[] for _ in calls]
    for round_ in range(repeats + 1):
        for i, fn in enumerate(calls):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if round_:
                samples[i].append((time.perf_counter() - start) * 1000)
    return [statistics.median(x) for x in samples]


def _median_ms(fn: Callable[[], Any], sync: Callable[[], None], repeats: int = REPEATS) -> float:
    return _medians_ms([fn], sync, repeats)[0]


class DeviceClock:
    """Time marks that never stall the device: recorded CUDA events on a GPU, `perf_counter` elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A mark behind what was launched so far: on CUDA an event on the stream of the model's device (a model on
        cuda:1 is timed on cuda:1's stream, whatever the current device is)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (on CUDA only once the device has passed both)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1000


def time_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Median ms of `fn` after a warm-up: how methods measure their mechanisms for `CostProfile.mechanism`."""
    return _median_ms(fn, _sync(device), repeats)


def beside_forward_ms(profile: CostProfile, fn: Callable[[], Any], forward: Callable[[], Any], rows: int, context: int,
                      device: torch.device, repeats: int = 5) -> float:
    """`fn`'s cost as `profile` prices forwards: `fn` and `forward` (a target forward of `rows` rows after `context`
    cached tokens) timed in turns, `fn`'s share of that forward times the profile's own price of it.

    Why: the machine's speed drifts between phases (on the CI kind of machine the same code's plain step measured
    16.9 ms and, 17 minutes later, 22.4), and a mechanism timed alone at another moment than the profile's forward
    curve is compared with forwards of another speed: a Fractal pass timed in a slow phase priced its drafts above
    break-even against a curve from a fast one. A share of a forward timed beside it moves with neither."""
    return beside_ms([fn], forward, profile.forward_ms(rows, context), device, repeats)[0]


def beside_ms(fns: Sequence[Callable[[], Any]], reference: Callable[[], Any], reference_ms: float,
              device: torch.device, repeats: int = 5) -> list[float]:
    """Each of `fns`' cost where `reference` is priced at `reference_ms`: all timed in turns (two ways of doing one
    thing compare within the same rounds), each one's share of `reference` times that price (`beside_forward_ms`
    says why)."""
    *mechanisms, measured = _medians_ms([*fns, reference], _sync(device), repeats)
    return [mechanism / measured * reference_ms for mechanism in mechanisms]


def _sync(device: torch.device) -> Callable[[], None]:
    """What waits until `device` has run what was launched: CUDA's synchronisation, or the emulation's (a CPU's
    operations have run when they return)."""
    return functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else wait_for_devices


def _which(lm: Any, fast_path: bool) -> tuple[bool, bool]:
    """The path a profile is measured on: the fast path or not, and whether its programs are compiled."""
    return fast_path, fast_path and fastpath.compiles_for(lm.runner)


def flat_profile(lm: Any, fast_path: bool, ms: float = 10.0) -> CostProfile:
    """A hand-made cost profile in which a forward costs `ms` whatever its rows and context: for runs whose verdicts
    rest on no price (fixed draft sizes: the tests, the smoke), so that they measure no profile of their own (on the
    CPU's fast path, measuring the embedded model's takes tens of seconds and sizes the static cache for a long
    context)."""
    layers = lm.runner.num_layers
    return CostProfile(key=profile_key(lm, fast_path), sizes=[1, 64], contexts=[128], forward=[[ms, ms]], step=ms,
                       attn=[ms / (4 * layers)] * layers, mlp=[ms / (4 * layers)] * layers, head=ms / 10)


def profile_key(lm: Any, fast_path: bool) -> dict[str, Any]:
    """What a profile is valid for: the model's shape (not its weights), the device, dtype, path and versions."""
    runner = lm.runner
    if runner.device.type == "cuda":
        device = torch.cuda.get_device_name(runner.device)
    else:
        device = f"{runner.device.type} {cpu_name()} x{torch.get_num_threads()}"
    config = runner.config.to_dict() if hasattr(runner.config, "to_dict") else {}
    shape = {k: config.get(k) for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "vocab_size")}
    return {"model": lm.name, "shape": shape, "device": device, "dtype": str(runner.dtype).removeprefix("torch."),
            "fast_path": fast_path, "compiled": _which(lm, fast_path)[1],
            "matmul": signature(lm.model), "layers": cpu_layers.signature(lm.model),
            "kernel": build() if runner.device.type == "cpu" else None,
            "simd": simd() if runner.device.type == "cpu" else None, "torch": torch.__version__,
            "specgui": __version__, "code": code_digest()}


@cache
def code_digest() -> str:
    """A digest of the package's Python source. A profile holds prices measured by this code (a forward, the cost of
    a mechanism as a method times it), and the version string never moved with the code: a profile saved by an
    older checkout kept its mechanisms' old prices (a draft vocabulary's head timed alone, after it was timed beside
    the full head) until measured again by hand. Keyed by the source, other code measures its own profile."""
    digest = hashlib.sha1()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _path(lm: Any, key: dict[str, Any]) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "profiles" / f"{_safe(lm.name)}-{digest}.json"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[-60:]


def _read(path: Path, key: dict[str, Any]) -> CostProfile | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        learnt = data.pop("calibration", {})
        profile = CostProfile(**data)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    profile.calibration = Calibration.from_dict(learnt if isinstance(learnt, dict) else {})
    profile.path = str(path)  # where it was read, not where it was saved: a cache folder copied or moved keeps its own
    return profile if profile.key == key else None

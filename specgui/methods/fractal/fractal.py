"""`fractal`: Fractal-LLM (layer-embedded self-compression), with a KV cache.

The full model's forward carries w *draft slots* after its last known token (the anchor). Before each
of n *fractal layers* i, a compressed (int8) copy of the model refines the slots in the middle of the
forward (`Splice`):

  upper  compressed layers i..L-1 + compressed LM head over the forward's rows -> argmax: the anchor's
         row guesses the token of slot 1, slot j's row the token of slot j + 1
  lower  re-embed the slot guesses (compressed embedding), run compressed layers 0..i-1 on the slots
         and replace only the slot rows of the stream; the original layer i then continues.

Every fractal layer fixes one more slot, as a Jacobi iteration would: slot 1's guess is right once the
anchor's row has been read, slot 2's once slot 1 holds the right token, and so on. At the end of the
forward the full model's own head reads the slots: slot j predicts the token after it. A slot's
prediction is a usable draft token only if every slot before it holds the token the chain before it
predicts (`consistent_chain`); the chain is cut at the first disagreement.

KV cache, beyond the paper (which ran without one): the compressed sub-passes attend to the prefix
through the original layers' cached keys and values (a `view`: read, never written), which for
the prefix are exact, and the copies keep `layer_idx`, so layer i's copy reads layer i's cache. The
upper pass sees only the committed prefix (the forward has not reached layers >= i yet) and so runs
over *all* the forward's rows; the lower pass sees the prefix plus the forward's exact rows, whose
keys the forward has already written for layers < i. Slot rows never feed back into exact rows
(causal order puts them last), so the target's logits for the exact rows are those of a plain forward.

Where the slots ride (`carry`):
  * carry = false, the paper's schedule: every step runs its own draft forward over [pending, slots]
    (the pending row's output is the target's own next token b, then the slots' chain), crops it from
    the cache, and the verify forward checks [b, chain] like any draft: two full forwards a step.
  * carry = true: the verify forward itself carries the next step's slots after the draft chain (as
    `Extras`; their keys are dropped afterwards). When the whole chain is accepted and slot 1 guessed
    the target's bonus token, the slots' chain is the next draft for free; otherwise the next step
    falls back to its own draft forward. One full forward a step while drafts keep being accepted.
  * carry = true on the device's path (the fast path under greedy decoding, the whole vocabulary): the device drafts
    the carried chain itself at the step's launch (`fastpath.SlotSteps`: the chain cut on the device, the slots'
    starting tokens looked up there), so that step t + 1 is launched before step t is read. Its verify carries the
    chain's planned size whatever stands (the rows past the cut seen by none), and a chain that breaks restarts as a
    step drafting nothing that carries slots (in place of an own draft forward: the same forwards and tokens, as the
    break's price assumes); the step's tokens and guesses come back with its verdict (`_decide`).

Slot tokens, beyond the paper (which starts every slot as a copy of the anchor): the slots start from a guess
where the text offers one, what followed the longest n-gram (up to 4 tokens) ending at the anchor where it occurred
before (`pld`'s lookup), copies of the anchor for the rest. Up to the first fractal layer the target's own layers
compute the slot rows from these tokens; a fractal layer's lower pass then runs only from the first slot whose guess
differs from what it holds (`Splice._kept`), and the slots before it keep the target's own states for their tokens,
exact where the copy's are approximate. A right guess saves a lower pass of i compressed layers (most of the copy,
where the fractal layers are deep, as the embedded model's CPU preset's are: docs/methods.md has what it gained).
Slot rows never feed exact rows, so the output is unchanged.

Payloads: "fractal_layers", "origin" (per draft node, the fractal layer from which its slot guess no longer changed;
num_layers when only the target's final head proposed it), "source" ("carried", "draft forward", or on the device
"restart": a step that drafted nothing and carried slots), and the time split "compressed_ms" (compressed passes) /
"target_ms" (the target's own layers in the same forwards) with their per-pass "cost_ratio"; the compressed time
itself split into "upper_ms" (the copy's upper layers and head: guessing the slots) and "lower_ms" (its lower
layers: re-embedding them), which on the embedded model's CPU preset is most of it; "lower_reused" (lower passes
that went on from the previous fractal layer's or from the target's own slot rows, `Splice._kept`) and
"slots_started_right" (slots whose starting token the first fractal layer guessed too, on the eager CPU path).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specgui import fastpath
from specgui.core.draft import Draft, Extras, Outcome, Rider, SlotChain, Unread
from specgui.core.kvcache import KVCache, read_together
from specgui.core.runner import VERIFY_TOP, Pass, Runner
from specgui.core.sampling import Sampling
from specgui.core.vocab import DraftVocab
from specgui.costs import DeviceClock, beside_forward_ms, interpolate
from specgui.errors import SpecGUIError
from specgui.methods.base import DecodeState, Drafter, register
from specgui.methods.fractal.compress import BACKENDS, CompressedModel, compressed_copy
from specgui.methods.ngram.pld import NgramIndex
from specgui.methods.params import param
from specgui.methods.policy import SizedParams, Sizing

# cached tokens before the rows a compressed pass is timed on (the second as far as the run's cache holds it); a
# pass is priced between them, linearly in context and beyond: its attention grows with the cache faster than the
# target's forward does, so scaled by the target's growth it was priced too cheap on long prompts.
PASS_CONTEXTS = (128, 512)
SLOT_NGRAMS = (1, 4)  # the n-grams (shortest, longest) whose continuation the slots start from (`Fractal._held`)


@dataclass(frozen=True)
class FractalParams(SizedParams):
    num_fractal: int = param(low=0, high=128, help="n: fractal layers, clamped to the model's layer count "
                             "(0: the paper's L/4)")
    window: int = param(low=0, high=32, help="w: draft slots refined per forward (0: w = n, the paper's choice)")
    first: float = param(low=0.0, high=0.99, help="depth of the first fractal layer as a fraction of the "
                         "model's layers (0: layer 0, as the paper's code; earlier where n layers would not fit "
                         "after it); the rest follow at a uniform gap")
    layers: str = param(help="explicit fractal layer indices, comma-separated (overrides num_fractal and "
                        "first; for per-model presets); empty: uniform")
    carry: bool = param(help="the verify forward carries the next draft's slots (else every step runs its "
                        "own draft forward, as in the paper)")
    backend: str = param(choices=BACKENDS, help="compressed copy: auto = on CUDA the cheapest measured, on a CPU "
                         "int8 weights through the skinny kernel where it builds (methods/fractal/compress.py); "
                         "torch-fp16 is a non-int8 comparison")
    draft_vocab: int = param(low=0, high=1 << 20, help="ids the compressed head scores for the slot guesses: the "
                             "lowest this many plus the prompt's and the output's (0: the whole vocabulary)")


@functools.lru_cache(maxsize=64)
def slot_visibility(window: int, chain: int) -> np.ndarray:
    """Which rows `window` slots after [pending, `chain` tokens] see among the forward's: every exact row, and the
    slots up to their own. Read-only and made once a shape: between a verdict's read and the next launch, where a GPU
    waits for the host."""
    visibility = np.ones((window, 1 + chain + window), dtype=bool)
    visibility[:, 1 + chain :] = np.tri(window, dtype=bool)
    visibility.flags.writeable = False
    return visibility


def fractal_positions(num_layers: int, params: FractalParams) -> list[int]:
    """The fractal layers: explicit indices, or n layers from `first` at a uniform gap (from earlier where n layers
    would not fit after `first`: a preset's depth holds for models of any depth)."""
    if params.layers.strip():
        try:
            chosen = sorted({int(x) for x in params.layers.split(",") if x.strip()})
        except ValueError:
            raise SpecGUIError(f"fractal layers must be comma-separated integers, got {params.layers!r}") from None
        if not chosen or chosen[0] < 0 or chosen[-1] >= num_layers:
            raise SpecGUIError(f"fractal layers {params.layers!r} must lie in 0..{num_layers - 1}")
        return chosen
    n = min(params.num_fractal or max(1, num_layers // 4), num_layers)
    start = min(int(params.first * num_layers), num_layers - n)
    gap = (num_layers - start) / n
    return [start + int(k * gap) for k in range(n)]


@dataclass(frozen=True)
class FractalPlan:
    """What every spliced forward of one generation shares."""

    runner: Runner
    compressed: CompressedModel
    layers: tuple[int, ...]  # the fractal layers, ascending
    window: int
    clock: DeviceClock

    @functools.cached_property
    def hooked(self) -> frozenset[int]:
        """Where the runner calls a splice (`Splice.layers`): the fractal layers, and before and after the stack."""
        return frozenset(self.layers) | {0, self.runner.num_layers}


class Splice:
    """The pre-layer hook of one forward whose rows are [exact rows..., slots...].

    `exact` rows (the pending token and any draft chain) are never modified; the last of them is the
    anchor the slots continue. `guesses[k]` holds the slot tokens set at the k-th fractal layer.
    """

    def __init__(self, plan: FractalPlan, cache: KVCache, committed: int, exact: int, anchor_position: int,
                 state: DecodeState | None = None, vocab: DraftVocab | None = None,
                 held: list[int] | None = None, programs: dict[int, SpliceProgram | None] | None = None) -> None:
        self.plan = plan
        self.programs = {} if programs is None else programs  # `in_program`'s, made once an exact count (a drafter's)
        self.vocab = vocab  # the ids the compressed head guesses among (None: all)
        self.cache = cache  # the decode state's: the sub-passes read it through frozen views
        self.committed = committed
        self.exact = exact
        self.anchor_position = anchor_position
        self.guesses: list[torch.Tensor] = []
        self.lower: tuple[int, torch.Tensor] | None = None  # the latest lower pass on a CPU: (its layers, output)
        # `_kept` compares guesses on the host: on the eager CPU path only, where a read stalls nothing
        self.reuse = not (state and state.static) and plan.runner.device.type == "cpu"
        self.state = state  # where the guesses ride with the step's verdict read (`DecodeState.ride`), if given
        self.riders: list[Rider] = []
        self.read: list[list[int]] | None = None  # the guesses on the host, once read
        self.reused = 0  # lower passes that went on from the one before
        # the tokens the slots start from, which the first fractal layer's guesses are compared with (`_kept`), and
        # whether the slot rows are still the target's own for them (no lower pass has replaced any)
        self.held = torch.tensor(held) if held is not None and self.reuse else None
        self.fresh = self.held is not None
        self.started_right: int | None = None  # leading slots the first fractal layer guessed as they started
        self.marks: list[tuple[Any, Any, Any]] = []  # (start, guessed, end) of each compressed pass
        self.span: list[Any] = []  # marks before the first layer and after the last, for the time split

    @property
    def layers(self) -> frozenset[int]:
        """Where the runner calls this hook (the layers between run as one piece, `runner.PreLayer`)."""
        return self.plan.hooked

    @functools.cached_property
    def slot_positions(self) -> np.ndarray:
        """The slots' positions (host values in numpy: uploaded as they are), for the passes run between programs (a
        splice inside its forward's program needs none: made when first asked, not at every draft)."""
        return np.arange(self.anchor_position + 1, self.anchor_position + 1 + self.plan.window)

    @functools.cached_property
    def all_positions(self) -> np.ndarray:
        """Every row's position, the exact rows' and the slots' (as `slot_positions`)."""
        return np.arange(self.committed, self.anchor_position + 1 + self.plan.window)

    def __call__(self, layer: int, h: torch.Tensor, step: Pass) -> torch.Tensor:
        if layer in (0, self.plan.runner.num_layers):
            self.span.append(self.plan.clock.mark())
        if layer not in self.plan.layers:
            return h
        comp, runner = self.plan.compressed, self.plan.runner
        start = self.plan.clock.mark()
        exact = step.lasting(h[:, : self.exact])  # `h` may be a program's output: the passes below run others
        if self.fresh:  # the slots' states as the target's layers computed them
            self.lower = (layer, step.lasting(h[:, self.exact :]))
        # upper: layers >= `layer` hold only the committed prefix so far, so every row of the forward runs
        upper = runner.new_pass(self.all_positions, self.cache.view(self.committed))
        x = comp.run(upper, h, range(layer, runner.num_layers))
        guesses = comp.logits(x[0, self.exact - 1 : -1], self.vocab).argmax(-1)  # [w]: anchor, slots 1..w-1 predict
        guessed = self.plan.clock.mark()
        # lower: layers < `layer` already hold the prefix and this forward's exact rows
        # the forward's own slot keys there are stale (the slots are being replaced): the pass may overwrite them
        seen = self.committed + self.exact
        lower = runner.new_pass(self.slot_positions, self.cache.view(seen, scratch=True))
        kept = self._kept(guesses)
        if self.fresh and not self.guesses:
            self.started_right = kept
        self.fresh = self.fresh and kept == len(guesses)
        if kept:  # go on from the previous lower pass (`_kept`)
            done, y = self.lower
            if kept < len(guesses):  # the slots from the first changed one, below `done`, after the kept ones' keys
                redo = runner.new_pass(self.slot_positions[kept:], self.cache.view(seen + kept, scratch=True))
                y = torch.cat([y[:, :kept], comp.run(redo, comp.embed(guesses[kept:].view(1, -1)), range(done))], 1)
            y = comp.run(lower, y, range(done, layer))
            self.reused += 1
        else:
            y = comp.run(lower, comp.embed(guesses.view(1, -1)), range(layer))
        # for the next fractal layer's lower pass (`_kept`), where it is read
        self.lower = (layer, lower.lasting(y)) if self.reuse else None
        self.guesses.append(guesses)
        if self.state is not None:
            self.riders.append(self.state.ride(guesses))
        self.marks.append((start, guessed, self.plan.clock.mark()))
        return torch.cat([exact, y.to(h.device)], dim=1)

    def in_program(self) -> SpliceProgram | None:
        """The splice as its forward's program runs it (`fastpath.InProgram`, asked by `Runner.forward` when the fast
        path would run the forward as one program): over the whole vocabulary, its guesses riding with the step's
        read from the readout's tail; None elsewhere, where this hook runs between the forward's programs."""
        state, plan = self.state, self.plan
        if state is None or not state.static or self.reuse or self.vocab is not None:
            return None
        if self.exact not in self.programs:
            self.programs[self.exact] = SpliceProgram.of(plan, self.cache, self.exact)
        made = self.programs[self.exact]
        if made is not None:  # the forward runs it (a splice's rows are always within the buckets)
            self.riders = [state.ride(part) for part in made.parts]
        return made

    def _kept(self, guesses: torch.Tensor) -> int:
        """How many leading slots this lower pass takes as they are at the layers below the previous fractal layer
        (at the first, below this one): those that hold the same tokens as then. A slot's row sees the prefix, the
        exact rows and the slots before it, none of which changed, so at those layers it would compute the same states
        and write the same keys: only the slots from the first changed one run there (over the kept slots' keys), then
        every slot runs the layers since. After a previous lower pass that is the full pass bit for bit (the C layers
        compute each row from its own input and the keys it sees); before any (`fresh`: every slot guessed as it
        started) the kept slots keep the states the target's own layers computed for the tokens they started from
        (`held`), which the copy would only approximate. Only on the eager CPU path (`reuse`): elsewhere the
        comparison would stall the host in the middle of the forward (on a GPU a device sync) to save work whose
        launches are cheap there."""
        if self.lower is None:
            return 0
        before = self.guesses[-1] if self.guesses else self.held
        changed = (guesses != before).nonzero()
        return int(changed[0]) if len(changed) else len(guesses)

    def times(self) -> tuple[float, float, float]:
        """(upper ms, lower ms, target ms) of this forward: the compressed passes' upper layers and head, their lower
        layers, and the rest of the forward (the target's own layers); call once the device is done with it."""
        clock = self.plan.clock
        upper = sum(clock.ms(start, guessed) for start, guessed, _ in self.marks)
        lower = sum(clock.ms(guessed, end) for _, guessed, end in self.marks)
        total = clock.ms(self.span[0], self.span[-1]) if len(self.span) == 2 else 0.0
        return upper, lower, total - upper - lower

    def slot_tokens(self) -> list[list[int]]:
        """Each fractal layer's slot guesses, from the read that brought them (a rider of the step's verdict, or the
        own draft forward's read, `settle`)."""
        if self.read is None:
            self.read = ([[int(v) for v in rider.values] for rider in self.riders] if self.riders
                         else torch.stack(self.guesses).tolist())
        return self.read

    def settle(self, values: list[float]) -> None:
        """The guesses from a read made beside them (`Fractal._draft_forward`), in place of the riders'."""
        w = self.plan.window
        self.read = [[int(v) for v in values[k * w : (k + 1) * w]] for k in range(len(values) // w)]


@dataclass(frozen=True, eq=False)
class SpliceProgram:
    """`Splice` inside its forward's program (`fastpath.InProgram`): at each fractal layer the copy's upper layers over
    every row of the forward, their keys written where the forward's own layers write theirs (and will, over them,
    when it gets there: the upper pass sees the committed prefix and itself, as over a view); the copy's head's slot
    guesses into its `parts` [w] (views of the readout's tail, read with the verdict); its lower layers over the slot
    rows (the forward's own rows, seeing the exact rows' keys and writing the slots' over their stale ones); the slot
    rows replaced. The forward is one program: no upload, launch or read between its layers."""

    plan: FractalPlan
    exact: int
    parts: tuple[torch.Tensor, ...]  # the guesses of a fractal layer each, as the step's verdict read brings them
    # where the slots' anchor is a device value (`anchored`): it [1], and the rows of slots 1..w-1 after it
    anchor: torch.Tensor | None = None
    following: torch.Tensor | None = None

    @classmethod
    def of(cls, plan: FractalPlan, cache: KVCache, exact: int) -> SpliceProgram | None:
        """The splice of forwards with `exact` rows over `cache` (the fast path's); None where its guesses do not
        fit. Made once an exact count a run (`Fractal.setup`): the views are device work between a verdict's read and
        the next launch."""
        if not isinstance(cache, fastpath.StaticKVCache):
            return None
        w = plan.window
        region = cache.readout.tail(len(plan.layers) * w)
        return None if region is None else cls(plan, exact,
                                                tuple(region[k * w : (k + 1) * w] for k in range(len(plan.layers))))

    def anchored(self, anchor: torch.Tensor) -> SpliceProgram:
        """This splice where the row the slots continue is `anchor` [1] (a device value, set before each run), not the
        last of the `exact` rows: a carried step's forward carries its chain's whole size, of which only the first
        tokens may stand (`fastpath.SlotSteps`)."""
        w, device = self.plan.window, anchor.device
        return dataclasses.replace(self, anchor=anchor,
                                   following=torch.arange(self.exact, self.exact + w - 1, device=device))

    @property
    def key(self) -> tuple[Any, ...]:
        return id(self.plan.compressed), self.plan.layers, self.plan.window, self.exact, self.anchor is not None

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.plan.layers)

    @property
    def rows(self) -> int:
        return self.exact + self.plan.window

    def inside(self, layer: int, h: torch.Tensor, run: fastpath.RunLayers) -> torch.Tensor:
        comp, w, exact = self.plan.compressed, self.plan.window, self.exact
        x = run(h, range(layer, self.plan.runner.num_layers), comp.layers, None)
        rows = (x[0, exact - 1 : exact - 1 + w] if self.anchor is None  # the anchor's and slots 1..w-1's rows
                else x[0].index_select(0, torch.cat([self.anchor, self.following])))
        guesses = comp.logits(rows).argmax(-1)
        self.parts[self.plan.layers.index(layer)].copy_(guesses)
        y = run(comp.embed(guesses.view(1, -1)), range(layer), comp.layers, (exact, w))
        return torch.cat([h[:, :exact], y.to(h.dtype), h[:, exact + w :]], dim=1)


@dataclass(frozen=True)
class _Priced:
    """A draft's prices made ahead (`Fractal.after_launch`): a restart's own draft forward, and the compressed passes
    of a verify forward of each number of rows the draft may send (`_passes_ms`)."""

    own: float
    passes: dict[int, float]


def per_token_acceptance(accepted: float, drafted: int) -> float:
    """The per-token acceptance p with which a chain of `drafted` tokens has `accepted` of them accepted on average
    (p + p^2 + ... + p^drafted, each token accepted only if all before it were)."""
    low, high = 0.0, 1.0
    for _ in range(50):
        p = (low + high) / 2
        low, high = (p, high) if sum(p**i for i in range(1, drafted + 1)) < accepted else (low, p)
    return (low + high) / 2


def consistent_chain(bonus: int, slot_tokens: list[int], predictions: list[int]) -> list[int]:
    """Draft tokens after `bonus` from the slots' final predictions, cut where a slot disagrees.

    Slot j held `slot_tokens[j]` and predicted `predictions[j]` for the position after it. Slot 0 must
    hold `bonus` (the token the anchor's row produced), slot j + 1 the prediction of slot j.
    """
    chain: list[int] = []
    expected = bonus
    for held, predicted in zip(slot_tokens, predictions):
        if held != expected:
            break
        chain.append(predicted)
        expected = predicted
    return chain


def origins(tokens: list[int], offset: int, slot_tokens: list[list[int]], layers: list[int], final: int) -> list[int]:
    """Per draft token, the fractal layer from which its slot's guess stayed that token.

    Token t sits `offset + t` positions after the anchor, i.e. in slot `offset + t - 1`; tokens beyond
    the slots or that no fractal layer settled on came from the target's final head (`final`).
    """
    out = []
    for t, token in enumerate(tokens):
        slot = offset + t - 1
        origin = final
        for layer, guesses in reversed(list(zip(layers, slot_tokens))):
            if slot >= len(guesses) or guesses[slot] != token:
                break
            origin = layer
        out.append(origin)
    return out


@register
class Fractal(Drafter):
    name = "fractal"
    title = "Fractal"
    summary = "Int8 copies of the model spliced in before n layers refine w draft slots mid-forward."
    Params = FractalParams
    pauses_plainly = True
    # the paper (Sec. 4): N + 0.74 tokens accepted per verification, observed at N = 7 fractal layers, the target's
    # own token included: 6.74 of 7 draft tokens, 0.99 a token. (Carrying the 0.74 over to the CPU preset's N = 2,
    # 1.74 of 2 or 0.92 a token, as this prior once did, put the prior under break-even and kept Fractal paused
    # where its drafts were accepted whole.)
    paper_acceptance = per_token_acceptance(accepted=7 - 0.26, drafted=7)

    def __init__(self, runner: Runner, params: FractalParams, sampling: Sampling) -> None:
        super().__init__(runner, params, sampling)
        layers = fractal_positions(runner.num_layers, params)
        window = params.window or len(layers)
        # built here, outside decoding time, once per runner (its build time is reported in Prefill); "auto" is
        # chosen over the rows of a steady verify forward's passes (pending token, chain, slots)
        compressed, built = compressed_copy(runner, params.backend, rows=1 + 2 * window)
        self.build_ms = compressed.build_ms if built else 0.0
        self.plan = FractalPlan(runner, compressed, tuple(layers), window, DeviceClock(runner.device))

    def setup(self, state: DecodeState) -> None:
        w, backend = self.plan.window, self.plan.compressed.backend
        # a compressed pass over the rows the forwards carry: a restart's [pending, slots] and the steady
        # verify's [pending, chain, slots] with the whole chain, at two contexts
        self.pass_rows = (1 + w, 1 + 2 * w)
        room = getattr(state.cache, "capacity", None)  # the fast path's static cache: a fixed capacity
        self.pass_contexts = tuple(c if room is None else min(c, room - 2 * self.pass_rows[-1])
                                   for c in PASS_CONTEXTS)
        priced = DraftVocab.typical(self.runner, self.params.draft_vocab)  # None: the whole head
        vocab = f".vocab{priced.size}" if priced else ""
        self.pass_ms = [[state.profile.mechanism(f"fractal.pass.{backend}.rows{rows}.ctx{context}{vocab}",
                                                 lambda r=rows, c=context: self._pass_ms(state, r, c, priced))
                         if state.profile else 1.0 for rows in self.pass_rows] for context in self.pass_contexts]
        self.programs: dict[int, SpliceProgram | None] = {}  # a splice's, by its forward's exact rows (`in_program`)
        if state.static and not self.params.draft_vocab:  # the spliced forwards' programs, made untimed: every
            # count of exact rows a forward can carry (a restart's one, up to a verify's pending token + w + 1)
            self.programs.update({exact: SpliceProgram.of(self.plan, state.cache, exact) for exact in range(1, w + 3)})
            fastpath.warm_up(state.cache, hooks=[hook for hook in self.programs.values() if hook is not None])
        # carried steps drafted on the device at the launch (`fastpath.SlotSteps`): on the device's path, carrying,
        # over the whole vocabulary; their programs made untimed, a chain's every size
        self.on_device = (state.unread and self.params.carry and not self.params.draft_vocab
                          and all(self.programs.get(1 + size) is not None for size in range(1, w + 1)))
        if self.on_device:
            fastpath.slots.warm_up(state.cache, [self._slot_chain(size, True) for size in range(1, w + 1)])

    def begin(self, state: DecodeState) -> None:
        self.carried: list[int] = []  # next draft, produced by the previous verify forward's slots
        self.carried_origin: list[int] = []
        self.splices: list[Splice] = []  # forwards of the current step that ran fractal layers
        self.carrying: Splice | None = None
        self.sized, self.drafted, self.exhausted, self.exact_first = 0, 0, False, False
        self.priced: _Priced | None = None  # the next draft's prices, made beside the forward before (`after_launch`)
        # sizes count slot tokens: a restart's draft adds the exact token its own forward read off in front
        self.policy = self.sizing(state, range(1, self.plan.window + 1))
        self.vocab = DraftVocab.of(self.runner, self.params.draft_vocab, state.tokens)
        self.index = NgramIndex(*SLOT_NGRAMS)
        self.index.update(state.tokens)  # the prompt; the output as it comes, beside the forwards (`after_launch`)
        self.chaining = False  # on the device: whether the step before carried slots (else the next chain restarts)
        self.stood: list[int] = []  # on the device: the latest chain's standing tokens, once read (`_decide`)
        self.guessed: list[list[int]] | None = None  # and its slots' guesses, each fractal layer's
        self.previous: list[list[int]] | None = None  # the guesses of the slots that chain came from

    def draft(self, state: DecodeState) -> Draft:
        """The carried chain, or one from an own draft forward, cut to the size the cost model picks (on the device's
        path the chain the device carries, `_device_draft`)."""
        self.splices = []
        self.carrying = None
        depth, w = state.max_depth, self.plan.window
        restart = not self.carried
        # Sized by the steady state: while drafts are accepted, a step is a verify of n tokens with the next
        # draft's slots and their passes (the paper's schedule adds a draft forward to every step). A draft not
        # accepted whole breaks the chain and the next step pays an own draft forward to restart it, so each
        # size is also charged that forward times the chance of a break, read off the method's own acceptance
        # curve (`DraftPolicy.whole`). Priced without it, a cheap verify made every size look like a gain where
        # chains broke every other step (held-out translation: 0.80x, tau 1.49).
        # A restart's own forward also reads off the target's next token (exact, drafted in front of the chain):
        # it stands in for a plain step, so it is charged what it costs beyond one. Charged whole, a chain of
        # drafts accepted 98-100% of the time was paused on this CPU from the prior on (held-out, 0.99x).
        # (All of it but the verify is the method's own work, priced by the profile: `step_ms` corrects it.)
        priced, self.priced = self.priced, None  # beside the forward before, where it ran (`after_launch`)
        own = priced.own if priced is not None else self._own_ms(state)
        # on the device the chain is cut there: the plan's size verifies whatever stands
        limit = max(0, min(depth, w) if self.on_device else min(depth - restart, w if restart else len(self.carried)))
        # (on the device's path the plan was chosen ahead, `after_launch`: priced only where chosen now)
        sizing = self.policy.sized(state.unread, lambda: (self._cost(state, own), state.plain_ms()), limit)
        if sizing.size == 0:  # decode plainly; a carried chain stays, to resume from once the text matches it
            self.sized, self.chaining = 0, False
            return Draft(info={**self._info(), "origin": [], "plan": sizing})
        if self.on_device:
            return self._device_draft(state, sizing, priced)
        if restart:
            tokens, origin = self._draft_forward(state)  # [exact token, chain...]
            source, paid = "draft forward", own
        else:
            tokens, origin, source, paid = self.carried, self.carried_origin, "carried", 0.0
        keep = sizing.size + restart
        tokens, origin = tokens[:keep], origin[:keep]
        self.sized, self.drafted, self.exact_first = sizing.size, len(tokens), restart
        self.exhausted = len(tokens) < keep
        # after this step emits the draft and its own token, the next one can draft only if depth is left
        extras = self._slots(state, tokens) if self.params.carry and depth > len(tokens) + 1 else None
        rows = 1 + len(tokens) + w
        passes = (0.0 if not extras else priced.passes[rows] if priced is not None and rows in priced.passes
                  else self._passes_ms(state, rows))
        return Draft(tokens=tokens, extras=extras, cost_ms=paid + passes,
                     info={**self._info(), "origin": origin, "source": source, "plan": sizing})

    def _own_ms(self, state: DecodeState) -> float:
        """A restart's own draft forward: the target's over [pending, slots] and its compressed passes."""
        w = self.plan.window
        return state.forward_ms(1 + w) + self._passes_ms(state, 1 + w)

    def _cost(self, state: DecodeState, own: float) -> Callable[[int], float]:
        """What a step drafting n slot tokens costs (`draft`'s pricing), `own` a restart's draft forward."""
        w = self.plan.window
        extra = max(0.0, own - state.forward_ms(1))
        slots = w if self.params.carry else 0  # the verify forward carries the next draft's slots
        steady = 0.0 if self.params.carry else extra
        whole = functools.cache(self.policy.whole)  # read when first priced (a plan chosen ahead prices nothing)

        def cost(n: int) -> float:
            breaks = 1.0 - whole()[n] if self.params.carry else 0.0
            passes = self._passes_ms(state, 1 + n + slots) if slots else 0.0
            return state.step_ms(steady + breaks * extra + passes, 1 + n + slots)

        return cost

    def after_launch(self, state: DecodeState) -> None:
        """On the device's path (`DecodeState.unread`) the next step's plan is chosen here, beside this step's
        forward (`DraftPolicy.plan_ahead`, as the layer-skip methods do), up to the window and the budget left after
        this step's token; the next draft cuts it to what it can offer (a carried chain may be shorter). So are a
        restart's draft forward and the compressed passes of every verify the next draft may send priced here, at this
        step's context (`_Priced`), not between the verdict's read and the next launch. On every path the n-gram index
        of the slots' starting tokens learns the text so far here (`_held`: the next draft finds the last verdict's
        n-grams a step late; on the device the slots start from the device's lookup instead)."""
        if not self.on_device:
            self.index.update(state.tokens)
        if state.unread:
            w = self.plan.window
            slots = range(1 + w, 3 + 2 * w) if self.params.carry else ()  # (a verify carries slots only carrying)
            self.priced = _Priced(self._own_ms(state), {rows: self._passes_ms(state, rows) for rows in slots})
            self.policy.plan_ahead(self._cost(state, self.priced.own), state.plain_ms(),
                                   max(0, min(state.max_depth - 1, w)))

    def ahead(self, state: DecodeState) -> Draft | None:
        """A paused step (plain); or, on the device, where the next step's plan drafts (chosen in `after_launch`), its
        carried chain, made on the device from what this step leaves there whatever its verdict (`SlotChain`)."""
        promise = super().ahead(state)
        planned = self.policy.next
        if promise is not None or not self.on_device or planned is None or planned[0].size == 0:
            return promise
        return Draft(device_draft=self._slot_chain(planned[0].size, False))

    def _slot_chain(self, size: int, restart: bool) -> SlotChain:
        """The carried chain the device drafts, of `size` tokens (none standing where it `restart`s)."""
        return SlotChain(size, self.plan.window, SLOT_NGRAMS, restart, self.programs[1 + size])

    def _device_draft(self, state: DecodeState, sizing: Sizing, priced: _Priced | None) -> Draft:
        """A step drafting `sizing.size` tokens of the carried chain on the device (`fastpath.SlotSteps`): a restart
        (nothing stands) after a step that carried no slots. Its tokens and their slots' guesses are read with the
        verdict (`_decide`)."""
        made = self._slot_chain(sizing.size, not self.chaining)
        self.sized, self.chaining = sizing.size, True
        passes = (priced.passes[made.rows] if priced is not None and made.rows in priced.passes
                  else self._passes_ms(state, made.rows))
        return Draft(unread=Unread(made.size, None, None, self._decide, list(range(made.size))),
                     device_draft=made, cost_ms=passes, info={**self._info(), "plan": sizing})

    def _decide(self, values: list[float]) -> tuple[list[int], list[int], list[float]]:
        """A carried step's draft from its read (`SlotSteps.launch`'s values: how many stood, the chain, each fractal
        layer's slot guesses): the chain's standing tokens."""
        size, w = self.sized, self.plan.window
        stood = int(values[0])
        self.stood = [int(v) for v in values[1 : 1 + stood]]
        self.guessed = [[int(v) for v in values[1 + size + k * w : 1 + size + (k + 1) * w]]
                        for k in range(len(self.plan.layers))]
        return list(range(stood)), self.stood, [1.0] * stood

    def pieces(self) -> list[fastpath.Piece]:
        """The target's stretches between hooks (`Splice.layers`), and at each fractal layer i the upper pass
        (the copy's layers i..L-1) and the lower pass (its layers 0..i-1)."""
        stops = sorted(set(self.plan.layers) | {0, self.runner.num_layers})
        copies = self.plan.compressed.layers
        return ([(None, range(a, b)) for a, b in itertools.pairwise(stops)]
                + [(copies, range(i, self.runner.num_layers)) for i in self.plan.layers]
                + [(copies, range(0, i)) for i in self.plan.layers if i > 0])

    def _passes_ms(self, state: DecodeState, rows: int) -> float:
        """The compressed passes of one spliced forward of `rows` rows at the current context. A whole pass (every
        layer of the copy) is the measured cost, interpolated in rows at each timed context, then in context; the
        pass of fractal layer i runs the forward's `rows` through the copy's layers i..L-1 and only the w slots
        through 0..i-1, and is priced as those shares of whole passes over `rows` and over w rows."""
        contexts = list(dict.fromkeys(self.pass_contexts))  # one context where the cache held no second

        def whole(r: int) -> float:
            rows_at = [interpolate(list(self.pass_rows), costs, r) for costs in self.pass_ms[: len(contexts)]]
            return max(0.0, interpolate(contexts, rows_at, state.committed))

        layers, upper, lower = self.runner.num_layers, whole(rows), whole(self.plan.window)
        return sum(((layers - i) * upper + i * lower) / layers for i in self.plan.layers)

    def _pass_ms(self, state: DecodeState, rows: int, context: int, vocab: DraftVocab | None) -> float:
        """One compressed pass (every compressed layer and the head, over `vocab`'s ids where given) over `rows` rows
        after a `context`-token prefix, on the path the run takes (over the run's own cache, still empty in `setup`,
        and emptied again), priced as a share of a target forward over the same rows timed beside it
        (`costs.beside_forward_ms`)."""
        runner, comp = self.runner, self.plan.compressed
        prefix = torch.arange(context) % int(runner.config.vocab_size)
        positions = torch.arange(context, context + rows)
        ids = prefix[:rows].view(1, -1).to(runner.embed_device)
        view = state.cache.view(context)  # read once the prefix below is in the cache

        def whole_pass() -> None:  # as a splice runs it: its own pass state (positions, rotary tables), embedding
            step = runner.new_pass(positions, view)
            comp.logits(comp.run(step, comp.embed(ids), range(runner.num_layers)), vocab).argmax(-1)

        with torch.inference_mode():
            runner.forward(prefix, torch.arange(context), state.cache)
            ms = beside_forward_ms(state.profile, whole_pass, lambda: runner.forward(prefix[:rows], positions, view),
                                   rows, context, runner.device)
        state.cache.crop(0)
        return ms

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        if self.vocab is not None:
            self.vocab.add(outcome.emitted)
        if outcome.prefill:
            return {"fractal_layers": list(self.plan.layers), "backend": self.plan.compressed.backend,
                    "compress_ms": self.build_ms}
        if self.sized == 0:  # a plain step: a carried chain whose first token it emitted drafts the rest later
            keep = bool(self.carried) and self.carried[0] == outcome.token
            self.carried, self.carried_origin = (self.carried[1:], self.carried_origin[1:]) if keep else ([], [])
            return self._times()
        if self.on_device:  # the chain stood as the device cut it; its origins from the slots it came from
            self.policy.learn(outcome.path, len(self.stood), len(self.stood) < self.sized)
            came, self.previous = self.previous, self.guessed
            origin = self._origins(self.stood, 2, came) if self.stood and came else []
            return {"origin": origin, "source": "carried" if self.stood else "restart", **self._times()}
        # a restart's first token is exact (its own forward's target row): not evidence of the slots' acceptance
        path = [node - 1 for node in outcome.path if node > 0] if self.exact_first else outcome.path
        if self.exact_first and outcome.path[:1] != [0]:
            path = []
        self.policy.learn(path, self.drafted - self.exact_first, self.exhausted)
        self.carried, self.carried_origin = [], []
        splice = self.carrying
        if splice is not None and outcome.accepted == self.drafted and outcome.extra_tokens is not None:
            slots = splice.slot_tokens()
            chain = consistent_chain(outcome.token, slots[-1], outcome.extra_tokens)
            self.carried = chain
            self.carried_origin = self._origins(chain, 2, slots)
        return self._times()

    # -- forwards ---------------------------------------------------------------------------------------

    def _draft_forward(self, state: DecodeState) -> tuple[list[int], list[int]]:
        """Own forward over [pending, slots] (the paper's draft phase); the cache is cropped back after."""
        c, w = state.committed, self.plan.window
        riders = len(state.riders)
        held = self._held(state, [])
        splice = Splice(self.plan, state.cache, c, exact=1, anchor_position=c, state=state, vocab=self.vocab,
                        held=held, programs=self.programs)
        tokens = np.array([state.pending, *held])
        top = self.runner.forward(tokens, np.arange(c, c + 1 + w), state.cache, pre_layer=splice, top=VERIFY_TOP)
        state.cache.crop(c)
        self.splices.append(splice)
        del state.riders[riders:]  # read here, with the forward's own verdict: the draft is needed now
        # one read: per row [1 + w] the head's verdict (the target's own next token, then each slot's prediction);
        # then the guesses (on the fast path one span of the readout)
        values = read_together([top.packed, *(rider.device for rider in splice.riders)])
        best = top.choices(values)
        splice.settle(values[top.packed.numel() :])
        slots = splice.slot_tokens()
        tokens = [best[0], *consistent_chain(best[0], slots[-1], best[1:])]
        return tokens, self._origins(tokens, 1, slots)

    def _slots(self, state: DecodeState, chain: list[int]) -> Extras:
        """The next draft's slots, riding after `chain` in the verify forward."""
        c, w, n = state.committed, self.plan.window, len(chain)
        held = self._held(state, chain)
        self.carrying = Splice(self.plan, state.cache, c, exact=1 + n, anchor_position=c + n, state=state,
                               vocab=self.vocab, held=held, programs=self.programs)
        self.splices.append(self.carrying)
        return Extras(tokens=held, positions=list(range(c + n + 1, c + n + 1 + w)), visibility=slot_visibility(w, n),
                      pre_layer=self.carrying)

    def _held(self, state: DecodeState, chain: list[int]) -> list[int]:
        """The tokens the next slots start from, after the anchor that ends the text + `chain`: what followed the
        longest n-gram ending there where it occurred before in the text (as `pld` looks up), the anchor's copies for
        the rest (the paper's start). The index holds the prompt from the start and the output up to the step before
        (it learns beside the forward, `after_launch`)."""
        text = state.tokens + chain
        found, _ = self.index.lookup(text, self.plan.window)
        return found + [text[-1]] * (self.plan.window - len(found))

    # -- payload ----------------------------------------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        return {"fractal_layers": list(self.plan.layers)}

    def _origins(self, tokens: list[int], offset: int, slot_tokens: list[list[int]]) -> list[int]:
        return origins(tokens, offset, slot_tokens, list(self.plan.layers), self.runner.num_layers)

    def _times(self) -> dict[str, Any]:
        if not any(splice.marks for splice in self.splices):  # none, or inside programs: no split to time
            return {}
        upper = lower = target = 0.0
        passes = reused = 0
        for splice in self.splices:
            u, lo, t = splice.times()
            upper, lower, target = upper + u, lower + lo, target + t
            passes += len(splice.marks)
            reused += splice.reused
        compressed = upper + lower
        figures: dict[str, Any] = {"compressed_ms": compressed, "upper_ms": upper, "lower_ms": lower,
                                   "target_ms": target, "lower_reused": reused}
        started = [s.started_right for s in self.splices if s.started_right is not None]
        if started:
            figures["slots_started_right"] = sum(started)
        if passes and target > 0:
            figures["cost_ratio"] = (compressed / passes) / (target / len(self.splices))
        return figures

"""The drafter's contract, the decoding state it reads, and the decorator that registers a drafter.

Every method implements two calls, both made by the decode loop (`core.step.Run`):

  draft(state) -> Draft      propose a token tree for the next verify forward; it may run forwards of its own, but
                             leaves every cache layer holding exactly the committed prefix, as it found it
  observe(state, outcome)    learn from the verdict (n-gram caches, skip sets, back-off); also called once after the
                             prompt forward with an empty path. Returns the step's event payload (`core.events`)

The rest are optional (the defaults here do nothing, or the plain thing):

  setup(state)               before the clock starts: one-time work no run is timed for (an offline search, a
                             mechanism's first-use timing, saved in the cost profile)
  begin(state) -> Observer   before the prompt forward; an observer of its hidden states (ADMG's similarities)
  sizing(state, sizes)       the policy that sizes drafts (`policy.DraftPolicy`: the cost model's, or fixed)
  pieces() -> [Piece]        stretches of layers this method runs as pieces (the fast path makes their programs)
  after_launch(state)        learning from the last verdict the next draft does without, beside the next forward
  ahead(state) -> Draft      the next step's draft where the device can make it whatever the verdict in flight
                             (a plain step, a prompt lookup, a device-drafted chain): launched before that read

A family's base adds what its members share (`layerskip.drafting.LayerSkipDrafter`: the chain drafting, the skip
plan's preparation and learning). Tunables live in a `Params` dataclass per method, declared with `params.param` so
that presets (`configs/<method>.yaml`), the CLI and the app's parameter panel validate the same ranges.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from specgui import fastpath
from specgui.core.draft import Draft, Outcome, Rider
from specgui.core.kvcache import KVCache
from specgui.core.runner import Observer, Runner, SkipPlan
from specgui.core.sampling import Sampling
from specgui.costs import CostProfile
from specgui.methods.params import NoParams
from specgui.methods.policy import PRIOR_ALPHA, DraftPolicy

REGISTRY: dict[str, type[Drafter]] = {}


@dataclass
class DecodeState:
    """The decoding state a drafter may read. `tokens[-1]` is the pending token (not cached yet)."""

    runner: Runner
    cache: KVCache
    tokens: list[int]
    prompt_len: int
    sampling: Sampling
    generator: torch.Generator | None
    max_new_tokens: int
    profile: CostProfile | None = None  # measured costs that size drafts (None: no prediction, e.g. while measuring)
    step: int = 0
    tokenizer: Any = None  # the model's tokenizer, for drafters that prepare from text of their own (dv)
    method: str = ""  # the method decoding (whose own work `step_ms` prices)
    model: str = ""  # the model's name, as configs/ match it (dv: the search setting this deployment configures)
    static: bool = False  # the fast path's static cache (on a GPU: programs, and reads that stall the host)
    chains: bool = False  # plain steps chain on the device (`fastpath.PlainSteps`: static, greedy, pipelined)
    riders: list[Rider] = field(default_factory=list)  # device values the next verdict read brings back (`ride`)
    # `verify_ms`'s prices at one context and calibration, with what they hold for: a step's sizing prices every size
    _prices: tuple[tuple[Any, ...], dict[int, float]] = field(default_factory=lambda: ((), {}), repr=False)

    @property
    def unread(self) -> bool:
        """Whether drafts stay on the device until the step's one read (`specgui.core.draft.Unread`): on the fast path
        under greedy decoding. Elsewhere a read costs nothing (the CPU is the device) and a drafter reading as it
        goes stops at its exit without drafting past it."""
        return self.static and self.sampling.greedy

    def ride(self, values: torch.Tensor) -> Rider:
        """Read `values` (any shape, on the device) with the next step's verdict: the returned rider's `values`
        hold them, flattened, once `verify` has run. A tensor filled in place later (by the forward) is read as it
        is then."""
        rider = Rider(values)
        self.riders.append(rider)
        return rider

    def adopt(self, plan: SkipPlan, nodes: int = 1) -> None:
        """A method takes `plan` as its draft model, each draft position carrying `nodes` ids into the verify (its
        token, then runners-up): on the fast path its programs are made now (`fastpath.adopt`)."""
        if self.static:
            fastpath.adopt(self.cache, plan, nodes)

    @property
    def committed(self) -> int:
        """Positions held by the cache: every token but the pending one."""
        return len(self.tokens) - 1

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def plain_ms(self) -> float:
        """What a plain decoding step costs now, what drafting must beat: chained on the device where this run chains
        plain steps (`CostProfile.chained_ms`; plain decoding's steps all are, and so are a paused method's where its
        pause is known ahead), else a verify of one token (`verify_ms`)."""
        if self.chains and self.profile is not None:
            return self.profile.chained_ms(self.committed)
        return self.verify_ms(1)

    def forward_ms(self, rows: int) -> float:
        """What a target forward of `rows` tokens costs now as the profile prices it: a draft forward, part of a
        method's own work (`step_ms` corrects it with the rest of that work)."""
        return self.profile.forward_ms(rows, self.committed) if self.profile else float(rows)

    def verify_ms(self, rows: int) -> float:
        """What a verify forward of `rows` tokens costs now, loop included: the profile's price at this context as
        the steps decoded so far with it correct it (`costs.Calibration`). Kept until either moves: a step's sizing
        asks for every size's, several times (Self-Draft's rooms and steps: ~12 a step at 4 us each, host time)."""
        if self.profile is None:
            return float(rows)
        key, prices = self._prices
        learnt = self.profile.calibration
        now = len(self.tokens) - 1, learnt, learnt.learnt_steps  # (the context: `committed`)
        if key != now:
            self._prices = now, (prices := {})
        price = prices.get(rows)
        if price is None:
            price = prices[rows] = self.profile.verify_ms(rows, now[0]) * self.profile.verify_ratio(rows)
        return price

    def step_ms(self, work_ms: float, rows: int) -> float:
        """What a step costs now that does `work_ms` of the method's own drafting work (as the profile prices it)
        and verifies `rows` tokens: what drafters size their drafts by and the decode loop predicts."""
        own = self.profile.own_ms(self.method, work_ms, rows) if self.profile else work_ms
        return own + self.verify_ms(rows)

    @property
    def max_depth(self) -> int:
        """Deepest useful draft: each step also emits the verifier's own token."""
        return max(0, self.max_new_tokens - self.generated - 1)


class Drafter:
    """Base class: a method that never drafts (which is exactly `baseline`)."""

    name: ClassVar[str]
    title: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type] = NoParams
    # per-token acceptance the method's paper reports, the policy's prior until its own verdicts say otherwise
    paper_acceptance: ClassVar[float] = PRIOR_ALPHA
    # whether a paused step is a plain step (drafts, records, searches nothing): then its policy serves each pause
    # whole (`DraftPolicy.whole_pauses`), so the pause is known ahead and its steps chain on the device (`ahead`)
    pauses_plainly: ClassVar[bool] = False

    def __init__(self, runner: Runner, params: Any, sampling: Sampling) -> None:
        self.runner = runner
        self.params = params
        self.sampling = sampling

    def setup(self, state: DecodeState) -> None:
        """Work that belongs before decoding, not to it: D&V's skip-set search (offline in its paper), the
        cost model's first-use timing of a mechanism (saved in the profile, so later runs find it). Untimed,
        so that a model's first run of a method is priced like every later one. The cache is still empty; a
        measurement may use it but must leave it empty."""

    def begin(self, state: DecodeState) -> Observer | None:
        return None

    def pieces(self) -> list[fastpath.Piece]:
        """Stretches of layers this method's forwards run as pieces, as (modules standing in for the runner's layers
        or None, layers): Fractal's spliced forwards between its fractal layers and its compressed passes. The fast
        path makes their programs before timing starts, as it does the whole forward's."""
        return []

    def sizing(self, state: DecodeState, sizes: Iterable[int]) -> DraftPolicy:
        """The policy that sizes this method's drafts: the cost model's, or the largest size always when the
        parameters ask for the paper's fixed schedule or no cost profile is at hand."""
        return DraftPolicy(sizes, fixed=self.params.policy == "fixed" or state.profile is None,
                           alpha=self.paper_acceptance, whole_pauses=self.pauses_plainly)

    def draft(self, state: DecodeState) -> Draft:
        return Draft()

    def after_launch(self, state: DecodeState) -> None:
        """Learning from the last verdict that the next draft does without, run right after the next step's forward
        is launched (on a GPU, beside it): a pool's harvest of n-grams, which then serves the step after next. Called
        at the same point by the serial loop, so both loops draft the same."""

    def ahead(self, state: DecodeState) -> Draft | None:
        """The next step's draft where the device can make it whatever the verdict of the step in flight: then the
        decode loop launches it before that verdict's read, chained on the device, and asks for the draft, as ever,
        after `observe`. A plain step (`Draft()`: `fastpath.PlainSteps`), or a draft the device makes, of the kind the
        step in flight made (`Draft.device_draft`: a prompt lookup, `fastpath.LookupSteps`; a skip chain, `SkipSteps`;
        a slot chain, `SlotSteps`). A promise: a draft that breaks it fails the run. Plain
        decoding always makes it; a drafter whose paused steps are plain, while its policy's pause lasts
        (`DraftPolicy.paused_ahead`); None: the next draft needs this step's verdict on the host."""
        policy = getattr(self, "policy", None)
        paused = self.pauses_plainly and isinstance(policy, DraftPolicy) and policy.paused_ahead()
        return Draft() if paused else None

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        return {}


def register(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make a drafter available by its `name`."""
    if cls.name in REGISTRY:
        raise ValueError(f"method {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls

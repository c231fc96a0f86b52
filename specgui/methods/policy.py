"""Draft sizing from the cost model: how much a method drafts this step, or whether it drafts at all.

The papers fix their draft sizes (K draft tokens, a candidate budget, a slot window) for the hardware they
ran on. Here one policy sizes every method's drafts for the hardware in hand. A method names its knob n
(draft tokens of a chain, trie nodes, ...) with the values it allows, and what drafting n costs: its own
extra work and the rows its verify forward carries, priced by the measured `CostProfile`. The policy
keeps the method's acceptance as a curve, E[accepted | n], learnt from its verdicts, and picks

    n* = argmax over n of  (1 + E[accepted | n]) / cost(n)          (tokens per ms)

against plain decoding's 1 / plain_ms. When no n beats plain decoding by `MARGIN`, the step drafts
nothing (paused); a probe of the best n follows after a pause that doubles after each probe that still
predicts a loss, and drafting resumes at once when the curve says it pays. A probe is spent only where a
draft accepted at the prior's rate (below) would at least break even: where even that loses, as a layer-skip draft of a
small model on a CPU does, no probe can find a gain worth its cost, and the method decodes plainly; such a pause
for good stands unpriced for `RECHECK` steps at a time (the prices move with the context, slowly; pricing every size
every step is host time the method's plain decoding need not carry).
The papers' mechanisms (what is drafted, how it is verified) are untouched: the policy only says how much,
and whether.

E[accepted | n] from verdicts: a verify of d nodes in the drafter's order (parents before children,
favourites first) also says what a verify of only the first n <= d nodes would have accepted: the
accepted path's nodes below n. So each step teaches the curve for every n up to what it verified, and
for every larger n as well when the drafter had nothing more to offer (a draft exit, a short lookup).
Values never observed keep a prior, a geometric acceptance of `alpha` per token (`PRIOR_ALPHA`, or the
acceptance the method's paper reports, which a method brings as `Drafter.paper_acceptance`; dv brings its skip
set's, as measured by its search), optimistic enough
that the policy tries them, but no higher than the curve's slope below them allows (`curve`); recent
steps weigh more (`DECAY`, applied to every size at every verdict), so the curve follows the text and a
size not re-checked lately returns towards its prior. The prior weighs as one verdict where a size has none of its
own and halves with each verdict's weight of them (`PRIOR_FADE`), so a size's running acceptance soon prices it alone,
whatever the prior hoped. At a fixed weight beside a memory that never weighs more than ten verdicts, the prior would
keep a tenth of its say for good (E[accepted | 1] never below alpha / 11), and on a GPU, where a verify of two rows
costs one and a deeply skipped draft token is priced near nothing, that floor alone predicts a gain at 0% acceptance.
So the prior's weight fades with the verdicts: four that accept nothing pause it.

Drafting as a whole is priced too, where a pause chains on the device (`whole_pauses`): there a paused step is plain
decoding's, launched before the step before it is read, while every step of a method that drafts is launched after its
read, and pays the host's work between the two forwards whether or not it drafts (a lookup that finds nothing, a pool
with no candidate), so a method can price a gain on every step it drafts and still lose to plain decoding. So each
step decoded outside a pause is settled (`settle`): its tokens
against its price in chained plain steps, a decayed mean like the curve's; where, over at least `EVIDENCE` such steps,
drafting yields fewer tokens than plain decoding would in the same time, the method pauses whole (doubling, as probes
do), and its steps chain.

Acceptance runs in streaks: output that copies its input (a summary quoting its source, code repeating a
name) keeps copying, and a draft right after a rejection is accepted less often than one right after a
success. So the policy keeps one curve per regime, the number of tokens the previous verdict accepted (0,
1, or 2 and more; a step reported as drafting nothing counts as 0), and prices each step by the curve of
the regime it is in. Prompt lookup replayed exactly on greedy outputs (`python -m specgui.tools.replay`, 14 held-out
and 14 development prompts, 64 tokens, priced by one CPU profile): one curve 1.29x and 1.46x, a curve per regime
1.35x and 1.47x (measured in the held-out bench: 1.31x before, 1.33-1.35x after); the previous step's accepted
count cut finer (3 and more), or the matched n-gram's length added, did no better.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specgui.methods.params import param

MARGIN = 0.02  # drafting must be predicted at least this much faster than plain decoding
PRIOR_ALPHA = 0.8  # prior per-token acceptance for sizes never observed
PRIOR_WEIGHT = 1.0  # the prior counts as this many steps where a size has no verdicts of its own ...
PRIOR_FADE = 0.5  # ... and this much less per verdict's weight it has
DECAY = 0.9  # weight of the past per new observation (an effective memory of about ten steps)
REGIMES = 3  # acceptance curves kept: after a verdict that accepted 0, 1, or 2 and more tokens
RECHECK = 8  # a pause for good (`Sizing.hopeless`) is priced again every this many steps
EVIDENCE = 4  # steps drafting as a whole is judged on (`settle`) before it may call a pause


POLICIES = ("cost", "fixed")
Pricing = Callable[[], tuple[Callable[[int], float], float]]  # a step's prices, when needed: (cost of size n, plain_ms)


@dataclass(frozen=True)
class SizedParams:
    """The parameter every method that sizes drafts shares (its Params dataclass derives from this)."""

    policy: str = param(choices=POLICIES, help="draft size: 'cost' = sized each step by the cost model, pausing "
                        "where no draft pays; 'fixed' = always the largest the parameters allow (the paper's)")


@dataclass(frozen=True)
class Sizing:
    """One step's decision: draft `size` (0: nothing), and why."""

    size: int
    mode: str  # "draft", "probe" (drafting although a loss is predicted, to learn), "paused", "fixed"
    predicted: float  # predicted speedup over plain decoding of the plan taken (1.0 when paused)
    best: float  # the best predicted speedup among the sizes
    expected: float  # expected accepted tokens of the plan taken
    prior: float | None = None  # paused: the best speedup at the prior's acceptance (below the margin: no probes)
    alpha: float = PRIOR_ALPHA  # the prior's per-token acceptance
    regime: int = 0  # the curve that priced it: tokens the previous verdict accepted (capped at REGIMES - 1)

    def cut(self, size: int) -> Sizing:
        """The plan drafting `size` instead (what a step can offer, below the size chosen ahead). Made directly:
        `dataclasses.replace` costs several times more, between a verdict's read and the next launch."""
        return Sizing(size, self.mode, self.predicted, self.best, self.expected, self.prior, self.alpha, self.regime)

    @property
    def hopeless(self) -> bool:
        """Paused because even the prior's acceptance would lose: no probe comes, so work that serves only
        drafting (a skip-set search) would be spent for nothing."""
        return self.mode == "paused" and self.prior is not None and self.prior < 1

    def to_dict(self) -> dict[str, object]:
        prior = {} if self.prior is None else {"prior": round(self.prior, 3), "alpha": self.alpha}
        return {"size": self.size, "mode": self.mode, "predicted": round(self.predicted, 3),
                "best": round(self.best, 3), "expected": round(self.expected, 3), "regime": self.regime, **prior}


class DraftPolicy:
    """Chooses a draft size per step from predicted costs and the learnt acceptance curve."""

    def __init__(self, sizes: Sequence[int], *, fixed: bool = False, max_pause: int = 64,
                 alpha: float = PRIOR_ALPHA, regimes: int = REGIMES, whole_pauses: bool = False) -> None:
        self.sizes = sorted(set(sizes))
        self.alpha = alpha  # the prior's per-token acceptance
        self.fixed = fixed  # always the largest size: the papers' schedule, for comparison and tests
        self.max_pause = max_pause
        self.sums = [dict.fromkeys(self.sizes, 0.0) for _ in range(regimes)]  # per regime, per size
        self.weights = [dict.fromkeys(self.sizes, 0.0) for _ in range(regimes)]
        self.regime = 0  # the previous verdict's accepted tokens, capped at regimes - 1
        self.pause = 1  # length of the next pause
        self.left = 0  # paused steps still to come
        self.probe = False  # the step after a pause probes
        self.standing: Sizing | None = None  # a pause for good, with the steps it still stands unpriced
        self.stands = 0
        # a pause is served whole, unpriced (`paused_ahead`): its plan stands for its steps, as a pause for good does
        self.whole_pauses = whole_pauses
        self.pausing: Sizing | None = None
        self.early: Sizing | None = None  # the next step's plan, priced on the last step of a pause for good
        self.held = False  # the last plan was a pause served whole (not settled: it was no drafting step)
        self.next: tuple[Sizing, bool] | None = None  # chosen ahead (`plan_ahead`): the next step's plan and `held`
        self.planned: tuple[Sizing, bool] | None = None  # the step's plan as `take` gave it: `learn` folds it in so
        self.unlearnt: tuple[Any, ...] | None = None  # a verdict `learn` was told to fold in `later`, with its plan
        self.prices: tuple[object, dict[int, float]] | None = None  # priced ahead (`price_ahead`): shape, size -> ms
        self.tokens = self.cost = 0.0  # drafting as a whole: decayed tokens, and price in plain steps (`settle`)
        self.priors: tuple[float, dict[int, float]] = (-1.0, {})  # (alpha, each size's `_geometric` at it)
        self.settled = 0  # steps settled since the last pause
        self.rest = 1  # length of the next pause `settle` calls (doubling while drafting keeps losing)

    def expected(self, n: int) -> float:
        """E[accepted | a draft of size n] in the current regime: the decayed mean of what verdicts showed,
        pulled towards the prior."""
        return self.curve(n)[n]

    def curve(self, upto: int | None = None) -> dict[int, float]:
        """E[accepted | n] for every size, in the current regime. A size's prior is the geometric one, capped by
        the straight line through the two sizes below it: each extra draft token is accepted only if all before
        it were, so the curve is concave, and a size that smaller ones already show to be poor is not tried on
        hope. The prior's weight fades as the size's own verdicts weigh more (`PRIOR_FADE`): what they show
        prices it, not the hope it started from. With `upto`, the sizes up to it only (a size's value needs only the
        sizes below): what a step that offers no more prices."""
        sums, weights, geometric = self.sums[self.regime], self.weights[self.regime], self._priors()
        out: dict[int, float] = {}
        last_n, last_e, slope = 0, 0.0, 1.0
        for n in self.sizes:
            if upto is not None and n > upto:
                break
            prior = min(geometric[n], last_e + (n - last_n) * slope)
            hope = PRIOR_WEIGHT * PRIOR_FADE ** weights[n]
            e = (sums[n] + hope * prior) / (weights[n] + hope)
            slope = max(0.0, (e - last_e) / (n - last_n))
            out[n], last_n, last_e = e, n, e
        return out

    def _priors(self) -> dict[int, float]:
        """Each size's geometric prior at the policy's `alpha` (`_geometric`), made once an alpha: a policy prices its
        sizes after the verdict before a step's draft, where a GPU waits for the host."""
        if self.priors[0] != self.alpha:
            self.priors = self.alpha, {n: _geometric(n, self.alpha) for n in self.sizes}
        return self.priors[1]

    def whole(self) -> dict[int, float]:
        """P(a draft of n is accepted whole) for every size: the curve's last step, E[n] - E[n-1] (acceptance
        stops at the first rejection; where sizes skip, the slope from the size below)."""
        curve, out, last_n, last_e = self.curve(), {}, 0, 0.0
        for n in self.sizes:
            out[n] = min(1.0, max(0.0, (curve[n] - last_e) / (n - last_n)))
            last_n, last_e = n, curve[n]
        return out

    def choose(self, cost: Callable[[int], float], plain_ms: float, limit: int | None = None,
               shape: object = None) -> Sizing:
        """The plan for this step; `cost(n)` is the predicted ms of a step that drafts size n, `limit` the
        most the drafter can offer now (a lookup's length, the tokens left in the budget); `shape`, the draft's
        besides its size, where the sizes were priced ahead for it (`price_ahead`)."""
        self._fold()
        cost = self._ahead(cost, shape)
        sizes = [n for n in self.sizes if limit is None or n <= limit]
        self.held = self.whole_pauses and self.left > 0 and self.pausing is not None  # served whole, offer or none
        if self.held:
            self.left -= 1
            return self.pausing
        if not sizes:
            return Sizing(0, "paused", 1.0, 1.0, 0.0, regime=self.regime)
        if self.early is not None:
            early, self.early = self.early, None
            return early
        if self.stands > 0 and self.standing is not None:
            self.stands -= 1
            self.held = self.whole_pauses
            if self.stands == 0 and self.whole_pauses:  # the step after the pause, priced a step early: known ahead
                self.early = self._priced(cost, plain_ms, sizes)
            return self.standing
        return self._priced(cost, plain_ms, sizes)

    def price_ahead(self, shape: object, cost: Callable[[int], float], limit: int) -> None:
        """Price the sizes up to `limit` now for the next `choose` of a draft of the same `shape` (what a step's price
        depends on besides its size: Lookahead's window rows): beside this step's
        forward, where the device would otherwise wait for the pricing between the verdict's read and the next
        launch. The curve still decides then, after this step's verdict is learnt: the choice is `choose`'s, at prices
        of this step's context. A size the draft then offers beyond `limit`, or another shape, is priced at `choose`."""
        self.prices = shape, {n: cost(n) for n in self.sizes if n <= limit}

    def _ahead(self, cost: Callable[[int], float], shape: object) -> Callable[[int], float]:
        """`cost`, where the sizes were priced ahead for `shape`, read from those prices (used once: a step's)."""
        ahead, self.prices = self.prices, None
        if ahead is None or shape is None or ahead[0] != shape:
            return cost
        prices = ahead[1]
        return lambda n: prices[n] if n in prices else cost(n)

    def plan_ahead(self, cost: Callable[[int], float], plain_ms: float, limit: int | None = None) -> None:
        """Choose the next step's plan now (`choose`), before this step's verdict is learnt: beside this step's
        forward, where the device would otherwise wait for the pricing between the verdict's read and the next
        launch (`take` hands it out). The plan is priced by the curve of the regime the step before left and what
        the cost model learnt up to it; `limit` is what the drafter can offer whatever this step emits."""
        self.next = self.choose(cost, plain_ms, limit), self.held

    def take(self, pricing: Pricing, limit: int | None = None) -> Sizing:
        """This step's plan: the one chosen ahead (`plan_ahead`), else chosen now, priced by `pricing()` (the step's
        `cost` and `plain_ms`: priced only then, since a plan chosen ahead needs no price). `learn` then folds the
        step's verdict into the curve that plan was priced by and settles it as what it was (the next plan may be
        chosen before the verdict is learnt, leaving `regime` and `held` describing that one)."""
        if self.next is None:
            self.plan_ahead(*pricing(), limit)
        self.planned, self.next = self.next, None
        return self.planned[0]

    def sized(self, ahead: bool, pricing: Pricing, limit: int) -> Sizing:
        """This step's plan: where plans are chosen ahead (`ahead`, the device's path) the one `plan_ahead` chose,
        cut to `limit`, what this step can offer now (the budget left, a carried chain); else chosen now (`take`'s
        `pricing`)."""
        if not ahead:
            return self.choose(*pricing(), limit)
        plan = self.take(pricing, limit)
        return plan if plan.size <= limit else plan.cut(limit)

    def _priced(self, cost: Callable[[int], float], plain_ms: float, sizes: list[int]) -> Sizing:
        """`choose`'s plan where the sizes are priced."""
        plan = functools.partial(Sizing, regime=self.regime)  # every plan names the curve that priced it
        curve, costs = self.curve(sizes[-1]), {n: cost(n) for n in sizes}
        gains = {n: (1 + curve[n]) * plain_ms / costs[n] for n in sizes}
        if self.fixed:
            return plan(sizes[-1], "fixed", gains[sizes[-1]], max(gains.values()), curve[sizes[-1]])
        best = max(gains, key=lambda n: (gains[n], -n))  # ties go to the smaller draft
        if gains[best] >= 1 + MARGIN or self.max_pause == 0:
            self.pause, self.probe = 1, False
            return plan(best, "draft", gains[best], gains[best], curve[best])
        geometric = self._priors()
        prior = max((1 + geometric[n]) * plain_ms / costs[n] for n in sizes)
        # a draft accepted as well as the prior hopes would not even break even: no probe. (Against the margin
        # instead, Fractal on a CPU, its prior 1.017x and its drafts then accepted 99-100%, never probed.)
        if prior < 1:
            self.standing, self.stands = plan(0, "paused", 1.0, gains[best], 0.0, prior, self.alpha), RECHECK - 1
            return self.standing
        if self.left > 0:
            self.left -= 1
        elif self.probe:
            self.probe = False
            return plan(best, "probe", gains[best], gains[best], curve[best])
        else:
            self.left = self.pause - 1
            self.pause = min(2 * self.pause, self.max_pause)
            self.probe = True
        self.pausing = plan(0, "paused", 1.0, gains[best], 0.0, prior, self.alpha)
        return self.pausing

    def settle(self, emitted: int, priced: float) -> None:
        """Fold a step decoded outside a pause into drafting as a whole (`emitted` tokens for `priced` plain steps'
        time), and pause whole where it yields less than plain decoding (see the module's docstring). Only where
        pauses chain (`whole_pauses`): elsewhere a paused step costs what a step that drafts nothing costs."""
        if not self.whole_pauses or self.fixed or self.max_pause == 0 or self.held:
            return
        self.tokens = DECAY * self.tokens + emitted
        self.cost = DECAY * self.cost + priced
        self.settled += 1
        if self.settled < EVIDENCE:
            return
        if self.tokens >= self.cost:
            self.rest = 1
            return
        gain = self.tokens / self.cost
        self.pausing = Sizing(0, "paused", 1.0, gain, 0.0, gain, self.alpha, self.regime)
        self.left, self.rest = self.rest, min(2 * self.rest, self.max_pause)
        self.tokens = self.cost = 0.0
        self.settled = 0

    def paused_ahead(self) -> bool:
        """Whether the next `choose` pauses whatever the verdicts in between: a pause for good still standing, or
        (`whole_pauses`) a pause with steps to serve, or the step after a pause for good, priced early, that pauses.
        What lets the decode loop launch that step before it reads the one before (`Drafter.ahead`). Where the next
        plan was chosen ahead (`plan_ahead`), whether it drafts nothing."""
        if self.next is not None:
            return self.next[0].size == 0
        if self.early is not None:
            return self.early.size == 0
        return (self.stands > 0 and self.standing is not None) or (self.whole_pauses and self.left > 0
                                                                   and self.pausing is not None)

    def learn(self, path: Sequence[int], verified: int, exhausted: bool, emitted: int = 0, priced: float = 0.0,
              later: bool = False) -> None:
        """Fold one verdict into the curve of the regime it was drafted in, and move to the regime it leaves:
        `path` the accepted nodes (in draft order), `verified` the nodes drafted (0: a step that drafted
        nothing), `exhausted` whether a larger size would have drafted nothing more. Every verdict ages the
        evidence of every size, so what no step re-checks (a size above the ones drafted lately) drifts back
        to the prior instead of locking that size out for good after one bad verdict. `emitted` and `priced`: the
        step's tokens and its price in plain steps (`Outcome.priced`), which `settle` weighs.
        `later`: folded in only when the next plan is chosen (`choose`), with the plan this step was taken as: on the
        device's path, where the next draft takes a plan chosen ahead, that is beside the next forward
        (`plan_ahead`), not between this verdict's read and the next launch, where a GPU waits for the host."""
        self._fold()
        if later:
            self.unlearnt = (self.planned, path, verified, exhausted, emitted, priced)
            return
        self._learn(self.planned, path, verified, exhausted, emitted, priced)

    def _fold(self) -> None:
        """A verdict `learn` was told to fold in later, folded in now."""
        if self.unlearnt is not None:
            unlearnt, self.unlearnt = self.unlearnt, None
            self._learn(*unlearnt)

    def _learn(self, planned: tuple[Sizing, bool] | None, path: Sequence[int], verified: int, exhausted: bool,
               emitted: int, priced: float) -> None:
        if planned is not None:  # taken (`take`): the step's own regime and `held`, not the next plan's
            plan, self.held = planned
            self.regime = plan.regime
        if priced > 0:
            self.settle(emitted, priced)
        if verified == 0:
            self.regime = 0
            return
        sums, weights = self.sums[self.regime], self.weights[self.regime]
        for n in self.sizes:
            sums[n] *= DECAY
            weights[n] *= DECAY
            if n <= verified or exhausted:
                sums[n] += bisect.bisect_left(path, n)  # the path's nodes below n: a parent precedes its child
                weights[n] += 1.0
        self.regime = min(len(path), len(self.sums) - 1)


def _geometric(n: int, alpha: float) -> float:
    """The prior's E[accepted | n]: each token accepted with probability `alpha`, if all before it were (the sum of
    alpha ** i for i = 1..n, in closed form: a policy prices every size a step)."""
    return n if alpha == 1 else alpha * (1 - alpha ** n) / (1 - alpha)

"""`clasp`: CLaSp (in-context layer skip), the target drafts with a skip set re-chosen from context.

After a verify forward, the hidden states of the last accepted token after every sub-layer are exact
full-model states, computed anyway. CLaSp's dynamic program (`specgui.methods.layerskip.skipdp`) picks the M units to
skip whose skipped model stays closest, by cosine, to those states; the next drafts use that set.
Adjacent tokens want similar skip sets ("sparse persistence"), so the DP runs only every LOI verify
steps. The first DP uses the prompt's last token, from the prefill. Drafts stop at a token whose top-1
probability is below DET.

The DP costs about a forward of M tokens, so it runs only where its set will draft: a due search waits for
the next step the cost policy drafts in (on the states the last verify recorded, over the same cache: the
same search the paper runs right after that verify). A probe after a pause reuses the standing set, stale
or not; only the very first draft must search. The policy prices searches amortised over LOI steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from specgui.core.draft import Outcome
from specgui.costs import time_ms
from specgui.methods.base import DecodeState, register
from specgui.methods.layerskip.drafting import ExitThreshold, LayerSkipDrafter, LayerSkipParams
from specgui.methods.layerskip.skipdp import GRANULARITIES, HiddenRecorder, make_units, plan_for, prepare, search
from specgui.methods.params import param
from specgui.methods.policy import Sizing


@dataclass(frozen=True)
class ClaspParams(LayerSkipParams):
    granularity: str = param(choices=GRANULARITIES, help="DP units: whole layers (the paper) or attention and MLP "
                                                          "halves separately")
    skip_fraction: float = param(low=0.0, high=0.9, help="share of the DP units skipped: M = round(fraction x "
                                                          "units), at least 1")
    det: float = param(low=0.0, high=1.0, help="draft-exit threshold (DET) on the draft's top-1 probability")
    loi: int = param(low=1, high=1024, help="layer-optimisation interval: verify steps between DP runs")


@register
class Clasp(LayerSkipDrafter):
    name = "clasp"
    title = "CLaSp"
    summary = "Skips the layers a dynamic program picks from the last verified token's hidden states."
    Params = ClaspParams

    def setup(self, state: DecodeState) -> None:
        super().setup(state)
        self.units = make_units(self.runner.num_layers, self.params.granularity)
        self.budget = max(1, min(len(self.units) - 1, round(self.params.skip_fraction * len(self.units))))
        key = f"clasp.search.{self.params.granularity}.{self.budget}"
        self.dp_ms = state.profile.mechanism(key, lambda: self._search_ms(state)) if state.profile else 0.0
        prepare(self.runner, state.cache, self.units, self.budget)  # the fast path's search program, made untimed

    def begin(self, state: DecodeState) -> HiddenRecorder:
        super().begin(state)
        self.recorder = HiddenRecorder()  # the prefill's states feed the first DP
        self.searched = False  # no skip set yet: the first draft searches
        self.since_dp = 0  # verify steps since the last DP
        self.anchor = (-1, state.prompt_len - 1)  # (block row, position) of the recorded last accepted token
        return self.recorder

    def make_exit(self) -> ExitThreshold:
        return ExitThreshold(self.params.det)

    def token_ms(self, state: DecodeState) -> float:
        if self.searched or state.profile is None:
            return super().token_ms(state)
        # before the first search: a typical set of the same size, spread evenly over the stack
        spread = [i * len(self.units) // self.budget for i in range(self.budget)]
        return state.profile.skip_forward_ms(plan_for(self.units, spread), state.committed)

    def overhead_ms(self) -> float:
        return self.dp_ms / self.params.loi

    def prepare(self, state: DecodeState, plan: Sizing) -> tuple[float, dict[str, Any]]:
        due = not self.searched or (self.since_dp >= self.params.loi and plan.mode != "probe")
        if not due:
            return 0.0, {"reoptimized": False}
        predicted = self.dp_ms
        row, position = self.anchor
        start = time.perf_counter()
        found = search(self.runner, state.cache, position, self.recorder.row(row), self.units, self.budget)
        self.dp_ms = (time.perf_counter() - start) * 1000
        self.plan = plan_for(self.units, found.skipped)
        state.adopt(self.plan)
        self.searched, self.since_dp = True, 0
        return predicted, {"reoptimized": True, "dp_score": found.score, "dp_ms": self.dp_ms}

    def _records(self) -> bool:
        """Whether this step's verify records hidden states: where the next step may search and this one drafts (a
        paused step, `since_dp` growing all the while, would record every step of the pause). Recording keeps the
        verify forward off the one-call layers (`Pass.run_layers`), whose observer-free forwards are faster on a CPU;
        on the fast path it is the forward's
        recording variant, still one program. When drafting resumes after a pause, the first search reads the states
        last recorded (an older token's): a poorer skip set for one interval, never a wrong token."""
        if self.sizing_plan is not None and self.sizing_plan.size == 0:
            return False
        return not self.searched or self.since_dp + 1 >= self.params.loi

    def observer(self) -> HiddenRecorder | None:
        return self.recorder if self._records() else None  # the states are references, kept until a search

    def ready_ahead(self) -> bool:
        """The next step neither searches (due after `loi` steps) nor records the states a search reads (the step
        before it): after this step's verdict, `since_dp` is one more."""
        return self.searched and self.since_dp + 2 < self.params.loi

    def learn(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        if outcome.prefill:
            return {}
        if self._records():
            # the last accepted token: the verify block's row of the path's end (the pending token's if empty)
            self.anchor = (outcome.last_row, state.committed - len(outcome.emitted) + len(outcome.path))
        self.since_dp += 1
        return {}

    def _search_ms(self, state: DecodeState) -> float:
        """One DP's ms on this model and device (the profile's `clasp.search...` mechanism), timed on a
        32-token context built from the prompt's tokens: the DP's cost depends on the model, not the text.
        It runs on the path the run takes, over the run's own cache (empty in `setup`, emptied again)."""
        tokens = torch.tensor((state.tokens * 32)[:32])
        recorder = HiddenRecorder()
        self.runner.forward(tokens, torch.arange(32), state.cache, observer=recorder, logits_rows=slice(31, 32))
        hidden = recorder.row(31)
        ms = time_ms(lambda: search(self.runner, state.cache, 31, hidden, self.units, self.budget),
                     self.runner.device, repeats=3)
        state.cache.crop(0)
        return ms

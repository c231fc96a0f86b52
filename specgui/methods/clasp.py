"""`clasp`: CLaSp (in-context layer skip), the target drafts with a skip set re-chosen from context.

After a verify forward, the hidden states of the last accepted token after every sub-layer are exact
full-model states, computed anyway. CLaSp's dynamic program (`specgui.methods.skipdp`) picks the M units to
skip whose skipped model stays closest, by cosine, to those states; the next drafts use that set.
Adjacent tokens want similar skip sets ("sparse persistence"), so the DP runs only every LOI verify
steps, and only when drafting goes on (the back-off may have paused it). The first DP runs on the
prompt's last token, from the prefill. Drafts stop at a token whose top-1 probability is below DET.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specgui.draft import Outcome
from specgui.methods.base import DecodeState, register
from specgui.methods.layerskip import ExitThreshold, LayerSkipDrafter, LayerSkipParams
from specgui.methods.skipdp import GRANULARITIES, HiddenRecorder, make_units, plan_for, search
from specgui.params import param


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

    def begin(self, state: DecodeState) -> HiddenRecorder:
        super().begin(state)
        self.units = make_units(self.runner.num_layers, self.params.granularity)
        self.budget = max(1, min(len(self.units) - 1, round(self.params.skip_fraction * len(self.units))))
        self.recorder = HiddenRecorder()
        self.recording = True  # the prefill's states feed the first DP
        self.since_dp = 0
        self.dp_ms = 0.0
        return self.recorder

    def make_exit(self) -> ExitThreshold:
        return ExitThreshold(self.params.det)

    def overhead_ms(self) -> float:
        return self.dp_ms / self.params.loi

    def observer(self, drafting: bool) -> HiddenRecorder | None:
        # record only where a DP may follow: a drafted step once the interval is up
        self.recording = drafting and self.since_dp + 1 >= self.params.loi
        return self.recorder if self.recording else None

    def learn(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        self.since_dp += 1
        if not self.recording or state.max_depth == 0:
            return {"reoptimized": False}
        # the last accepted token: the prompt's last row after the prefill, else the verify block's row
        row = -1 if outcome.prefill else outcome.last_row
        position = state.committed - len(outcome.emitted) + len(outcome.path)
        start = time.perf_counter()
        found = search(self.runner, state.cache, position, self.recorder.row(row), self.units, self.budget)
        self.dp_ms = (time.perf_counter() - start) * 1000
        self.plan = plan_for(self.units, found.skipped)
        self.since_dp = 0
        self.recorder.states.clear()
        payload = {"reoptimized": True, "dp_score": found.score, "dp_ms": self.dp_ms}
        return {**payload, "skip": self.plan.to_dict()} if outcome.prefill else payload

"""`admg`: Adaptive Self-Speculative Decoding (ASD) with its Adaptive Draft Model Generator (ADMG).

The skip set is chosen once per prompt, from the prompt forward itself: the average cosine
similarity (ACS) between the hidden states before and after each attention sub-layer, over the
prompt's positions, says how little that attention changes the residual stream. ADMG (Algorithm 1)
removes every attention with ACS >= alpha (CS thresholding), every m-th layer whole (rule 1), but
nothing in the last n layers (rule 2). Drafts stop by Draft & Verify's adaptive draft-exit
threshold, which follows recent acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specgui.core.draft import Outcome
from specgui.core.runner import ATTN, SkipPlan, unit_at
from specgui.methods.base import DecodeState, register
from specgui.methods.layerskip.drafting import AdaptiveExitParams, ExitThreshold, LayerSkipDrafter, adaptive_exit
from specgui.methods.params import param
from specgui.methods.policy import Sizing


@dataclass(frozen=True)
class AdmgParams(AdaptiveExitParams):
    alpha: float = param(low=0.0, high=1.0, help="remove attention sub-layers whose prompt ACS is >= alpha")
    every: int = param(low=0, high=1024, help="rule 1: remove every m-th layer (attention and MLP); 0 = off")
    keep_last: int = param(low=0, high=1024, help="rule 2: never remove anything in the last n layers")


class AcsMeter:
    """Prefill observer: the cosine similarity between each attention sub-layer's input and output, summed over the
    prompt's rows into one device tensor, so that the prompt forward's verdict read brings every layer's sum along
    (`DecodeState.ride`); `acs` divides on the host. On the fast path it takes the recording program's states whole
    (`stack`): three device operations a forward, where a layer at a time cost three a layer."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.sums = torch.zeros(num_layers, device=device)
        self.rows = 0  # prompt rows summed over
        self.before: torch.Tensor | None = None

    def __call__(self, k: int, h: torch.Tensor) -> None:
        """One state at a time (the eager path): the state after a layer's attention, `before` being its input."""
        if k > 0 and unit_at(k)[1] == ATTN:
            layer = unit_at(k)[0]
            self.sums[layer] += _cos(self.before, h).sum().to(self.sums.device)
            self.rows += h.shape[1] if layer == 0 else 0
        self.before = h

    def stack(self, states: torch.Tensor) -> None:
        """Every state of one forward [2 L + 1, 1, T, H] (the embedding's, then each sub-layer's; `runner.Observer`):
        before each attention the even ones, after it the odd ones."""
        self.sums += _cos(states[0:-1:2], states[1::2]).sum((1, 2)).to(self.sums.device)
        self.rows += states.shape[2]

    def acs(self, sums: list[float]) -> list[float]:
        """Each attention's mean similarity over the prompt, from the read `sums`."""
        return [value / self.rows for value in sums]


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def admg_plan(acs: list[float], alpha: float, every: int, keep_last: int) -> SkipPlan:
    """ADMG (Algorithm 1) with 0-based layers: paper layer l is index l - 1.

    Two guards the paper's large models never needed: rule 2 leaves at least the first layer
    removable, and when the rules remove nothing (no attention reaches alpha, as on small models)
    the attention with the highest ACS goes, since a draft model equal to the target drafts nothing
    useful.
    """
    removable = range(max(1, len(acs) - keep_last))
    whole = {i for i in removable if every and (i + 1) % every == 0}
    attn = {i for i in removable if acs[i] >= alpha} | whole
    if not attn:
        attn = {max(removable, key=lambda i: acs[i])}
    return SkipPlan(attn=frozenset(attn), mlp=frozenset(whole))


@register
class Admg(LayerSkipDrafter):
    name = "admg"
    title = "ASD / ADMG"
    summary = "Skips attention layers that barely change the prompt's hidden states, plus every m-th layer."
    Params = AdmgParams

    def begin(self, state: DecodeState) -> AcsMeter:
        super().begin(state)
        self.meter = AcsMeter(self.runner.num_layers, self.runner.device)
        self.acs = state.ride(self.meter.sums)
        return self.meter

    def make_exit(self) -> ExitThreshold:
        return adaptive_exit(self.params)

    def prepare(self, state: DecodeState, plan: Sizing) -> tuple[float, dict[str, Any]]:
        """The prompt's skip set is made ready (on the fast path its draft program made: a capture on a GPU) when a
        step first drafts with it, not at the prompt: the set is new with every prompt, and adopted there, each run
        paid a capture in its timed prefill even where the policy then paused it all run long. A paused step then
        costs what a plain one does."""
        if not self.adopted:
            state.adopt(self.plan)
            self.adopted = True
        return 0.0, {}

    def ready_ahead(self) -> bool:
        """The prompt's skip set was adopted (its programs made) by a step before."""
        return self.adopted

    def learn(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        if not outcome.prefill:
            return {}
        p, acs = self.params, self.meter.acs(self.acs.values)
        self.plan = admg_plan(acs, p.alpha, p.every, p.keep_last)
        self.adopted = False
        return {"acs": acs, "skip": self.plan.to_dict()}

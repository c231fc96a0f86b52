"""CLaSp's layer-skip search: an approximate dynamic program over the target's own hidden states.

Given the full model's hidden state after every sub-layer at one position (the last verified token,
recorded during the verify forward), find the M units to skip whose skipped model ends closest, by
cosine, to the full model's final state (CLaSp, Algorithm 1):

    g(i, 0) = x_i                                   nothing skipped: the full model's own state
    g(i, j) = the better, by cosine to x_i, of      g(i-1, j-1)        (skip unit i-1)
                                                    f_{i-1}(g(i-1, j)) (run unit i-1 on the state)

A unit is a whole layer (the paper) or one sub-layer (attention or MLP half), so the DP can skip one
half of a layer where whole layers cost too much accuracy. The states g(i-1, 1..M) of one row are
independent, so they go through unit i-1 as one batch of rows at the same position, each attending to
the cached prefix and to itself only (a read-only `view` + identity visibility): the paper's "sequence
parallel" trick. A whole DP then costs about one forward of M tokens, and the cache is never grown.
Keeping a state near x_i at every i is what makes the greedy choice per cell a good approximation
("approximate Markov property"); `tests/test_clasp.py` checks it against brute force.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgui.kvcache import KVCache
from specgui.runner import ATTN, MLP, Pass, Runner, SkipPlan, unit_index

Unit = tuple[tuple[int, int], ...]  # the (layer, kind) sub-layers one DP decision covers, in order
GRANULARITIES = ("layer", "sublayer")


def make_units(num_layers: int, granularity: str) -> list[Unit]:
    """DP units in forward order: whole layers, or attention and MLP halves separately."""
    if granularity == "layer":
        return [((layer, ATTN), (layer, MLP)) for layer in range(num_layers)]
    if granularity == "sublayer":
        return [((layer, kind),) for layer in range(num_layers) for kind in (ATTN, MLP)]
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def plan_for(units: list[Unit], skipped: list[int]) -> SkipPlan:
    """The SkipPlan that leaves out the given units."""
    parts = [part for u in skipped for part in units[u]]
    return SkipPlan(attn=frozenset(layer for layer, kind in parts if kind == ATTN),
                    mlp=frozenset(layer for layer, kind in parts if kind == MLP))


def unit_end(unit: Unit) -> int:
    """Observer index of the hidden state after a unit."""
    return unit_index(*unit[-1])


@dataclass(frozen=True)
class SkipSearch:
    skipped: list[int]  # unit indices, ascending
    score: float  # cosine of the skipped model's final state to the full model's


def search(runner: Runner, cache: KVCache, position: int, hidden: torch.Tensor, units: list[Unit], budget: int,
           allowed: set[int] | None = None) -> SkipSearch:
    """Choose `budget` units (from `allowed`, default all) to skip at `position`.

    `hidden` [2 * layers + 1, H] holds the full model's states at `position` (observer order: the
    embedding, then after each sub-layer); `cache` must hold the full model's keys for [0, position).
    """
    allowed = set(range(len(units))) if allowed is None else set(allowed)
    budget = min(budget, len(allowed))
    rows = _RowPasses(runner, cache, position)
    # ahead[i]: skippable units from unit i on. Only states that can still end at `budget` are kept.
    ahead = [0] * (len(units) + 1)
    for i in reversed(range(len(units))):
        ahead[i] = ahead[i + 1] + (i in allowed)
    states, first = hidden[:1], 0  # row i of g as a tensor: states[r] skipped first + r units
    skip_choice: list[dict[int, bool]] = []
    for i, unit in enumerate(units):
        target = hidden[unit_end(unit)]
        wanted = range(max(0, budget - ahead[i + 1]), min(budget, len(allowed) - ahead[i + 1]) + 1)
        have = range(first, first + len(states))
        run_from = [j for j in wanted if j > 0 and j in have]
        skip_from = [j for j in wanted if j > 0 and j - 1 in have] if i in allowed else []
        ran = rows.run(states[[j - first for j in run_from]], unit) if run_from else states[:0]
        # one pool of candidate rows: the full model's own state, the run states, the previous row
        pool = torch.cat([target[None], ran, states])
        run_cos = dict(zip(run_from, _cos(ran, target).tolist()))
        skip_cos = dict(zip(skip_from, _cos(states[[j - 1 - first for j in skip_from]], target).tolist()))
        picks, choice = [], {}
        for j in wanted:
            if j == 0:
                picks.append(0)  # nothing skipped: exactly the full model's state
                choice[0] = False
                continue
            choice[j] = j not in run_cos or (j in skip_cos and skip_cos[j] > run_cos[j])
            picks.append(1 + len(ran) + j - 1 - first if choice[j] else 1 + run_from.index(j))
        states, first = pool[picks], wanted.start
        skip_choice.append(choice)
    skipped, j = [], budget
    for i in reversed(range(len(units))):
        if j > 0 and skip_choice[i][j]:
            skipped.append(i)
            j -= 1
    return SkipSearch(sorted(skipped), float(_cos(states[budget - first], hidden[-1])))


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


class _RowPasses:
    """Runs a batch of DP states through one unit: rows at one position, each seeing the prefix and itself."""

    def __init__(self, runner: Runner, cache: KVCache, position: int) -> None:
        self.runner = runner
        self.view = cache.view(position)
        self.position = position
        self.passes: dict[int, Pass] = {}  # one per row count, so rotary tables and masks are built once

    def run(self, batch: torch.Tensor, unit: Unit) -> torch.Tensor:
        n = batch.shape[0]
        if n not in self.passes:
            positions = torch.full((n,), self.position, dtype=torch.long)
            self.passes[n] = self.runner.new_pass(positions, self.view, torch.eye(n, dtype=torch.bool))
        h = batch.unsqueeze(0)
        for layer, kind in unit:
            h = self.passes[n].run_unit(h, layer, kind)
        # kept across later units' passes: lasting (on the fast path `h` is a program's reused output buffer);
        # layers may sit on other devices (device_map), the DP stays on one
        return self.passes[n].lasting(h)[0].to(batch.device)


class HiddenRecorder:
    """Observer that keeps the hidden states [1, T, H] after every sub-layer of one forward."""

    def __init__(self) -> None:
        self.states: dict[int, torch.Tensor] = {}

    def __call__(self, k: int, h: torch.Tensor) -> None:
        self.states[k] = h

    def row(self, r: int) -> torch.Tensor:
        """[2 * layers + 1, H]: the states of block row `r`, in observer order, on the embedding's device."""
        device = self.states[0].device
        return torch.stack([self.states[k][0, r].to(device) for k in sorted(self.states)])

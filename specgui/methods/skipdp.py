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

import numpy as np
import torch

from specgui.kvcache import KVCache, to_device
from specgui.runner import ATTN, MLP, Runner, SkipPlan, unit_index

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
    Which cells keep which state is decided on the device (the shapes are known in advance): the choices are
    read once, at the end, to trace the chosen set back (on a GPU a read per unit stalled the host 2 x units times).
    """
    allowed = set(range(len(units))) if allowed is None else set(allowed)
    budget = min(budget, len(allowed))
    rows = _RowPasses(runner, cache, position)
    # ahead[i]: skippable units from unit i on. Only states that can still end at `budget` are kept.
    ahead = [0] * (len(units) + 1)
    for i in reversed(range(len(units))):
        ahead[i] = ahead[i + 1] + (i in allowed)
    states, first = hidden[:1], 0  # row i of g as a tensor: states[r] skipped first + r units
    skip_choice: list[dict[int, torch.Tensor | bool]] = []  # per unit, per cell: whether it skips (maybe on device)
    for i, unit in enumerate(units):
        target = hidden[unit_end(unit)]
        wanted = range(max(0, budget - ahead[i + 1]), min(budget, len(allowed) - ahead[i + 1]) + 1)
        have = range(first, first + len(states))
        run_from = [j for j in wanted if j > 0 and j in have]
        skip_from = [j for j in wanted if j > 0 and j - 1 in have] if i in allowed else []
        ran = rows.run(_rows(states, [j - first for j in run_from]), unit) if run_from else states[:0]
        # one pool of candidate rows: the full model's own state, the run states, the previous row
        pool = torch.cat([target[None], ran, states])
        both = [j for j in run_from if j in skip_from]  # cells with a choice, made by cosine on the device
        skips = (_cos(_rows(pool, [1 + len(ran) + j - 1 - first for j in both]), target)
                 > _cos(_rows(pool, [1 + run_from.index(j) for j in both]), target)) if both else None
        picks, choice = [], {}  # per cell, the pool row it keeps (the run state where it has a choice)
        for j in wanted:
            if j == 0:
                picks.append(0)  # nothing skipped: exactly the full model's state
                choice[0] = False
                continue
            choice[j] = skips[both.index(j)] if j in both else j not in run_from
            picks.append(1 + len(ran) + j - 1 - first if choice[j] is True else 1 + run_from.index(j))
        keep = to_device(torch.tensor(picks, dtype=torch.long), pool.device)
        if both:
            cells = to_device(torch.tensor([wanted.index(j) for j in both], dtype=torch.long), pool.device)
            skipped_at = to_device(torch.tensor([1 + len(ran) + j - 1 - first for j in both]), pool.device)
            keep = keep.index_put((cells,), torch.where(skips, skipped_at, keep[cells]))
        states, first = pool.index_select(0, keep), wanted.start
        skip_choice.append(choice)
    cells = [(i, j) for i, choice in enumerate(skip_choice) for j, c in choice.items() if isinstance(c, torch.Tensor)]
    score = _cos(states[budget - first], hidden[-1]).view(1)
    read = torch.cat([score, *(skip_choice[i][j].float().view(1) for i, j in cells)]).tolist()  # the one read
    for (i, j), value in zip(cells, read[1:]):
        skip_choice[i][j] = value > 0
    skipped, j = [], budget
    for i in reversed(range(len(units))):
        if j > 0 and skip_choice[i][j]:
            skipped.append(i)
            j -= 1
    return SkipSearch(sorted(skipped), read[0])


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t`'s rows in that order, the index uploaded without stalling the host (a Python list as an index would)."""
    return t.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), t.device))


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


class _RowPasses:
    """Runs a batch of DP states through one unit: rows at one position, each seeing the prefix and itself."""

    def __init__(self, runner: Runner, cache: KVCache, position: int) -> None:
        self.runner = runner
        self.view = cache.view(position)
        self.position = position

    def run(self, batch: torch.Tensor, unit: Unit) -> torch.Tensor:
        """One pass of the unit's sub-layers over the batch (on the fast path, one program)."""
        n = batch.shape[0]
        positions = np.full(n, self.position, dtype=np.int64)  # host values in numpy: the pass uploads them as they are
        step = self.runner.new_pass(positions, self.view, np.eye(n, dtype=bool))
        layer = unit[0][0]
        kinds = {kind for _, kind in unit}
        skip = SkipPlan(attn=frozenset() if ATTN in kinds else frozenset({layer}),
                        mlp=frozenset() if MLP in kinds else frozenset({layer}))
        h = step.run_segment(batch.unsqueeze(0), range(layer, layer + 1), skip)
        # kept across later units' passes: lasting (on the fast path `h` is a program's reused output buffer);
        # layers may sit on other devices (device_map), the DP stays on one
        return step.lasting(h)[0].to(batch.device)


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

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

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specgui import fastpath
from specgui.core.kvcache import KVCache, to_device
from specgui.core.runner import ATTN, MLP, Runner, SkipPlan, unit_index

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


@dataclass(frozen=True)
class Schedule:
    """Which DP cells exist, unit by unit, and where each one's state can come from: fixed by the units, the budget
    and the allowed set alone, so that the search runs in fixed shapes (on the fast path, one program). Only cells
    that can still end at `budget` exist. Per unit i, over the cells j of the next row (0..budget):

      runs[i]       the cells whose state g(i, j) runs through unit i (it exists, and so may g(i + 1, j))
      skip_only[i]  cells taken from g(i, j - 1) without a choice, and cell 0 (the full model's own state, placed
                    where a skip would put it)
      both[i]       cells that choose between the two by cosine to the full model's state
    """

    budget: int
    runs: tuple[tuple[int, ...], ...]
    skip_only: tuple[tuple[int, ...], ...]
    both: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, units: int, budget: int, allowed: set[int]) -> Schedule:
        ahead = [0] * (units + 1)  # skippable units from unit i on
        for i in reversed(range(units)):
            ahead[i] = ahead[i + 1] + (i in allowed)
        have, runs, skip_only, both = {0}, [], [], []
        for i in range(units):
            wanted = range(max(0, budget - ahead[i + 1]), min(budget, len(allowed) - ahead[i + 1]) + 1)
            run = [j for j in wanted if j > 0 and j in have]
            skip = [j for j in wanted if j > 0 and j - 1 in have] if i in allowed else []
            runs.append(tuple(run))
            both.append(tuple(j for j in run if j in skip))
            skip_only.append(tuple(j for j in wanted if j == 0 or j not in run))
            have = set(wanted)
        return cls(budget, tuple(runs), tuple(skip_only), tuple(both))

    @property
    def rows(self) -> int:
        """The most states one unit runs."""
        return max((len(run) for run in self.runs), default=0)

    def masks(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(skip_only, both) as bool [units, budget + 1] on `device`."""
        out = torch.zeros(2, len(self.runs), self.budget + 1, dtype=torch.bool)
        for which, cells in enumerate((self.skip_only, self.both)):
            for i, js in enumerate(cells):
                out[which, i, list(js)] = True
        return out[0].to(device), out[1].to(device)

    def trace(self, choices: list[float]) -> list[int]:
        """The skipped units, from the read choices [units * (budget + 1)]: back from the last unit's cell `budget`."""
        skipped, j, width = [], self.budget, self.budget + 1
        for i in reversed(range(len(self.runs))):
            if j > 0 and choices[i * width + j] > 0:
                skipped.append(i)
                j -= 1
        return sorted(skipped)


# run(states [budget + 1, H], i) -> the states with unit i's running cells (`Schedule.runs`) run through it
RunCells = Callable[[torch.Tensor, int], torch.Tensor]


def dp(hidden: torch.Tensor, units: list[Unit], schedule: Schedule, masks: tuple[torch.Tensor, torch.Tensor],
       run: RunCells) -> torch.Tensor:
    """Algorithm 1 over every cell at once, in fixed shapes: row j of `states` holds g(i, j) (a cell that does not
    exist holds some finite state nobody reads). Per unit the skip candidates are the states shifted a row (row 0:
    the full model's own state), the run candidates the states run through the unit (`run`), and a cell keeps the
    one its schedule says, or the one closer by cosine to the full model's.
    Out: float32 [1 + units * (budget + 1)], the final cell's cosine to the full model's last state, then whether
    each cell skipped (read once; `Schedule.trace`)."""
    skip_only, both = masks
    states = hidden[:1].expand(schedule.budget + 1, -1)
    choices = []
    for i, unit in enumerate(units):
        x = hidden[unit_end(unit)]
        skipped = torch.cat([x[None], states[:-1]])
        ran = run(states, i) if schedule.runs[i] else states
        skips = skip_only[i] | (both[i] & (_cos(skipped, x) > _cos(ran, x)))
        states = torch.where(skips[:, None], skipped, ran)
        choices.append(skips)
    score = _cos(states[schedule.budget], hidden[-1]).view(1)
    return torch.cat([score, torch.stack(choices).flatten().float()])


def search(runner: Runner, cache: KVCache, position: int, hidden: torch.Tensor, units: list[Unit], budget: int,
           allowed: set[int] | None = None) -> SkipSearch:
    """Choose `budget` units (from `allowed`, default all) to skip at `position`.

    `hidden` [2 * layers + 1, H] holds the full model's states at `position` (observer order: the
    embedding, then after each sub-layer); `cache` must hold the full model's keys for [0, position).
    The DP runs in fixed shapes (`dp`): on the fast path as one program over a bucket of rows at `position` (every
    unit's rows gathered into it), elsewhere a pass per unit over its rows; either way its choices are read once, at
    the end, to trace the chosen set back (on a GPU a read per unit stalled the host 2 x units times, and a device
    operation per cell each launched alone).
    """
    allowed = set(range(len(units))) if allowed is None else set(allowed)
    schedule = Schedule.of(len(units), min(budget, len(allowed)), allowed)
    rows = _program_rows(cache, schedule)
    if rows is not None:
        step = runner.new_pass(np.full(rows, position, dtype=np.int64), cache.view(position), np.eye(rows, dtype=bool))
        make = functools.partial(_in_program, runner.device, units, schedule, rows)
        read = step.rows_program(_key(units, schedule), make, hidden).tolist()
    else:
        device = hidden.device
        cells = [to_device(torch.tensor(run, dtype=torch.long), device) for run in schedule.runs]
        passes = _RowPasses(runner, cache, position)

        def run(states: torch.Tensor, i: int) -> torch.Tensor:
            return states.index_copy(0, cells[i], passes.run(states.index_select(0, cells[i]), units[i]))

        read = dp(hidden, units, schedule, schedule.masks(device), run).tolist()
    return SkipSearch(schedule.trace(read[1:]), read[0])


def prepare(runner: Runner, cache: KVCache, units: list[Unit], budget: int) -> None:
    """Make the search's program now, outside any timed step, where `cache` is the fast path's and it is not made yet:
    a search of position 0 over zero states (its rows see only themselves)."""
    schedule = Schedule.of(len(units), min(budget, len(units)), set(range(len(units))))
    rows = _program_rows(cache, schedule)
    if rows is not None and not fastpath.rows_made(cache, _key(units, schedule), rows):
        hidden = torch.zeros(2 * runner.num_layers + 1, runner.config.hidden_size, dtype=runner.dtype,
                             device=runner.device)
        search(runner, cache, 0, hidden, units, budget)


def _program_rows(cache: KVCache, schedule: Schedule) -> int | None:
    """The bucket of rows the search runs over as one program, where `cache` is the fast path's; None: a pass a unit."""
    return fastpath.bucket(schedule.rows) if isinstance(cache, fastpath.StaticKVCache) else None


def _key(units: list[Unit], schedule: Schedule) -> tuple:
    return ("clasp.search", tuple(units), schedule)


def _in_program(device: torch.device, units: list[Unit], schedule: Schedule, rows: int
                ) -> Callable[[torch.Tensor, fastpath.RunRows], torch.Tensor]:
    """`dp` as a program's function over a bucket of `rows`: each unit's cells gathered into the bucket (padded with
    copies of its first), run there, and put back. Its index tensors are made here, before any capture."""
    masks = schedule.masks(device)
    cells = [torch.tensor(run, dtype=torch.long, device=device) for run in schedule.runs]
    gathers = [torch.tensor([*run, *run[:1] * (rows - len(run))] if run else [0] * rows, dtype=torch.long,
                            device=device) for run in schedule.runs]

    def fn(hidden: torch.Tensor, run_rows: fastpath.RunRows) -> torch.Tensor:
        def run(states: torch.Tensor, i: int) -> torch.Tensor:
            layer, kinds = units[i][0][0], tuple(kind for _, kind in units[i])
            out = run_rows(states.index_select(0, gathers[i]), layer, kinds)
            return states.index_copy(0, cells[i], out[: len(schedule.runs[i])])

        return dp(hidden, units, schedule, masks, run)

    return fn


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
    """Observer that keeps the hidden states after every sub-layer of one forward: one state at a time, or, on the
    fast path, the recording program's whole stack in one copy (`runner.Observer`)."""

    def __init__(self) -> None:
        self.states: dict[int, torch.Tensor] = {}
        self.recorded: torch.Tensor | None = None  # [2 * layers + 1, 1, T, H], from `stack`

    def __call__(self, k: int, h: torch.Tensor) -> None:
        self.states[k] = h
        self.recorded = None

    def stack(self, states: torch.Tensor) -> None:
        self.recorded, self.states = states.clone(), {}  # a program's output: the next run reuses it

    def row(self, r: int) -> torch.Tensor:
        """[2 * layers + 1, H]: the states of block row `r`, in observer order, on the embedding's device."""
        if self.recorded is not None:
            return self.recorded[:, 0, r]
        device = self.states[0].device
        return torch.stack([self.states[k][0, r].to(device) for k in sorted(self.states)])

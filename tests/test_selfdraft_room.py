"""Self-Draft's branch room, computed once per size a step, equals the scan it replaces; and a step's verify prices
are priced once a context and calibration (`DecodeState.verify_ms`), which the rooms' scans read.

The policy prices every candidate size, and each size's room is a scan down from all branch tokens: `_room` caches
the rooms for the step. Here it is held to the uncached definition on prices that are not monotone in rows (a
calibrated profile's need not be).
"""

import random
from collections import Counter

import pytest

from helpers import flat_profile, tiny_model
from specgui import costs, methods
from specgui.core.sampling import GREEDY
from specgui.methods.base import DecodeState
from specgui.methods.ngram.selfdraft import FREE


class Prices:
    """A stand-in `DecodeState`: noisy verify prices by rows, counting the lookups."""

    def __init__(self, seed: int, slope: float) -> None:
        rng = random.Random(seed)
        self.table = {rows: 1.5 + slope * rows + rng.uniform(0, 0.06) for rows in range(1, 200)}
        self.asked: Counter[int] = Counter()

    def verify_ms(self, rows: int) -> float:
        self.asked[rows] += 1
        return self.table[rows]


def scanned_room(prices: Prices, total: int, nodes: int, policy: str, max_forward: int) -> int:
    """The definition: the most branch tokens within `FREE` of the forward without them, scanning down; capped."""
    room = total
    if policy != "fixed":
        base = prices.table[1 + nodes]
        while room > 0 and prices.table[1 + nodes + room] > base * (1 + FREE):
            room -= 1
    if max_forward:
        room = min(room, max(0, max_forward - 1 - nodes))
    return room


@pytest.mark.parametrize("policy", ["cost", "fixed"])
@pytest.mark.parametrize("max_forward", [0, 13, 40])
@pytest.mark.parametrize("slope", [0.0, 0.002, 0.02])
def test_room_is_the_scan_pricing_each_forward_once(policy, max_forward, slope):
    lm = tiny_model()
    drafter = methods.create("selfdraft", lm.runner, lm.name, GREEDY,
                             {"branches": 6, "branch_len": 6, "policy": policy, "max_forward": max_forward})
    drafter.branches = [[1] * 6, [2] * 6, [3] * 5, [4] * 6, [5] * 6, [6] * 6]
    for seed in range(5):
        prices = Prices(seed, slope)
        room = drafter._room(prices)
        sizes = list(range(1, 25))
        assert [room(n) for n in sizes + sizes] == [scanned_room(prices, 35, n, policy, max_forward)
                                                     for n in sizes + sizes]
        assert policy == "cost" or not prices.asked  # the fixed policy rides every branch unpriced


def test_a_step_prices_each_verify_once_until_its_context_or_calibration_moves(monkeypatch):
    lm = tiny_model()
    profile = flat_profile(lm, fast_path=False)
    profile.measured_at = 1.0  # calibrated: what steps learn moves the prices
    asked: Counter[tuple[int, int]] = Counter()
    price = costs.CostProfile.verify_ms

    def counted(self, rows, context):
        asked[rows, context] += 1
        return price(self, rows, context)

    monkeypatch.setattr(costs.CostProfile, "verify_ms", counted)
    state = DecodeState(lm.runner, None, [1, 2, 3], 2, GREEDY, None, 16, profile)
    first = [state.verify_ms(rows) for rows in (1, 4, 9, 4, 1, 9)]
    assert first[3:] == [first[1], first[0], first[2]]
    assert asked == Counter({(1, 2): 1, (4, 2): 1, (9, 2): 1})  # each once, at the context of 2 cached tokens
    state.tokens.append(4)  # a new context: priced again
    state.verify_ms(4)
    assert asked[4, 3] == 1
    profile.learn("selfdraft", 4, 30.0, 0.0, profile.verify_ms(4, 3))  # a verify of 4 rows measured dearer
    assert state.verify_ms(4) > first[1] and asked[4, 3] == 3  # (one ask by the learn's own pricing above)

"""The edits the server streams between two values of an output, applied as gradio_client applies them, give the
second value exactly: Self-Draft's nested candidate lists, hand-built, and random nested JSON."""

import random

import gradio.utils
import pytest
from gradio_client.utils import apply_diff

from specgui.ui import diffs

# Self-Draft's payload from one step to the next: two candidates whose keys shrink by two, then one left
SELFDRAFT = ({"candidates": [{"nodes": [1, 2, 3], "key": [5, 6, 7]}, {"nodes": [4], "key": [8, 9, 10]}]},
             {"candidates": [{"nodes": [1], "key": [5]}, {"nodes": [4], "key": [8]}]})
SHRINKING = [
    SELFDRAFT,
    ({"candidates": [{"key": [1, 2]}, {"key": [3, 4]}]}, {"candidates": [{"key": [9]}]}),
    ([[1, 2, 3], [4, 5, 6], [7]], [[1], [4], []]),
    ([[[1, 2, 3]], [[4, 5]]], [[[1]], [[]]]),
    ({"window": [[1, 2, 3, 4], [5, 6, 7, 8]]}, {"window": [[1, 2], [5]], "hit": None}),
]


@pytest.mark.parametrize("old, new", SHRINKING)
def test_nested_lists_that_shrink_arrive_exactly(old, new):
    assert apply_diff(old, diffs.diff(old, new)) == new


def test_gradio_own_diff_gets_the_self_draft_step_wrong():
    """Why diffs.py exists: if a gradio upgrade fixes its diff, this fails, and diffs.py can go."""
    old, new = SELFDRAFT
    try:
        applied = apply_diff(old, diffs.GRADIO_DIFF(old, new))
    except IndexError:
        return
    assert applied != new


def _value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth >= 4 or kind < 0.35:
        return rng.choice([0, 1, 2.5, "a", "ab", "abc", True, None])
    if kind < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {k: _value(rng, depth + 1) for k in rng.sample("abcde", rng.randrange(4))}


def _mutate(rng: random.Random, value):
    """A value near `value`: lists grow or shrink at the end, items change, keys come and go."""
    if isinstance(value, list):
        items = [_mutate(rng, v) for v in value[: rng.randrange(len(value) + 1)]]
        return items + [_value(rng, 2) for _ in range(rng.randrange(3))]
    if isinstance(value, dict):
        kept = {k: _mutate(rng, v) for k, v in value.items() if rng.random() < 0.8}
        return {**kept, **({rng.choice("fgh"): _value(rng, 2)} if rng.random() < 0.3 else {})}
    if isinstance(value, str) and rng.random() < 0.5:
        return value + "z"
    return value if rng.random() < 0.5 else _value(rng, 3)


def test_random_nested_values_arrive_exactly():
    rng = random.Random(0)
    for _ in range(3000):
        old = _value(rng)
        new = _mutate(rng, old)
        assert apply_diff(old, diffs.diff(old, new)) == new, (old, new)


def test_the_served_app_streams_with_it(tiny_lm):
    from ui_helpers import served

    with served(tiny_lm):
        assert gradio.utils.diff is diffs.diff

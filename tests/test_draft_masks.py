"""The ride-along masks, built vectorized and cached per shape, equal their definitions cell by cell.

Self-Draft's branches and Lookahead's window are the extras of every step at the papers' sizes (N = L = 6; W = 15,
N = 5): their masks are built with numpy from a cached block (host time a step on a GPU). Here each is held to
the loop that states what a row sees.
"""

import numpy as np
import pytest

from helpers import tiny_model
from specgui import methods
from specgui.core.draft import Draft, Extras
from specgui.core.sampling import GREEDY
from specgui.methods.ngram.lookahead import window_visibility
from specgui.methods.ngram.selfdraft import branch_block


def branch_mask(lengths: list[int]) -> tuple[np.ndarray, list[int]]:
    """The definition: branch j's i-th token sees its own branch's tokens 0..i, nothing else; its offset is i."""
    total = sum(lengths)
    visible = np.zeros((total, total), dtype=bool)
    offsets, start = [], 0
    for n in lengths:
        for i in range(n):
            visible[start + i, start : start + i + 1] = True
            offsets.append(i)
        start += n
    return visible, offsets


def window_mask(width: int, levels: int, nodes: int) -> np.ndarray:
    """The definition: row (l, j) sees block 0 columns 0..j (column 0: the pending token) and column j of
    levels 1..l; block 0's columns 1.. are the first extras, after the `nodes` guess nodes."""
    def column(level: int, j: int) -> int:
        if level == 0:
            return 0 if j == 0 else nodes + j
        return nodes + width + (level - 1) * width + j

    extra = (width - 1) + (levels - 1) * width
    visible = np.zeros((extra, 1 + nodes + extra), dtype=bool)
    for level in range(levels):
        for j in range(1 if level == 0 else 0, width):
            row = column(level, j) - 1 - nodes
            for i in range(j + 1):
                visible[row, column(0, i)] = True
            for r in range(1, level + 1):
                visible[row, column(r, j)] = True
    return visible


@pytest.mark.parametrize("lengths", [[1], [3, 2], [6] * 6, [1, 4, 1, 16], [2, 2, 5, 1, 1, 3, 6]])
def test_branch_block_is_each_branch_causal_and_blind_to_the_others(lengths):
    block, offsets = branch_block(tuple(lengths))
    want, want_offsets = branch_mask(lengths)
    assert block.dtype == bool and np.array_equal(block, want) and offsets.tolist() == want_offsets
    assert branch_block(tuple(lengths)) is branch_block(tuple(lengths)) and not block.flags.writeable


def test_selfdraft_extras_place_the_cached_block_after_the_candidates():
    lm = tiny_model()
    drafter = methods.create("selfdraft", lm.runner, lm.name, GREEDY, {"branches": 3, "branch_len": 6})
    drafter.fed = {0: [5, 6, 7], 2: [8], 1: [9, 10]}
    for nodes in (0, 7):
        extras = drafter._extras(committed=20, nodes=nodes)
        block, _ = branch_mask([3, 1, 2])
        assert extras.tokens == [5, 6, 7, 8, 9, 10] and extras.positions == [21, 22, 23, 21, 21, 22]
        assert extras.visibility[:, 0].all() and not extras.visibility[:, 1 : 1 + nodes].any()
        assert np.array_equal(extras.visibility[:, 1 + nodes :], block)
        # made once a shape, read-only (`Extras.beside`): the next step of the same shape reads the same array
        assert not extras.visibility.flags.writeable
        assert drafter._extras(committed=20, nodes=nodes).visibility is extras.visibility


@pytest.mark.parametrize("width", [1, 2, 3, 7, 15])
@pytest.mark.parametrize("levels", [1, 2, 4, 7])
def test_window_visibility_equals_its_definition(width, levels):
    for nodes in (0, 1, 30):
        visible = window_visibility(width, levels, nodes)
        assert visible.dtype == bool and not visible.flags.writeable  # made once a shape (`Extras.beside`)
        assert window_visibility(width, levels, nodes) is visible
        assert np.array_equal(visible, window_mask(width, levels, nodes))


def test_the_verify_blocks_visibility_is_the_trees_then_the_extras_made_once_a_pair():
    """`Extras.block`: the tree's visibility in the top-left corner, the extras' rows below it, nothing else; the same
    array for the same (read-only, made once a shape) pair, a fresh one for an extras' visibility of a step's own."""
    draft, causal = Draft(tokens=[1, 2, 3], parents=[-1, 0, -1]), np.tri(2, dtype=bool)
    causal.flags.writeable = False  # made once a shape, as a drafter's blocks are
    extras = Extras(tokens=[7, 8], positions=[5, 6], visibility=Extras.beside(causal, 3))
    assert Extras.beside(causal, 3) is extras.visibility and Extras.beside(np.tri(2, dtype=bool), 3).flags.writeable
    block = extras.block(draft)
    assert block.shape == (6, 6) and not block[:4, 4:].any()
    assert np.array_equal(block[:4, :4], draft.visibility()) and np.array_equal(block[4:], extras.visibility)
    assert extras.block(Draft(tokens=[4, 5, 6], parents=[-1, 0, -1])) is block  # same shapes: the same array
    own = Extras(tokens=[7, 8], positions=[5, 6], visibility=np.array(extras.visibility))  # writable: a step's own
    assert np.array_equal(own.block(draft), block) and own.block(draft) is not own.block(draft)

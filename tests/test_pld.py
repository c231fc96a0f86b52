"""Prompt lookup's index (`specgui.methods.pld.NgramIndex`) on hand-built token lists."""

from specgui.methods.pld import NgramIndex


def test_lookup_copies_after_the_first_occurrence_of_the_longest_matching_suffix():
    """Saxena's reference takes the first match: the prompt's copy of a phrase, not the output's own echo."""
    prompt = [7, 1, 2, 3, 4, 5, 6]  # the document
    output = [9, 1, 2, 8, 0, 1, 2]  # the answer: "1 2" once went on differently, now it ends the text again
    tokens = prompt + output
    index = NgramIndex(1, 3)
    index.update(tokens)
    found, n = index.lookup(tokens, 4)
    assert (found, n) == ([3, 4, 5, 6], 2)  # "1 2" first followed by 3 4 5 6 (in the prompt), not by 8 0
    assert index.lookup([*tokens, 3], 8) == ([4, 5, 6, 9, 1, 2, 8, 0], 3)  # the longest suffix, "1 2 3", wins


def test_growing_text_keeps_first_positions_and_indexes_only_what_has_a_continuation():
    index = NgramIndex(1, 2)
    tokens = [5, 6, 5]
    index.update(tokens)
    assert index.lookup(tokens, 3) == ([6, 5], 1)  # "5" first at 0
    tokens += [6, 5, 6]
    index.update(tokens)
    assert index.lookup(tokens, 3) == ([5, 6, 5], 2)  # "5 6" first at 0, still
    assert index.lookup([1, 2], 3) == ([], 0)  # nothing matches

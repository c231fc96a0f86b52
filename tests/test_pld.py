"""Prompt lookup's index (`specgui.methods.ngram.pld.NgramIndex`) on hand-built token lists, the device's match
(`fastpath.lookup.match`) against it, and its steps chained on the device."""

import itertools

import pytest
import torch

from helpers import baseline_run, flat_profile, tiny_model
from specgui import fastpath
from specgui.core import decode
from specgui.errors import SpecGUIError
from specgui.fastpath.lookup import match
from specgui.methods.ngram.pld import NgramIndex
from specgui.tools import dispatch


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


def test_the_devices_match_is_the_index_lookup_on_every_prefix_of_random_texts():
    """`fastpath.lookup.match` (fixed shapes, inside a program) finds what `NgramIndex.lookup` finds: the same
    continuation and n, for every length of texts over small vocabularies (many repeats), in a buffer longer than the
    text (its tail holds stale ids, as the device's history does past its cursor)."""
    generator = torch.Generator().manual_seed(0)
    for vocab, (lo, hi) in [(3, (1, 3)), (5, (2, 4)), (2, (1, 1)), (8, (3, 3))]:
        text = torch.randint(0, vocab, (40,), generator=generator).tolist()
        buffer = torch.tensor(text + torch.randint(0, vocab, (24,), generator=generator).tolist())
        for length in range(1, len(text) + 1):
            index = NgramIndex(lo, hi)
            index.update(text[:length])
            found, n = index.lookup(text[:length], 6)
            ids, available, size = match(buffer, torch.tensor([length]), (lo, hi), 6)
            assert (ids[: min(6, int(available))].tolist(), int(size)) == (found, n), (vocab, length)


def test_on_the_pipelined_fast_path_every_lookup_step_but_the_first_is_launched_before_the_one_before_is_read():
    """Prompt lookup's steps chained on the device (`fastpath.LookupSteps`): the device waits for a host's read at the
    first step (the prompt forward's) and where the step before might have filled the budget (no step is launched
    past a run's end), serially at every step; under the overwrite check both give plain decoding's tokens, with
    drafts, and the same steps."""
    lm = tiny_model(seed=3)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    kwargs = {"max_new_tokens": 24, "fast_path": "on", "params": {"policy": "fixed"}, "profile": flat_profile(lm, True)}
    decode.run(lm, prompt, "pld", **kwargs)  # first-use timings
    runs = {}
    for pipeline in (True, False):
        with fastpath.overwrite_check(), dispatch.counting() as counts:
            runs[pipeline] = result = decode.run(lm, prompt, "pld", pipeline=pipeline, **kwargs)
        assert result.token_ids == baseline_run(lm, prompt, 24).token_ids
        generated = [1 + n for n in itertools.accumulate((len(s.emitted) for s in result.steps), initial=0)]
        at_the_end = sum(generated[i] + step.forward_tokens + 1 > 24 for i, step in enumerate(result.steps[:-1]))
        assert counts.waited == (1 + at_the_end if pipeline else result.summary.steps)
        assert at_the_end < result.summary.steps // 2
    assert runs[True].summary.drafted > 0
    assert [s.draft_tokens for s in runs[True].steps] == [s.draft_tokens for s in runs[False].steps]


def test_a_device_draft_other_than_the_hosts_stops_the_run_with_a_one_line_error(monkeypatch):
    """The step's event shows the host's lookup and its verdict is read against the device's forward: were they ever
    to differ, the run stops rather than verify one draft against another's forward."""
    lm = tiny_model(seed=3)
    lookup = NgramIndex.lookup

    def shifted(self, tokens, limit):
        found, n = lookup(self, tokens, limit)
        return [t + 1 for t in found], n

    monkeypatch.setattr(NgramIndex, "lookup", shifted)
    with pytest.raises(SpecGUIError, match="the device's prompt lookup drafted"):
        decode.run(lm, [1, 2, 3, 1, 2, 3, 1, 2], "pld", max_new_tokens=16, fast_path="on",
                   params={"policy": "fixed"}, profile=flat_profile(lm, True))

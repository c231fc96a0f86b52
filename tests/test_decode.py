"""The decode loop: event stream, stop conditions, budget, cancellation, honest timing, bad requests."""

import time

import pytest

from helpers import tiny_model
from specgui.core import decode
from specgui.core import step as steps_module
from specgui.core.events import Prefill, Start, Step, Summary
from specgui.core.text import pieces_in_context
from specgui.errors import SpecGUIError

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4]


def test_event_stream_shape_and_totals(tiny_lm):
    # drafts at pld's fixed sizes: the totals must cover accepted drafts, which the cost model may pause
    events = list(decode.generate(tiny_lm, PROMPT, "pld", max_new_tokens=30, params={"policy": "fixed"}))
    assert isinstance(events[0], Start) and isinstance(events[1], Prefill) and isinstance(events[-1], Summary)
    steps = [e for e in events if isinstance(e, Step)]
    summary = events[-1]
    tokens = [events[1].token] + [t for s in steps for t in s.emitted]
    assert list(summary.token_ids) == tokens and summary.new_tokens == 30 == len(tokens)
    assert summary.steps == len(steps) and summary.stop == "length"
    assert summary.tau == pytest.approx(sum(len(s.emitted) for s in steps) / len(steps))
    assert summary.accepted == sum(s.accepted for s in steps) > 0
    assert sum(summary.histogram) == len(steps)
    assert "".join([events[1].piece] + [p for s in steps for p in s.emitted_pieces]) == summary.text
    for s in steps:
        assert s.emitted[: s.accepted] == tuple(s.draft_tokens[i] for i in s.path)
        assert s.forward_tokens == 1 + s.drafted and len(s.margins) == len(s.emitted)
        assert s.rejected == s.proposal[s.accepted :]


def test_baseline_tau_is_one_and_drafts_nothing(tiny_lm):
    summary = decode.run(tiny_lm, PROMPT, "baseline", max_new_tokens=12).summary
    assert summary.tau == 1.0 and summary.drafted == 0 and summary.steps == 11


def test_stop_token_ends_the_run_even_inside_an_accepted_draft():
    lm = tiny_model(eos=24)  # the tiny model's greedy output settles on token 24
    free = decode.run(tiny_model(), PROMPT, "baseline", max_new_tokens=30).token_ids
    assert 24 in free
    for method in ("baseline", "pld"):
        result = decode.run(lm, PROMPT, method, max_new_tokens=30)
        assert result.token_ids == free[: free.index(24) + 1] and result.summary.stop == "eos"


def test_budget_is_exact_for_every_length(tiny_lm):
    for n in (1, 2, 3, 7):
        assert len(decode.run(tiny_lm, PROMPT, "pld", max_new_tokens=n).token_ids) == n


def test_should_stop_cancels_within_one_step(tiny_lm):
    calls = []
    events = list(decode.generate(tiny_lm, PROMPT, "baseline", max_new_tokens=50,
                                  should_stop=lambda: calls.append(1) or len(calls) > 3))
    assert events[-1].stop == "cancelled" and events[-1].steps == 3


def test_consumer_time_is_not_counted(tiny_lm):
    fast = decode.run(tiny_lm, PROMPT, "baseline", max_new_tokens=6).summary.wall_s
    wall = None
    for event in decode.generate(tiny_lm, PROMPT, "baseline", max_new_tokens=6):
        time.sleep(0.05)  # a slow renderer
        if isinstance(event, Summary):
            wall = event.wall_s
    assert wall < fast + 0.1  # six 50 ms sleeps would add 0.3 s


def test_the_pieces_text_is_presentation_not_counted(tiny_lm, monkeypatch):
    def steps_and_wall():
        events = list(decode.generate(tiny_lm, PROMPT, "pld", max_new_tokens=20, params={"policy": "fixed"}))
        return [e for e in events if isinstance(e, Step)], events[-1].wall_s

    steps, wall = steps_and_wall()
    quick_pieces = steps_module.pieces_in_context

    def pieces(tokenizer, items):  # a slow detokenizer: every draft token's text takes 50 ms to build
        time.sleep(0.05 * len(items))
        return quick_pieces(tokenizer, items)

    monkeypatch.setattr(steps_module, "pieces_in_context", pieces)
    slow_steps, slow_wall = steps_and_wall()
    drafted = sum(s.drafted for s in slow_steps)
    assert [s.draft_tokens for s in slow_steps] == [s.draft_tokens for s in steps] and drafted >= 10
    assert all(len(s.draft_pieces) == s.drafted for s in slow_steps)
    # timed, each drafting step's overhead would grow by >= 50 ms and the run's wall by 50 ms a draft token
    assert max(s.overhead_ms for s in slow_steps) < max(s.overhead_ms for s in steps) + 25
    assert slow_wall < wall + 0.025 * drafted


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "positive"),
    ({"max_new_tokens": 5000}, "context"),
    ({"method": "nope"}, "unknown method"),
    ({"params": {"num_draft": 0}, "method": "pld"}, "num_draft"),
    ({"params": {"bogus": 1}, "method": "pld"}, "unknown parameter"),
])
def test_bad_requests_raise_one_line_errors(tiny_lm, kwargs, message):
    method = kwargs.pop("method", "baseline")
    with pytest.raises(SpecGUIError, match=message) as info:
        list(decode.generate(tiny_lm, PROMPT, method, **kwargs))
    assert "\n" not in str(info.value)


def test_empty_prompt_is_refused(tiny_lm):
    with pytest.raises(SpecGUIError, match="empty"):
        list(decode.generate(tiny_lm, [], "baseline"))


def test_draft_pieces_read_as_the_text_would_with_a_real_tokenizer(embedded_lm):
    """`text.pieces_in_context` decodes a step's draft in one batch where the tokenizer can (SmolLM2's byte-level BPE):
    each piece is what decoding the text with the token adds, a step without a draft has none, and a token that ends
    mid-character reads as the tokenizer shows it alone."""
    tokenizer = embedded_lm.tokenizer
    context, draft = tokenizer.encode("def fib(n):\n    if n < 2:"), tokenizer.encode(" return n\n")
    pieces = pieces_in_context(tokenizer, [(context + draft[:i], token) for i, token in enumerate(draft)])
    assert "".join(pieces) == " return n\n" and len(pieces) == len(draft)
    assert pieces_in_context(tokenizer, []) == []
    split = tokenizer.encode("😀")
    assert pieces_in_context(tokenizer, [(context, split[0])]) == [tokenizer.decode(split[:1])]

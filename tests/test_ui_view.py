"""Events -> view: token kinds and placement, running totals, method payloads (checked), the comparison."""

import dataclasses

import pytest
from ui_helpers import prefill, run, start, step

from specgui.ui.view import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    DISCARDED,
    REJECTED,
    RunView,
    compare,
    median_index,
    node_verdicts,
    parse_internals,
    spread,
    why,
)


def view_of(events) -> RunView:
    view = RunView()
    view.extend(events)
    return view


def kinds(view: RunView) -> list[tuple[str, str]]:
    return [(m.text, m.kind) for m in view.marks]


def test_tokens_are_marked_by_how_they_were_produced():
    view = view_of([
        start(), prefill(10, "A"),
        step(1, [11, 12, 13], [0, 1], 14),  # two accepted, 13 rejected, 14 corrects it
        step(2, [15, 16], [0, 1], 17),  # the whole draft accepted: 17 is a bonus
        step(3, [], [], 18),  # no draft: the verifier's token alone
    ])
    assert kinds(view) == [("A", BONUS), ("<11>", ACCEPTED), ("<12>", ACCEPTED), ("<13>", REJECTED),
                           ("<14>", CORRECTION), ("<15>", ACCEPTED), ("<16>", ACCEPTED), ("<17>", BONUS),
                           ("<18>", BONUS)]
    assert [m.step for m in view.marks] == [0, 1, 1, 1, 1, 2, 2, 2, 3]
    assert view.token_ids == [10, 11, 12, 14, 15, 16, 17, 18]  # rejected tokens never reach the output
    assert "".join(view.pieces) == "A<11><12><14><15><16><17><18>"


def test_every_rejected_draft_token_is_shown_where_it_was_rejected():
    view = view_of([start(), prefill(), step(1, [11, 12, 13, 19], [], 14)])
    assert kinds(view)[1:] == [("<11>", REJECTED), ("<12>", REJECTED), ("<13>", REJECTED), ("<19>", REJECTED),
                               ("<14>", CORRECTION)]


def test_a_budget_cut_step_has_no_verifier_token():
    view = view_of([start(), prefill(), step(1, [11, 12], [0, 1], 13, emitted=[11, 12], corrected=False)])
    assert kinds(view)[1:] == [("<11>", ACCEPTED), ("<12>", ACCEPTED)]


def test_totals_race_and_rates_while_running_and_after_the_summary():
    events = run(start(), prefill(ms=99.0), step(1, [11], [0], 12, ms=(1.0, 48.0, 1.0)),
                 step(2, [13], [], 14, ms=(1.0, 48.0, 1.0)))
    view = view_of(events[:-1])
    assert not view.done and view.new_tokens == 4
    assert view.elapsed_ms == pytest.approx(100 + 50 + 50)
    assert view.race == [(0.0, 0), (0.1, 1), (0.15, 3), (0.2, 4)]
    assert view.tokens_per_s == pytest.approx(4 / 0.2)
    assert view.tau == pytest.approx(1.5) and view.acceptance_rate == pytest.approx(0.5)
    view.add(events[-1])
    assert view.done and view.tokens_per_s == events[-1].tokens_per_s and view.tau == events[-1].tau
    assert view.events == events


def test_layer_skip_payloads_become_skip_sets_with_reoptimisation():
    payload = {"skip": {"attn": [1, 3], "mlp": [2]}, "reoptimized": True, "dp_score": 0.93, "dp_ms": 4.5}
    internals = parse_internals(payload)
    assert internals.has_skip and internals.skip_attn == {1, 3} and internals.skip_mlp == {2}
    assert internals.reoptimized and internals.dp_score == 0.93 and internals.timings == (("dp_ms", 4.5),)
    assert not parse_internals({}).has_skip and not parse_internals({"reoptimized": "yes"}).reoptimized


def test_a_skip_set_stated_once_in_the_prompt_forward_applies_to_every_step():
    view = view_of([start(), prefill(payload={"skip": {"attn": [0], "mlp": []}, "acs": [0.9, 0.5, 0.7, 0.2]}),
                    step(1, [11], [0], 12), step(2, [13], [0], 14, payload={"skip": {"attn": [2], "mlp": [1]}})])
    first, second = view.internals(0), view.internals(1)
    assert first.skip_attn == {0} and first.acs == (0.9, 0.5, 0.7, 0.2)
    assert second.skip_attn == {2} and second.skip_mlp == {1}  # a step's own skip set wins


def test_fractal_origins_tint_draft_tokens_and_collect_the_layers():
    payload = {"fractal_layers": [8, 16], "origin": [8, 16, None]}
    view = view_of([start(layers=24), prefill(payload={"fractal_layers": [8, 16]}),
                    step(1, [11, 12, 13], [0], 14, payload=payload)])
    assert view.fractal_layers == [8, 16]
    assert [(m.kind, m.origin) for m in view.marks[1:]] == [(ACCEPTED, 8), (REJECTED, 16), (REJECTED, None),
                                                             (CORRECTION, None)]


def test_selfdraft_payload_branches_candidates_hit_and_caches():
    payload = {"branches": [[5, 6], [7]], "candidates": [{"nodes": [0, 1], "source": "context", "key": [3, 4]},
                                                          {"nodes": [2], "source": "corpus", "key": [9]}],
               "hit": {"candidate": 1, "tokens": 1}, "cache_sizes": {"context": 12, "corpus": 3000}}
    internals = parse_internals(payload)
    assert internals.branches == ((5, 6), (7,))
    assert [(c.nodes, c.source, c.key) for c in internals.candidates] == [((0, 1), "context", (3, 4)),
                                                                         ((2,), "corpus", (9,))]
    assert internals.hit == (1, 1) and internals.cache_sizes == (("context", 12), ("corpus", 3000))


def test_malformed_payload_values_are_dropped_not_trusted():
    payload = {"skip": "all", "origin": ["x", 2], "branches": [[1, "a"], 7], "candidates": [5, {"source": 3}],
               "hit": {"candidate": "0", "tokens": 1}, "cache_sizes": {"context": "big"}, "exit": {"reason": 7},
               "fractal_layers": [True], "acs": [float("nan")], "dp_score": "high", "draft_len": 2.5,
               "mystery": {"a": [1, 2]}, "bad_ms": "slow"}
    internals = parse_internals(payload)
    assert not internals.has_skip and internals.origin == () and internals.candidates == ()
    assert internals.branches == ((),)  # a branch of the wrong shape is empty, the grid keeps its row
    assert internals.hit is None and internals.cache_sizes == () and internals.exit_reason is None
    assert internals.fractal_layers == () and internals.acs == () and internals.dp_score is None
    assert internals.draft_len is None and internals.timings == ()
    assert ("mystery", '{"a": [1, 2]}') in internals.other


def test_exit_and_draft_length_facts():
    internals = parse_internals({"exit": {"threshold": 0.8, "confidences": [0.95, 0.4], "reason": "threshold"},
                                 "draft_len": 5, "ngram": 3})
    assert (internals.exit_threshold, internals.confidences, internals.exit_reason) == (0.8, (0.95, 0.4), "threshold")
    assert internals.draft_len == 5 and internals.ngram == 3


def test_draft_vocabulary_fact():
    internals = parse_internals({"vocab": {"size": 8213, "low_ids": 8192, "outside": True, "outside_so_far": 4}})
    assert internals.vocab == (8213, 8192, True, 4) and internals.other == ()
    assert parse_internals({"vocab": {"size": "many"}}).vocab is None


def test_tree_verdicts_accepted_rejected_and_discarded():
    # root children 0 and 3; 0 -> 1 -> 2; 0 -> 4. Path [0, 4]: 3 and 1 were refused, 2 hung below 1.
    s = step(1, [11, 12, 13, 14, 15], [0, 4], 16, parents=[-1, 0, 1, -1, 0], corrected=False)
    verdicts = {n.node: (n.verdict, n.depth) for n in node_verdicts(s)}
    assert verdicts == {0: (ACCEPTED, 1), 1: (REJECTED, 2), 2: (DISCARDED, 3), 3: (REJECTED, 1), 4: (ACCEPTED, 2)}


def _pair(method_steps, baseline_steps, *, temperature=0.0, method="pld"):
    m = view_of(run(start(method, temperature=temperature), prefill(), *method_steps))
    b = view_of(run(start("baseline", temperature=temperature), prefill(), *baseline_steps))
    return m, b


def test_identical_runs_and_speedup():
    m, b = _pair([step(1, [11, 12], [0, 1], 13)], [step(i + 1, [], [], t) for i, t in enumerate((11, 12, 13))])
    verdict = compare(m, b)
    assert verdict.identical is True and verdict.divergence is None
    assert verdict.speedup == pytest.approx(m.tokens_per_s / b.tokens_per_s) and verdict.speedup > 1


def test_first_divergence_reports_position_texts_and_margin():
    m, b = _pair([step(1, [11, 12], [0], 19)],
                 [step(1, [], [], 11, margins=[3.0]), step(2, [], [], 12, margins=[0.0004])])
    verdict = compare(m, b)
    assert verdict.identical is False
    d = verdict.divergence
    assert (d.position, *verdict.texts) == (2, "<19>", "<12>")
    assert d.baseline_margin == 0.0004 and d.near_tie


def test_identity_does_not_apply_to_sampling_other_prompts_or_stopped_runs():
    m, b = _pair([step(1, [], [], 11)], [step(1, [], [], 12)], temperature=0.8)
    assert compare(m, b).identical is None and "sampling" in compare(m, b).note
    other = view_of(run(start("baseline", prompt=(9, 9)), prefill(), step(1, [], [], 11)))
    assert compare(m, other).identical is None and "different" in compare(m, other).note
    stopped = view_of(run(start(), prefill(), step(1, [], [], 11), stop="cancelled"))
    greedy_base = view_of(run(start("baseline"), prefill(), step(1, [], [], 11)))
    assert compare(stopped, greedy_base).note == "a run was stopped before the end"


def test_a_paused_step_is_marked_paused_and_skips_nothing():
    paused = parse_internals({"skip": {"attn": [], "mlp": []}, "draft_len": 0,
                              "exit": {"threshold": 0.8, "confidences": [], "reason": "paused"}},
                             {"skip": {"attn": [1, 2], "mlp": []}})  # ADMG states its set once, in Prefill
    assert paused.paused and paused.skip_attn == frozenset() and paused.skip_mlp == frozenset()
    assert not parse_internals({"exit": {"reason": "threshold"}}).paused


def test_unknown_payload_floats_are_rounded_for_the_inspector():
    internals = parse_internals({"gain": 0.8333333333, "ratios": [0.123456, 2.0], "nested": {"x": 1 / 3}})
    assert dict(internals.other) == {"gain": "0.833", "ratios": "[0.123, 2.0]", "nested": '{"x": 0.333}'}


def _timed(method: str, steps: list, prefill_ms: float = 20.0) -> RunView:
    return view_of(run(start(method), prefill(ms=prefill_ms), *steps))


def _plain(n: int, ms: float = 50.0) -> list:
    return [step(i + 1, [], [], 100 + i, ms=(0.0, ms, 0.0)) for i in range(n)]


def test_why_decomposes_the_speedup_exactly_into_tau_and_step_cost():
    # each step: 2 drafts accepted + bonus = 3 tokens; draft 25 ms, verify 55 ms, other 0.5 ms; plain step 50 ms
    method = _timed("pld", [step(i + 1, [11, 12], [0, 1], 13, ms=(25.0, 55.0, 0.5)) for i in range(4)])
    baseline = _timed("baseline", _plain(12))
    reason = why(method, baseline)
    assert reason.tau == pytest.approx(3.0)
    assert (reason.draft, reason.verify, reason.other) == pytest.approx((0.5, 1.1, 0.01))
    assert reason.cost == pytest.approx(1.61) and reason.forward_tokens == 3
    assert reason.per_step == pytest.approx(reason.tau / reason.cost)
    # over the steps alone the tokens/s ratio is exactly tau / cost
    method_rate = sum(len(s.emitted) for s in method.steps) / sum(s.draft_ms + s.verify_ms + s.overhead_ms
                                                                   for s in method.steps)
    assert reason.per_step == pytest.approx(method_rate / (1 / 50.0))
    assert reason.overall == pytest.approx(method.tokens_per_s / baseline.tokens_per_s)
    assert reason.lost is None
    assert reason.predicted is None  # hand-made steps carry no cost-model price
    assert reason.sentence().startswith("1.86× per step: tau 3.00; a step costs 1.61 plain steps (draft 0.50, "
                                        "verify of 3 tokens 1.10, other 0.01); break-even tau 1.61.")


def test_why_puts_each_measured_figure_beside_the_prediction_of_the_same_thing():
    """Per step beside per step, overall (prompt forward counted) beside overall: never one kind beside the other."""
    priced = [dataclasses.replace(step(i + 1, [11, 12], [0, 1], 13, ms=(25.0, 55.0, 0.5)), predicted_ms=75.0,
                                  plain_ms=50.0) for i in range(4)]
    reason = why(_timed("pld", priced), _timed("baseline", _plain(12)))
    summary = _timed("pld", priced).summary
    assert reason.predicted_per_step == pytest.approx(12 * 50.0 / (4 * 75.0))  # the steps alone: 2.00x
    assert reason.predicted == pytest.approx(summary.plain_s / summary.predicted_s)
    assert reason.predicted < reason.predicted_per_step  # the prompt forward, as measured, dilutes it
    assert summary.prompt_s > 0
    assert reason.sentence().startswith("1.86× per step (predicted 2.00×): tau 3.00;")
    assert f"Counting the prompt forward: {reason.overall:.2f}× overall (predicted {reason.predicted:.2f}×)." \
        in reason.sentence()
    old_trace = dataclasses.replace(summary, prompt_s=0.0)  # a trace from before the prompt forward was kept
    assert old_trace.predicted_per_step is None and old_trace.predicted_speedup == summary.predicted_speedup


def test_why_counts_the_prompt_forward_where_it_changes_a_figure_as_shown():
    """The overall sentence is left out only where the overall figure and its prediction both read as the per-step
    ones: an overall that rounds to the per-step figure still shows beside a prediction that differs."""
    priced = [dataclasses.replace(step(i + 1, [11, 12], [0, 1], 13, ms=(25.0, 55.0, 0.5)), predicted_ms=75.0,
                                  plain_ms=50.0) for i in range(4)]
    reason = why(_timed("pld", priced), _timed("baseline", _plain(12)))
    same_figure = dataclasses.replace(reason, overall=reason.per_step)
    assert "Counting the prompt forward: 1.86× overall (predicted " in same_figure.sentence()
    both_same = dataclasses.replace(same_figure, predicted=reason.predicted_per_step)
    assert "Counting the prompt forward" not in both_same.sentence()

def test_an_uncalibrated_prediction_says_so():
    priced = [dataclasses.replace(step(i + 1, [11, 12], [0, 1], 13, ms=(25.0, 55.0, 0.5)), predicted_ms=75.0,
                                  plain_ms=50.0) for i in range(4)]
    costs = {"sizes": [1], "contexts": [128], "forward": [[40.0]], "step": 50.0, "loop": 10.0,
             "device": "cpu AMD EPYC x2", "measured_at": 1795000000.0}
    for uncalibrated in (True, False):
        first = dataclasses.replace(start("pld"), costs={**costs, "uncalibrated": uncalibrated})
        text = why(view_of(run(first, prefill(), *priced)), _timed("baseline", _plain(12))).sentence()
        assert ("(predicted 2.00×, uncalibrated): tau" in text) is uncalibrated
        assert ("(predicted 2.00×): tau" in text) is not uncalibrated
        assert (text.count(", uncalibrated)") == 2) is uncalibrated  # the overall prediction too


def test_why_names_the_profile_that_priced_the_run():
    priced = [dataclasses.replace(step(i + 1, [11, 12], [0, 1], 13, ms=(25.0, 55.0, 0.5)), predicted_ms=75.0,
                                  plain_ms=50.0) for i in range(4)]
    profiled = dataclasses.replace(start("pld"), costs={"sizes": [1], "contexts": [128], "forward": [[40.0]],
                                                        "step": 50.0, "loop": 10.0, "device": "cpu AMD EPYC x2",
                                                        "measured_at": 1795000000.0})
    reason = why(view_of(run(profiled, prefill(), *priced)), _timed("baseline", _plain(12)))
    assert reason.priced_by == "measured 2026-11-18 11:06 UTC on cpu AMD EPYC x2"
    assert reason.sentence().endswith(" Priced by the cost profile measured 2026-11-18 11:06 UTC on cpu AMD EPYC x2.")
    unpriced = why(_timed("pld", [step(i + 1, [11, 12], [0, 1], 13) for i in range(4)]), _timed("baseline", _plain(12)))
    assert "Priced by" not in unpriced.sentence()  # no prediction, no profile to name


@pytest.mark.parametrize("steps, lost", [
    # the draft costs most of a plain step and buys little more than the verifier's own token
    ([step(i + 1, [11, 12], [0], 13, ms=(60.0, 52.0, 0.0)) for i in range(4)], "draft too costly"),
    # a cheap draft of 8 tokens, half accepted, but the verify over 9 tokens costs more than 5 plain steps
    ([step(i + 1, list(range(20, 28)), list(range(4)), 30, ms=(0.1, 260.0, 0.0)) for i in range(2)],
     "verify of 9 tokens too costly"),
    # a cheap draft and verify, but the target keeps rejecting the draft
    ([step(i + 1, [11, 12, 13, 14], [], 15, ms=(0.1, 60.0, 0.0)) for i in range(4)],
     "acceptance too low (0.00 of 4.00 drafted tokens accepted per drafting step)"),
    ([step(i + 1, [], [], 15, ms=(0.0, 55.0, 0.0)) for i in range(4)], "nothing was drafted"),
])
def test_a_losing_run_names_the_term_that_lost(steps, lost):
    reason = why(_timed("clasp", steps), _timed("baseline", _plain(12)))
    assert reason.per_step < 1 and reason.lost == lost
    assert f"Lost: {lost}." in reason.sentence()


def test_a_run_the_cost_model_never_let_draft_says_why():
    paused = {"plan": {"size": 0, "mode": "paused", "predicted": 1.0, "best": 0.7, "expected": 0.0, "prior": 0.77}}
    steps = [step(i + 1, [], [], 15, ms=(0.0, 55.0, 0.0), payload=paused) for i in range(4)]
    reason = why(_timed("clasp", steps), _timed("baseline", _plain(12)))
    assert reason.lost == ("nothing was drafted: on this device a draft accepted at 80% per token would reach only "
                           "0.77× per step, so the cost model decoded plainly")


def test_a_noise_check_explains_its_distance_from_one_as_noise():
    reason = why(_timed("baseline", _plain(4, ms=60.0)), _timed("baseline", _plain(4)))
    assert reason.noise_check and reason.lost is None
    assert reason.sentence().startswith(f"The same decode timed twice: {reason.overall:.2f}× (0.83× per step).")


def test_why_needs_two_finished_runs_with_steps():
    finished = _timed("pld", [step(1, [11], [0], 12)])
    assert why(finished, RunView()) is None
    assert why(view_of(run(start(), prefill(), step(1, [], [], 11))[:-1]), _timed("baseline", _plain(2))) is None
    stopped = view_of(run(start("baseline"), prefill(), *_plain(2), stop="cancelled"))
    assert why(finished, stopped) is None


def test_spread_and_the_pair_nearest_the_median():
    assert spread([]) is None
    one = spread([1.4])
    assert (one.median, one.low, one.high, one.n) == (1.4, 1.4, 1.4, 1)
    odd = spread([1.5, 1.2, 1.4])
    assert (odd.median, odd.low, odd.high, odd.n) == (1.4, 1.2, 1.5, 3)
    assert spread([1.0, 1.2, 1.4, 2.0]).median == pytest.approx(1.3)
    assert median_index([1.5, 1.2, 1.4]) == 2
    assert median_index([1.0, 1.2, 1.4, 2.0]) == 1  # even N: the nearer of the middle two, the first of ties

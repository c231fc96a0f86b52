"""Views -> plotly figures: each chart's data is the events' numbers, nothing else."""

import dataclasses

import pytest
from ui_helpers import prefill, run, start, step

from specgui.ui import charts
from specgui.ui.view import RunView


def view_of(events) -> RunView:
    view = RunView()
    view.extend(events)
    return view


def traces(fig) -> dict:
    return {t.name: t for t in fig.data}


def test_tokens_per_step_stacks_accepted_and_the_verifiers_token():
    view = view_of([start(), prefill(), step(1, [11, 12, 13], [0, 1], 14), step(2, [15], [0], 16),
                    step(3, [17, 18], [0], 19, emitted=[17], corrected=True)])  # budget cut: no own token
    t = traces(charts.accepted_per_step(view))
    assert list(t["accepted draft"].y) == [2, 1, 1]
    assert list(t["correction"].y) == [1, 0, 0] and list(t["bonus"].y) == [0, 1, 0]
    assert list(t["drafted"].y) == [3, 1, 2] and list(t["accepted draft"].x) == [1, 2, 3]
    assert charts.accepted_per_step(RunView()).layout.annotations[0].text == "no steps yet"


def test_skip_heatmap_rows_are_sublayers_and_marks_reoptimisation():
    view = view_of([start(layers=3), prefill(),
                    step(1, [11], [0], 12, payload={"skip": {"attn": [0], "mlp": [2]}, "reoptimized": True}),
                    step(2, [13], [0], 14, payload={"skip": {"attn": [1, 2], "mlp": []}})])
    fig = charts.skip_heatmap(view)
    heat = fig.data[0]
    assert list(heat.y) == ["L0 attn", "L0 mlp", "L1 attn", "L1 mlp", "L2 attn", "L2 mlp"]
    assert [list(row) for row in heat.z] == [[1, 0], [0, 0], [0, 1], [0, 0], [0, 1], [1, 0]]
    assert list(traces(fig)["re-optimised"].x) == [1]
    assert list(fig.layout.yaxis.ticktext) == ["layer 0"]  # one readable label every five layers
    pld = view_of([start(), prefill(), step(1, [11], [0], 12)])
    assert "pld skips no layers" in charts.skip_heatmap(pld).layout.annotations[0].text


def test_a_paused_step_draws_an_empty_column_not_a_skip_set():
    paused = {"skip": {"attn": [], "mlp": []}, "exit": {"reason": "paused", "confidences": [], "threshold": 0.5}}
    view = view_of([start(layers=2), prefill(payload={"skip": {"attn": [1], "mlp": []}}),
                    step(1, [11], [0], 12), step(2, [], [], 13, payload=paused)])
    fig = charts.skip_heatmap(view)
    assert [list(row) for row in fig.data[0].z] == [[0, None], [0, None], [1, None], [0, None]]
    assert list(traces(fig)["paused (nothing drafted)"].x) == [2]


def test_phase_times_are_the_steps_milliseconds():
    view = view_of([start(), prefill(), step(1, [11], [0], 12, ms=(2.0, 40.0, 0.5)), step(2, [], [], 13)])
    t = traces(charts.phase_times(view))
    assert list(t["draft"].y) == [2.0, 1.0] and list(t["verify"].y) == [40.0, 50.0]
    assert list(t["overhead"].y) == [0.5, 0.5]


def test_cost_profile_draws_the_measured_curve_the_plain_step_and_the_runs_verifies():
    costs = {"sizes": [1, 2, 4], "contexts": [128, 1024], "forward": [[30.0, 32.0, 50.0], [35.0, 37.0, 60.0]],
             "step": 31.0, "loop": 1.0, "device": "cpu"}
    view = view_of(run(dataclasses.replace(start(), costs=costs), prefill(), step(1, [11, 12], [0], 13),
                       step(2, [], [], 14)))
    fig = charts.cost_profile(view)
    curves = traces(fig)
    assert list(curves["forward, 128 cached"].y) == [30.0, 32.0, 50.0]
    assert list(curves["forward, 1024 cached"].x) == [1, 2, 4]
    assert list(curves["this run's verifies"].x) == [s.forward_tokens for s in view.steps] == [3, 1]
    assert fig.layout.shapes[0].y0 == 31.0  # the plain step
    assert "no cost profile" in str(charts.cost_profile(view_of(run(start(), prefill()))).layout.annotations[0].text)


def test_race_plots_tokens_against_decoding_time_for_both_runs():
    method = view_of(run(start(), prefill(ms=49.0), step(1, [11], [0], 12)))
    base = view_of(run(start("baseline"), prefill(ms=49.0), step(1, [], [], 11), step(2, [], [], 12)))
    t = traces(charts.race(method, base))
    assert list(t["pld"].y) == [0, 1, 3] and list(t["baseline"].y) == [0, 1, 2, 3]
    assert t["baseline"].x[-1] == pytest.approx(0.05 + 2 * 0.0515)
    noise = view_of(run(start("baseline"), prefill(), step(1, [], [], 11)))
    assert [tr.name for tr in charts.race(noise, base).data] == ["baseline (noise check)", "baseline"]


def test_the_race_keeps_still_axes_while_it_grows_and_text_is_large_enough_for_a_room():
    method = view_of(run(start(), prefill(ms=49.0), step(1, [11], [0], 12)))
    base = view_of(run(start("baseline"), prefill(ms=49.0), step(1, [], [], 11), step(2, [], [], 12)))
    span = charts.race_span(method, base)
    assert span == (pytest.approx(base.seconds), 3)
    empty = charts.race(RunView(), RunView(), span)
    assert not empty.data and empty.layout.xaxis.range[1] == pytest.approx(span[0] * 1.02)
    fig = charts.race(method, base, span)
    assert fig.layout.font.size >= 16 and fig.layout.title.font.size >= 16


def test_compare_chart_has_speedup_and_tau_per_method_and_category():
    agg = {"speedup": 1.5, "mean_accepted": 2.0}
    report = {"methods": {"baseline": {}, "pld": {}},
              "categories": {"qa": {"baseline": {"speedup": 1.0, "mean_accepted": 1.0}, "pld": agg},
                             "code": {"baseline": {"speedup": 1.0, "mean_accepted": 1.0}, "pld": agg}}}
    fig = charts.compare_chart(report)
    speed = next(t for t in fig.data if t.xaxis == "x" and t.name == "pld")
    tau = next(t for t in fig.data if t.xaxis == "x2" and t.name == "pld")
    assert list(speed.x) == ["qa", "code"] and list(speed.y) == [1.5, 1.5] and list(tau.y) == [2.0, 2.0]

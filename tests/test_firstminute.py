"""`python -m specgui first-minute`'s figures of a race (`firstminute.race_figures`), from two runs' traces: the overall
speedup and its prediction as the page's why line reads them, and what a prediction's error comes from."""

import statistics

import pytest

from helpers import drafting, flat_profile, tiny_model
from specgui.core import decode
from specgui.core.events import Step
from specgui.tools import firstminute


def test_a_races_figures_name_the_plain_price_beside_the_baseline_as_measured():
    lm = tiny_model(seed=3)
    prompt, profile = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5], flat_profile(lm, False)
    method = decode.run(lm, prompt, "pld", max_new_tokens=16, params=drafting("pld", None), profile=profile)
    baseline = decode.run(lm, prompt, "baseline", max_new_tokens=16, profile=profile)
    figures = firstminute.race_figures([baseline.events, method.events])  # in either order: the panes are found
    assert figures["method"] == "pld" and figures["overall"] > 0 and figures["predicted"] > 0
    assert figures["plain_priced_ms"] == pytest.approx(statistics.median(s.plain_ms for s in method.steps), abs=0.01)
    measured = [s.draft_ms + s.verify_ms + s.overhead_ms for s in baseline.events if isinstance(s, Step)]
    assert figures["baseline_step_ms"] == pytest.approx(statistics.median(measured), abs=0.01)
    ratio = sum(s.draft_ms + s.verify_ms + s.overhead_ms for s in method.steps) / sum(s.predicted_ms
                                                                                      for s in method.steps)
    assert figures["method_measured_over_predicted"] == pytest.approx(ratio, abs=0.001)
    assert set(figures["prefill_ms"]) == {"method", "baseline"}

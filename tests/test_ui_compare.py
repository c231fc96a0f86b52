"""The Compare tab: prompt selection, the suite run (progress, stop), the results table."""

import threading

import pytest

from specgui.core.sampling import Sampling
from specgui.errors import SpecGUIError
from specgui.tools.prompts import PromptRow, load_prompts
from specgui.ui import compare

ROWS = [PromptRow("a-1", "a", prompt="abcdeabcdeabc"), PromptRow("b-1", "b", prompt="bcdbcdbcdbcd")]


def test_pick_rows_per_category():
    suite = load_prompts()
    one_each = compare.pick_rows(suite, compare.ALL, 1)
    assert [r.category for r in one_each] == list(dict.fromkeys(r.category for r in suite))
    code = compare.pick_rows(suite, "code", 2)
    assert [r.category for r in code] == ["code", "code"]
    with pytest.raises(SpecGUIError):
        compare.pick_rows(suite, "poetry", 1)


def test_suite_run_reports_progress_per_method_and_a_table(tiny_lm):
    seen = []
    report = compare.run_suite(tiny_lm, ROWS, ["pld"], max_new_tokens=12, repeats=1, sampling=Sampling(),
                               progress=lambda done, each: seen.append((done, each)), stop=threading.Event())
    assert len(seen) == 4 and all(each == 2 for _, each in seen)  # 2 prompts x (baseline, pld)
    assert seen[-1][0] == {"baseline": 2, "pld": 2} and sum(seen[1][0].values()) == 2
    assert compare.progress_text(*seen[-1]) == "baseline 2/2 · pld 2/2"
    table = compare.table(report)
    assert [r[:2] for r in table] == [["baseline", "a"], ["pld", "a"], ["baseline", "b"], ["pld", "b"],
                                      ["baseline", "overall"], ["pld", "overall"]]
    pld = table[-1]
    assert pld[3] == round(report["methods"]["pld"]["speedup"], 2) and pld[6] == "2/2"
    assert len(pld) == len(compare.COLUMNS)


def test_one_category_has_no_overall_rows_repeating_it(tiny_lm):
    report = compare.run_suite(tiny_lm, ROWS[:1], ["pld"], max_new_tokens=8, repeats=1, sampling=Sampling(),
                               progress=lambda done, each: None, stop=threading.Event())
    assert [r[:2] for r in compare.table(report)] == [["baseline", "a"], ["pld", "a"]]


def test_stop_ends_the_suite_between_runs(tiny_lm):
    stop = threading.Event()
    stop.set()
    with pytest.raises(compare.Stopped):
        compare.run_suite(tiny_lm, ROWS, ["pld"], max_new_tokens=8, repeats=1, sampling=Sampling(),
                          progress=lambda done, each: None, stop=stop)

"""Paper presets: each seed paper's comparison set, its columns on our categories, and its table with ours and the
paper's own numbers side by side, each row saying whose it is."""

import threading

import pytest

from specgui.core.sampling import Sampling
from specgui.tools import bench, papers
from specgui.tools.prompts import PromptRow
from specgui.ui import compare


def test_the_three_seed_papers_have_presets_with_their_comparison_sets():
    assert papers.names() == ["asd-paper", "clasp-paper", "selfdraft-paper"]
    sets = {name: list(papers.load(name).methods) for name in papers.names()}
    assert sets == {"clasp-paper": ["baseline", "dv", "swift", "clasp"],
                    "selfdraft-paper": ["baseline", "selfdraft", "lookahead", "pld"],
                    "asd-paper": ["baseline", "dv", "admg"]}
    assert papers.load("clasp-paper").categories == ["multi-turn", "translation", "summarization", "qa", "math", "rag"]
    assert papers.load("asd-paper").categories == ["summarization", "code"]


def _fake_report(preset):
    """A bench report shaped like the real one, with recognisable figures per (method, category)."""
    def agg(i, j):
        return {"tokens_per_s": 10.0 + i + j, "speedup": 1.0 + 0.1 * i, "mean_accepted": 1.0 + i + 0.1 * j,
                "acceptance_rate": 0.5, "identical": 1, "total": 1}
    methods = list(preset.methods)
    cats = preset.categories
    return {"model": "m", "device": "cpu", "prompts": len(cats), "max_new_tokens": 8, "repeats": 1,
            "methods": {m: agg(i, 0) for i, m in enumerate(methods)},
            "categories": {c: {m: agg(i, j) for i, m in enumerate(methods)} for j, c in enumerate(cats)}}


def test_clasp_layout_is_a_row_per_method_with_tau_and_speedup_per_task_and_overall():
    preset = papers.load("clasp-paper")
    headers, rows = papers.table(_fake_report(preset), preset)
    assert headers[:4] == ["", "method", "multi-turn (MT-bench) τ", "multi-turn (MT-bench) speedup"]
    assert headers[-1] == "overall speedup" and all(len(r) == len(headers) for r in rows)
    assert [r[:2] for r in rows] == [["ours", "baseline (AUTOREGRESSIVE)"], ["ours", "dv (SELF-SD)"],
                                     ["ours", "swift (SWIFT)"], ["ours", "clasp (CLASP)"], ["paper", "AUTOREGRESSIVE"],
                                     ["paper", "SELF-SD"], ["paper", "SWIFT"], ["paper", "CLASP"]]
    assert rows[3][2:4] == ["4.00", "1.30×"]  # ours: clasp on multi-turn
    assert rows[7][2:4] == ["3.68", "1.24×"] and rows[7][-1] == "1.24×"  # the paper's CLaSp, LLaMA-3-8B
    assert rows[5][-3:-1] == ["2.33", "1.21×"]  # the paper's Self-SD on DPR


def test_selfdraft_layout_is_a_row_per_benchmark_and_marks_what_the_paper_lacks():
    preset = papers.load("selfdraft-paper")
    headers, rows = papers.table(_fake_report(preset), preset)
    assert headers[:6] == ["", "benchmark", "AR TP", "Self-Draft TP", "Self-Draft Imp.", "Self-Draft DE"]
    ours = [r for r in rows if r[0] == "ours"]
    assert [r[1] for r in ours] == ["math (GSM-100)", "multi-turn (MT-bench)", "code (MBPP-100, HumanEval)"]
    assert ours[0][3:6] == ["11.0", "+10%", "2.00"]
    paper = {r[1]: r for r in rows if r[0] == "paper"}
    assert paper["code-llama-7b HumanEval"][2:9] == ["47.4", "111.2", "+135%", "3.22", "95.1", "+101%", "2.90"]
    assert paper["llama-7b GSM-100"][-3:] == ["–", "–", "–"]  # the paper has no prompt lookup


def test_asd_layout_shows_both_summarization_datasets_in_one_cell():
    preset = papers.load("asd-paper")
    headers, rows = papers.table(_fake_report(preset), preset)
    assert headers == ["", "method", "summarization (CNN/DM, XSum) τ", "summarization (CNN/DM, XSum) speedup",
                       "code (HumanEval) τ", "code (HumanEval) speedup"]
    paper = {r[1]: r for r in rows if r[0] == "paper"}
    assert paper["D&V"][2:] == ["–", "1.50× / 1.42×", "–", "1.28×"]
    assert paper["ASD"][5] == "1.36×" and paper["vanilla"][2:] == ["–", "–", "–", "–"]


def test_a_preset_runs_as_a_bench_and_its_caption_says_whose_numbers_are_whose(tiny_lm):
    preset = papers.load("asd-paper")
    rows = [PromptRow("s-1", "summarization", prompt="abcabcabcabd"), PromptRow("c-1", "code", prompt="defdefdefdeg")]
    report = compare.run_suite(tiny_lm, rows, list(preset.methods), max_new_tokens=10, repeats=1,
                               sampling=Sampling(), progress=lambda done, total: None, stop=threading.Event())
    assert [e.label for e in preset.entries()] == list(report["methods"])
    _, table = papers.table(report, preset)
    assert len(table) == 6 and table[2][1] == "admg (ASD)"
    text = papers.caption(report, preset)
    assert "ours: tiny-llama on cpu, 2 prompts" in text and "4/4 runs identical" in text
    assert "paper: Llama-2-13B" in text
    assert papers.format_table(report, preset).count("\n") == 2 + len(table)


def test_unknown_preset_is_one_line():
    from specgui.errors import SpecGUIError

    with pytest.raises(SpecGUIError, match="unknown paper preset 'x'"):
        papers.load("x")
    assert bench.entries_for(["dv"])[0].method == "baseline"

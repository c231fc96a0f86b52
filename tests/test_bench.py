"""The bench: every method on every prompt against baseline, honest aggregates, divergence diagnosis against
the measured logit noise, and reports that survive a bench stopped part-way."""

import time

import pytest
import torch

from helpers import tiny_model
from specgui.errors import SpecGUIError
from specgui.tools import bench
from specgui.tools.bench import Run
from specgui.tools.equality import first_divergence, logit_noise
from specgui.tools.prompts import PromptRow

ROWS = [PromptRow("r1", "copy", prompt="abcdeabcd"), PromptRow("r2", "copy", prompt="uvwxuvwx"),
        PromptRow("r3", "other", prompt="hijklmnop")]


def test_bench_report_on_a_tiny_model(tiny_lm):
    # pld at its fixed sizes: the aggregates need drafts, which the cost model may pause on a tiny model
    entries = bench.entries_for(["pld", "hf-generate"], {"pld": {"policy": "fixed"}})
    report = bench.bench(tiny_lm, ROWS, entries, bench.Settings(16, repeats=2))
    methods = report["methods"]
    assert list(methods) == ["baseline", "pld", "hf-generate"]  # baseline always included, first
    assert methods["baseline"]["speedup"] == 1.0 and methods["baseline"]["mean_accepted"] == 1.0
    assert methods["pld"]["identical"] == 3 and methods["hf-generate"]["identical"] == 3
    assert methods["pld"]["ties"] == 0
    assert methods["pld"]["mean_accepted"] > 1.0 and methods["hf-generate"]["mean_accepted"] is None
    assert methods["pld"]["ceiling"] > 0 and methods["hf-generate"]["ceiling"] is None
    assert set(report["categories"]) == {"copy", "other"}
    assert len(report["per_prompt"]) == 9 and all(len(p["walls"]) == 2 for p in report["per_prompt"])
    assert report["complete"] and 0 <= report["logit_noise"] < 1e-3 and report["fast_path"] is False
    text = bench.format_report(report, profile=True)
    assert "category copy" in text and "profile" in text and "divergences" not in text
    assert "logit noise between batch shapes" in text and "INCOMPLETE" not in text
    priced = report["cost_profile"]  # the profile that priced the "predicted" column, named in the report
    assert priced["measured_at"] > 0 and priced["key"]["device"].startswith("cpu ")
    assert f"predicted by the cost profile measured {time.strftime('%Y-%m-%d', time.gmtime(priced['measured_at']))}" \
           in text and priced["key"]["device"] in text and priced["file"] in text


def test_a_stopped_bench_leaves_a_report_of_its_finished_prompts(tiny_lm):
    partials, runs = [], []

    def progress(entry, row):
        runs.append((entry.label, row.id))
        if len(runs) == 5:  # the third run of the second prompt: stop there
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench.bench(tiny_lm, ROWS, bench.entries_for(["pld", "clasp"]), bench.Settings(12), progress=progress,
                    partial=partials.append)
    assert runs[:3] == [("baseline", "r1"), ("pld", "r1"), ("clasp", "r1")]  # methods named as they finish
    [report] = partials  # only the first prompt finished
    assert report["complete"] is False and report["prompts"] == 1
    assert [p["id"] for p in report["per_prompt"]] == ["r1"] * 3
    assert "INCOMPLETE" in bench.format_report(report)


def test_logit_noise_is_measured_in_the_runs_dtype():
    fp32 = tiny_model(seed=11)
    bf16 = tiny_model(seed=11)
    bf16.model.to(torch.bfloat16)
    bf16.runner.dtype = torch.bfloat16
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25]]
    small, large = logit_noise(fp32.runner, prompts), logit_noise(bf16.runner, prompts)
    assert 0 <= small < 1e-4  # float32: last-bit differences between batch shapes
    assert large > 10 * max(small, 1e-6)  # bfloat16 keeps 8 significant bits
    assert logit_noise(fp32.runner, [[1, 2]]) == small  # measured once per runner and path


def test_divergence_is_a_near_tie_when_the_margin_is_within_the_noise():
    base = Run("p", "c", "baseline", [5, 6, 7, 8], [1.0], margins=[3.0, 2.0, 0.0004, 1.0])
    tie = bench._divergence(Run("p", "c", "m", [5, 6, 9, 8], [1.0]), base, noise=0.001)
    assert tie == {"position": 2, "baseline_token": 7, "method_token": 9, "baseline_margin": 0.0004,
                   "near_tie": True}
    assert not bench._divergence(Run("p", "c", "m", [5, 6, 9, 8], [1.0]), base, noise=0.0001)["near_tie"]
    bug = bench._divergence(Run("p", "c", "m", [5, 1, 7, 8], [1.0]), base, noise=0.001)
    assert bug["position"] == 1 and not bug["near_tie"]
    assert first_divergence([5, 6], [5, 6, 7, 8], base.margins).position == 2  # one run ended first
    assert bench._divergence(Run("p", "c", "m", [5, 6, 7, 8], [1.0]), base, noise=0.001) is None


def test_the_ceiling_prices_every_step_as_the_baselines_step_on_the_same_prompt():
    """Baseline: 1 s of prompt forward and loop, then 10 steps of 0.1 s (2 s). The method: the same 1 s, then 5
    steps of 0.16 s (1.8 s, 2 tokens a step): 2/1.8 = 1.11x measured, 2/1.5 = 1.33x had each step cost 0.1 s."""
    base = bench.Run("p", "c", "baseline", [], walls=[2.0, 9.0], steps=10, phase_ms={"draft": 0.0, "verify": 1000.0})
    run = bench.Run("p", "c", "pld", [], walls=[1.8, 9.0], steps=5, phase_ms={"draft": 50.0, "verify": 750.0})
    assert bench.ceiling([run], [base]) == pytest.approx(2.0 / 1.5)
    assert bench.ceiling([base], [base]) == pytest.approx(1.0)
    reference = bench.Run("p", "c", "hf-generate", [], walls=[2.0])
    assert bench.ceiling([reference], [base]) is None


def test_speedup_pairs_each_run_with_the_baselines_run_of_the_same_round():
    """A method that decodes as the baseline does, its median run landing in a slow phase of the machine: paired by
    round it is 0.99x, where the ratio of the two medians said 0.86x. A method twice as fast stays 2x, and prompts
    weigh by the baseline's time on them."""
    tokens = list(range(64))
    base = bench.Run("p", "c", "baseline", tokens, walls=[0.832, 0.708, 0.713])
    same = bench.Run("p", "c", "clasp", tokens, walls=[0.837, 0.833, 0.719])
    assert base.wall / same.wall == pytest.approx(0.856, abs=1e-3)
    assert bench.paired_speedup([same], [base]) == pytest.approx(0.992, abs=1e-3)
    other = bench.Run("q", "c", "baseline", tokens, walls=[3.0, 3.0, 3.0])
    fast = [bench.Run("p", "c", "m", tokens, walls=[0.416, 0.354, 0.357]),
            bench.Run("q", "c", "m", tokens, walls=[3.0, 3.0, 3.0])]
    assert bench.paired_speedup(fast[:1], [base]) == pytest.approx(2.0, abs=1e-3)
    assert bench.paired_speedup(fast, [base, other]) == pytest.approx((0.713 + 3.0) / (0.713 / 2 + 3.0), abs=1e-3)
    # sampling: rounds that stopped early at 32 tokens in half the time run at the same rate
    sampled = bench.Run("p", "c", "m", tokens, walls=[0.416, 0.354, 0.713], counts=[32, 32, 64])
    assert bench.paired_speedup([sampled], [base]) == pytest.approx(1.0, abs=1e-3)


def test_format_report_separates_ties_from_bugs():
    agg = {"tokens_per_s": 10, "speedup": 1.0, "mean_accepted": 1.5, "acceptance_rate": 0.5, "identical": 1,
           "ties": 1, "total": 3}
    report = {"model": "m", "device": "cpu", "dtype": "bfloat16", "fast_path": True, "prompts": 3,
              "max_new_tokens": 4, "repeats": 1, "complete": True, "logit_noise": 0.25,
              "sampling": {"temperature": 0.0}, "profile": {}, "methods": {"baseline": agg, "m": agg},
              "categories": {},
              "per_prompt": [
                  {"id": "p", "method": "m", "divergence": {"position": 2, "baseline_token": 7, "method_token": 9,
                                                            "baseline_margin": 0.125, "near_tie": True}},
                  {"id": "q", "method": "m", "divergence": {"position": 4, "baseline_token": 1, "method_token": 2,
                                                            "baseline_margin": 3.5, "near_tie": False}},
                  {"id": "q", "method": "hf-static", "divergence": {"position": 3, "baseline_token": 1,
                                                                    "method_token": 2, "baseline_margin": 0.5,
                                                                    "near_tie": False}}]}
    text = bench.format_report(report)
    assert "logit noise between batch shapes: 0.25" in text and "bfloat16, fast path" in text
    assert "m on p: first differs at token 2" in text and "a near-tie (within the logit noise)" in text
    assert "m on q: first differs at token 4" in text and "margin 3.5 -> NOT within the logit noise: a bug" in text
    assert "hf-static on q: first differs at token 3" in text and "margin 0.5 -> a reference on its own kernels" in text
    assert text.count("a bug") == 1  # transformers' kernels are not held to this path's noise
    assert " 1/3     1" in text  # identical and ties in their own columns


def test_variants_compare_a_method_with_itself_in_one_bench(tiny_lm):
    entries = bench.entries_for(["clasp+policy=fixed", "clasp+policy=fixed+draft_vocab=0"],
                                {"clasp": {"max_draft": 3}})
    assert [(e.label, e.method, e.params) for e in entries[1:]] == [
        ("clasp+policy=fixed", "clasp", {"max_draft": 3, "policy": "fixed"}),
        ("clasp+policy=fixed+draft_vocab=0", "clasp", {"max_draft": 3, "policy": "fixed", "draft_vocab": 0})]
    report = bench.bench(tiny_lm, ROWS[:1], entries, bench.Settings(12))
    assert list(report["methods"]) == ["baseline", "clasp+policy=fixed", "clasp+policy=fixed+draft_vocab=0"]
    assert all(m["identical"] == 1 for m in report["methods"].values())
    for bad in ("clasp+draft_vocab", "hf-generate+x=1", "nosuch+x=1"):
        with pytest.raises(SpecGUIError):
            bench.entries_for([bad])


def test_untimed_preparations_are_reported_before_the_first_timed_run(tiny_lm):
    notes = []
    bench.bench(tiny_lm, ROWS[:1], bench.entries_for(["pld"]), bench.Settings(8), prepared=notes.append)
    assert [n["what"] for n in notes] == ["baseline warmed up", "pld warmed up", "logit noise", "cost profile"]
    assert all(n["seconds"] >= 0 and n["programs"] >= 0 for n in notes)
    assert bench.preparation_line(notes[0]).startswith("baseline warmed up in ")

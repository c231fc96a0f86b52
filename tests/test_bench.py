"""The bench: every method on every prompt against baseline, honest aggregates, divergence diagnosis."""

from specgui import bench
from specgui.bench import Run
from specgui.prompts import PromptRow

ROWS = [PromptRow("r1", "copy", prompt="abcdeabcd"), PromptRow("r2", "copy", prompt="uvwxuvwx"),
        PromptRow("r3", "other", prompt="hijklmnop")]


def test_bench_report_on_a_tiny_model(tiny_lm):
    report = bench.bench(tiny_lm, ROWS, bench.entries_for(["pld", "hf-generate"]), max_new_tokens=16, repeats=2)
    methods = report["methods"]
    assert list(methods) == ["baseline", "pld", "hf-generate"]  # baseline always included, first
    assert methods["baseline"]["speedup"] == 1.0 and methods["baseline"]["mean_accepted"] == 1.0
    assert methods["pld"]["identical"] == 3 and methods["hf-generate"]["identical"] == 3
    assert methods["pld"]["mean_accepted"] > 1.0 and methods["hf-generate"]["mean_accepted"] is None
    assert set(report["categories"]) == {"copy", "other"}
    assert len(report["per_prompt"]) == 9 and all(len(p["walls"]) == 2 for p in report["per_prompt"])
    text = bench.format_report(report, profile=True)
    assert "category copy" in text and "profile" in text and "divergences" not in text


def test_divergence_names_position_and_baseline_margin():
    base = Run("p", "c", "baseline", [5, 6, 7, 8], [1.0], margins=[3.0, 2.0, 0.0004, 1.0])
    tie = bench._divergence(Run("p", "c", "m", [5, 6, 9, 8], [1.0]), base)
    assert tie == {"position": 2, "baseline_token": 7, "method_token": 9, "baseline_margin": 0.0004,
                   "near_tie": True}
    bug = bench._divergence(Run("p", "c", "m", [5, 1, 7, 8], [1.0]), base)
    assert bug["position"] == 1 and not bug["near_tie"]
    short = bench._divergence(Run("p", "c", "m", [5, 6], [1.0]), base)
    assert short["position"] == 2
    assert bench._divergence(Run("p", "c", "m", [5, 6, 7, 8], [1.0]), base) is None


def test_format_report_flags_divergences():
    report = {"model": "m", "device": "cpu", "prompts": 1, "max_new_tokens": 4, "repeats": 1,
              "sampling": {"temperature": 0.0}, "profile": {},
              "methods": {"baseline": {"tokens_per_s": 10, "speedup": 1.0, "mean_accepted": 1.0,
                                       "acceptance_rate": None, "identical": 1, "total": 1}},
              "categories": {},
              "per_prompt": [{"id": "p", "method": "m", "divergence": {
                  "position": 2, "baseline_token": 7, "method_token": 9, "baseline_margin": 0.5, "near_tie": False}}]}
    text = bench.format_report(report)
    assert "m on p: first differs at token 2" in text and "margin 0.5" in text and "a bug" in text

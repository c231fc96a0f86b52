"""The command line: real runs on the embedded model, and one-line errors for bad input."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SHORT_PROMPTS
from specgui.cli import main
from specgui.core.events import load_trace
from specgui.model import loading

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specgui", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def in_process(embedded_lm, monkeypatch, capfd):
    """`cli.main` in this process on the session's embedded model: the commands whose subject is what they
    compute, not the entry point (the generate test and `test_bad_input_through_the_real_entry_point` start
    `python -m specgui`), without importing torch, loading the model and auditing its ties again."""

    def load(spec):
        assert spec == embedded_lm.spec, f"this test expects the embedded model, got {spec}"
        return embedded_lm

    monkeypatch.setattr(loading, "load", load)

    def run(*args):
        status = main(list(args))
        out, err = capfd.readouterr()
        assert status == 0, err
        return out
    return run


def test_generate_prints_text_summary_and_writes_a_trace(tmp_path, embedded_lm):
    trace = tmp_path / "t.json"
    out = cli("generate", "--method", "pld", "--prompt", "Name three colours.", "--max-new-tokens", "12",
              "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "[pld] " in out.stderr and "tau" in out.stderr
    events = load_trace(trace)
    assert events[0].method == "pld" and events[-1].new_tokens <= 12


def test_bench_writes_json(tmp_path, in_process):
    report = tmp_path / "r.json"
    out = in_process("bench", "--methods", "hf-generate,pld", "--categories", "qa", "--limit", "1",
                     "--max-new-tokens", "8", "--json", str(report))
    data = json.loads(report.read_text())
    assert set(data["methods"]) == {"baseline", "hf-generate", "pld"}
    for figures in data["methods"].values():
        assert {"tokens_per_s", "speedup", "mean_accepted", "identical", "total"} <= set(figures)
    assert data["per_prompt"] and "category qa" in out
    assert data["provenance"]["command"] == f"python -m specgui bench --methods hf-generate,pld --categories qa " \
                                            f"--limit 1 --max-new-tokens 8 --json {report}"
    assert {"commit", "date", "device", "torch", "transformers", "python"} <= set(data["provenance"])


@pytest.mark.parametrize("preset", ["clasp-paper", "selfdraft-paper", "asd-paper"])
def test_bench_runs_a_paper_preset_and_prints_its_table(tmp_path, in_process, preset):
    """Short prompts: what is checked is the preset's layout, not the suite's prompts (the bench CLI runs
    those in `test_bench_writes_json`)."""
    from specgui.tools import papers

    paper = papers.load(preset)
    report = tmp_path / "r.json"
    out = in_process("bench", "--preset", preset, "--prompts", str(SHORT_PROMPTS), "--limit", "1",
                     "--max-new-tokens", "8", "--json", str(report))
    data = json.loads(report.read_text())
    assert list(data["methods"]) == list(paper.methods) and set(data["categories"]) == set(paper.categories)
    assert data["paper"]["preset"] == preset and paper.setting in data["paper"]["caption"]
    assert paper.title in out and [r[0] for r in data["paper"]["rows"]].count("paper") >= 2


@pytest.mark.parametrize("args, message", [
    (["generate", "--prompt", ""], "prompt is empty"),
    (["generate", "--prompt", "hi", "--method", "nope"], "unknown method"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-1"], "max-new-tokens"),
    (["generate", "--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top-p"),
    (["generate", "--prompt", "hi", "--param", "nokey"], "KEY=VALUE"),
    (["generate", "--prompt", "hi", "--method", "pld", "--param", "num_draft=-3"], "num_draft must be >= 1"),
    (["generate", "--prompt", "hi", "--method", "pld", "--param", "num_draft=99999"], "num_draft must be <= 64"),
    (["generate", "--prompt", "hi", "--model", "/no/such/model"], "no such model directory"),
    (["generate", "--prompt", "hi", "--trace", "/no/such/dir/t.json"], "does not exist"),
    (["generate"], "required"),
    (["bench", "--prompts", "/no/such.jsonl"], "not found"),
    (["bench", "--methods", "pld,zzz"], "unknown method"),
    (["bench", "--repeats", "0"], "repeats"),
    (["bench", "--categories", "poetry"], "no prompts in category"),
    (["bench", "--param", "pld.num_draft"], "KEY=VALUE"),
    (["bench", "--preset", "nope"], "unknown paper preset"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_exits_2_with_one_line(args, message, capfd):
    """In-process (`cli.main`, what `python -m specgui` calls), so that 18 cases do not import torch 18 times;
    the test below runs one of them through the real entry point."""
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert_one_line_error(status, capfd.readouterr().err, message)


def test_bad_input_through_the_real_entry_point():
    out = cli("bench", "--methods", "pld,zzz", timeout=120)
    assert_one_line_error(out.returncode, out.stderr, "unknown method")


def assert_one_line_error(status: int, stderr: str, message: str) -> None:
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert "Traceback" not in stderr


def test_malformed_jsonl_is_a_one_line_error(tmp_path, capfd):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "category": "x", "prompt": "ok"}\n{"id": "b"\n')
    assert main(["bench", "--prompts", str(bad)]) == 2 and "bad.jsonl:2: not valid JSON" in capfd.readouterr().err


def test_methods_lists_the_registry(capfd):
    assert main(["methods"]) == 0
    out = capfd.readouterr().out
    assert "baseline" in out and "num_draft" in out


def test_the_measuring_and_rendering_commands_refuse_bad_input_in_one_line(capsys, tmp_path):
    """stage-picture, presets and report check their arguments before anything loads or runs."""
    assert main(["stage-picture", "--out", str(tmp_path / "missing" / "x.png")]) == 2
    assert main(["presets", "--repeats", "0"]) == 2
    assert main(["presets", "--json", str(tmp_path / "missing" / "out.json")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("error: ") for e in errors), errors
    assert "does not exist" in errors[0] and "--repeats must be >= 1" in errors[1]


def test_presets_measures_every_demo_preset_against_baseline(in_process, tmp_path, monkeypatch):
    """One preset, one repeat, a short budget (the command reads configs/demos.yaml through the app's loader)."""
    from specgui.ui import controls

    chosen = controls.presets(controls.examples())[:1]
    monkeypatch.setattr(controls, "presets", lambda examples: [dataclasses.replace(chosen[0], max_new_tokens=8)])
    out = tmp_path / "presets.json"
    printed = in_process("presets", "--repeats", "1", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["provenance"]["command"].startswith("python -m specgui") and data["repeats"] == 1
    [row] = data["presets"]
    assert row["method"] == chosen[0].method and row["speedup"] > 0 and row["identical"] == 1 == row["total"]
    assert f"{row['speedup']:.2f}x" in printed

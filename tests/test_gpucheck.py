"""`python -m specgui gpucheck`: its quick CPU form runs every section (or says why one cannot run here), writes
both reports, and finds every method token-identical; a failing section records its error and the rest run."""

import json
import os
import subprocess
import sys
from pathlib import Path

from specgui import methods
from specgui.cli import main
from specgui.model.cachedir import cache_root
from specgui.tools import gpucheck

ROOT = Path(__file__).resolve().parent.parent
CUDA_ONLY = {"tests", "bf16", "syncs_launches"}  # the sections a CPU skips


def cli(*args, timeout=900, env=None):
    return subprocess.run([sys.executable, "-m", "specgui", "gpucheck", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def run_quick(tmp_path, sections, env=None):
    """The quick CPU form over `sections`: its exit, both reports and what it printed."""
    out = cli("--out", str(tmp_path / "gc"), "--quick", "--device", "cpu", "--sections", ",".join(sections), env=env)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    report = json.loads((tmp_path / "gc" / "report.json").read_text())
    markdown = (tmp_path / "gc" / "report.md").read_text()
    assert list(report["sections"]) == list(sections)
    for name, result in report["sections"].items():
        if name in CUDA_ONLY:  # --device cpu, even where a GPU exists
            assert result["status"] == "skipped" and "CUDA" in result["reason"], (name, result)
        else:
            assert result["status"] == "ok", (name, result.get("error"), result.get("traceback"))
            assert result["rows"] and f"## {name} (ok" in markdown
    failed = [t for t in report["targets"] if t["pass"] is False]
    assert out.returncode == (1 if failed else 0)
    assert "| section | target | measured | result |" in out.stdout
    assert gpucheck.summary_table(report) in markdown
    return report, out.stdout


def test_quick_cpu_form_runs_every_section_and_writes_both_reports(tmp_path):
    """Every section but dispatch (the test below runs it, on a cache folder of its own): both runs cover them all."""
    report, printed = run_quick(tmp_path, [name for name in gpucheck.SECTIONS if name != "dispatch"])
    sections = report["sections"]
    identity = sections["identity"]["methods"]
    assert {v["method"] for v in identity.values()} == set(methods.names())
    assert all(v["identical"] == v["total"] == 1 for v in identity.values()), identity
    assert sum(v["drafted"] for v in identity.values()) > 0  # identity of methods that never drafted proves nothing
    assert sections["bench"]["reports"]["on"]["methods"]["baseline"]["tokens_per_s"] > 0
    host = {t["target"]: t for t in sections["bench"]["targets"] if "draft + overhead" in t["target"]}
    assert set(host) == {f"{m}: draft + overhead at most {gpucheck.HOST_MS_TARGET:g} ms a step"
                         for m in gpucheck.HOST_LIGHT}  # a GPU's target: measured and shown here, judged there
    assert all(t["pass"] is None and t["measured"].endswith(")") for t in host.values())
    forms = sections["sdpa"]["forms"]  # both attention forms timed on a verify; on a CPU equal bit for bit
    assert forms["stock"]["ms"] > 0 and forms["grouped"]["ms"] > 0 and forms["grouped"]["logits"] == "equal"
    assert "| identity |" in printed
    assert sections["switch"]["targets"][0]["target"].startswith("model freed")


def test_quick_cpu_form_dispatch_section_counts_programs_reads_and_compiled_kernels(tmp_path):
    """On a cache folder of its own (the converted weights linked in), so that its compiled figures start from an empty
    compile cache: the first process compiles, the second finds every graph cached."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_root() / "models", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    report, printed = run_quick(tmp_path, ["dispatch"], env={**env, "SPECGUI_CACHE": str(cache)})
    assert_dispatch_figures(report, printed)
    assert_compiled_figures(report["sections"]["dispatch"]["compiled"], cache)


def assert_dispatch_figures(report, printed):
    """The GPU issue's CPU targets in the dispatch section: every pass one program (Fractal's spliced forward too, its
    compressed passes inside) and at most one host read per generated token, for every method drafting (the fixed
    schedule). The quick form's few tokens leave each prompt's own operations (its chunks, its head) a large share of
    a step's: the eager-operation targets are reported, and hold on the full form
    (test_dispatch.py::test_every_method_drafts_at_most_two_device_operations_a_step_beyond_plain_decodings)."""
    assert set(report["dispatch"]) == set(methods.names())
    for method, figures in report["dispatch"].items():
        assert set(figures) == {"programs_per_pass_max", "programs_per_pass_mean", "syncs_per_token",
                                "eager_ops_per_step", "host_ms", "host_critical_ms"}
        assert figures["host_ms"] > 0 and figures["host_critical_ms"] >= 0, method  # timed apart (`hosttime`)
        assert figures["eager_ops_per_step"] >= report["dispatch"]["baseline"]["eager_ops_per_step"] > 0, method
        assert 0 < figures["syncs_per_token"] <= 1.0, method
        assert figures["programs_per_pass_max"] == 1, method
    assert set(report["compiled"]) == {"kernels_per_layer", "eager_ops_per_layer", "cache_reused"}
    assert report["compiled"]["kernels_per_layer"] < report["compiled"]["eager_ops_per_layer"]
    assert "| dispatch |" in printed and "fractal: one program per pass" in printed
    assert "eager device operations a step at most plain decoding's + 2" in printed
    assert "pld: host time a step at most 1.0 ms, the part a GPU waits for at most 0.05 ms" in printed


def assert_compiled_figures(figures, cache):
    """The dispatch section's compiled figures: a compiled layer's kernels (at most 10 on a CPU: norm, q/k/v, rotary
    and cache write, attention, output, residual and norm, gate/up, activation, down, residual) against the eager
    program's operations; on an empty compile cache the first fresh process compiles, the second finds every graph
    in the cache, under the cache folder's own inductor directory."""
    assert figures["first_process"]["cache_misses"] > 0
    assert figures["cache_reused"] and figures["second_process"]["cache_misses"] == 0
    assert 0 < figures["kernels_per_layer"] <= gpucheck.KERNELS_PER_LAYER
    assert figures["eager_ops_per_layer"] > 2 * figures["kernels_per_layer"]
    assert (cache / "inductor").is_dir()


def test_bad_arguments_are_one_line_errors(tmp_path, capfd):
    """In-process (`cli.main`, what `python -m specgui` calls): the tests above go through the real entry point."""
    (tmp_path / "file").write_text("")
    for args, message in [(["--out", str(tmp_path), "--sections", "nope"], "unknown section 'nope'"),
                          (["--out", str(tmp_path / "file")], "is a file"),
                          (["--out", str(tmp_path), "--methods", "nope"], "unknown method")]:
        status = main(["gpucheck", *args])
        stderr = capfd.readouterr().err
        assert status == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_a_failing_section_records_its_error_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setitem(gpucheck.SECTIONS, "broken", broken)
    opts = gpucheck.options("cpu", quick=True, method_names=["pld"])
    report = gpucheck.run(tmp_path, opts, ["broken", "bf16"])
    assert report["sections"]["broken"]["status"] == "error"
    assert report["sections"]["broken"]["error"] == "RuntimeError: boom"
    assert report["sections"]["bf16"]["status"] == "skipped"
    assert [t["pass"] for t in report["targets"]] == [False, None]
    assert opts.methods == ("baseline", "pld")
    assert "| broken | section broken runs | RuntimeError: boom | FAIL |" in (tmp_path / "report.md").read_text()

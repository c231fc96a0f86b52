"""Results as data: provenance written by the measuring commands, tables rendered from it between markers, and a
check that fails when a rendered table no longer matches its JSON (the repository's own docs included)."""

import json
import subprocess
import sys

import pytest

from specgui import REPO_DIR
from specgui.cli import main
from specgui.errors import SpecGUIError
from specgui.tools import report, results

PROVENANCE = {"command": "python -m specgui bench --save", "commit": "0123456789abcdef", "date": "2026-11-26 19:00 UTC",
              "device": "Test CPU, 2 cores", "torch": "2.13.0", "transformers": "5.23.0", "python": "3.11.7"}


def aggregate(speedup, tau, identical=2):
    return {"tokens_per_s": 40.0 * speedup, "speedup": speedup, "predicted_speedup": speedup * 0.98,
            "ceiling": speedup * 1.1, "mean_accepted": tau, "identical": identical, "total": 2}


def write(folder, kind, data):
    path = folder / f"{kind}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": PROVENANCE, **data}), encoding="utf-8")
    return path


def test_a_block_renders_its_table_and_provenance_and_check_sees_it_stale(tmp_path):
    results_dir, docs = tmp_path / "results", tmp_path / "repo"
    write(results_dir / "cpu-test-2c", "heldout", {
        "prompts": 2, "max_new_tokens": 64, "repeats": 3, "model": "embedded", "dtype": "float32", "device": "cpu",
        "methods": {"baseline": aggregate(1.0, 1.0), "pld": aggregate(1.34, 2.5, identical=1)}})
    (docs / "docs").mkdir(parents=True)
    readme = docs / "README.md"
    readme.write_text("# Title\n\nbefore\n<!-- report:heldout -->\nold text\n<!-- /report:heldout -->\nafter\n",
                      encoding="utf-8")
    assert report.render_all(docs, results_dir, check=True) == [(readme, "heldout")]
    assert "old text" in readme.read_text(encoding="utf-8")  # --check writes nothing
    assert report.render_all(docs, results_dir) == [(readme, "heldout")]
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# Title\n\nbefore\n<!-- report:heldout -->\n") and text.endswith(
        "<!-- /report:heldout -->\nafter\n")
    assert "| `pld` | 53.6 | 1.34× | 1.31× | 1.47× | 2.50 | 1/2 |" in text
    assert "*Measured by `python -m specgui bench --save` on Test CPU, 2 cores, 2026-11-26 19:00 UTC, commit " \
           "0123456789ab, torch 2.13.0, transformers 5.23.0.*" in text
    assert report.render_all(docs, results_dir, check=True) == []  # fresh now
    write(results_dir / "cpu-test-2c", "heldout", {
        "prompts": 2, "max_new_tokens": 64, "repeats": 3, "model": "embedded", "dtype": "float32", "device": "cpu",
        "methods": {"baseline": aggregate(1.0, 1.0), "pld": aggregate(1.40, 2.5)}})
    assert report.render_all(docs, results_dir, check=True) == [(readme, "heldout")]


def test_a_block_without_results_says_how_to_measure_them_and_a_machine_can_be_named(tmp_path):
    assert report.render("suite", tmp_path).startswith("*Not measured yet: run `python -m specgui suite-time --save`")
    write(tmp_path / "cpu-a-2c", "suite", {"seconds": 400, "passed": 600, "failed": 0, "skipped": 19, "errors": 0,
                                           "exit_code": 0, "workers": 2})
    newer = {**PROVENANCE, "date": "2026-11-27 08:00 UTC"}
    (tmp_path / "cpu-b-2c").mkdir()
    (tmp_path / "cpu-b-2c" / "suite.json").write_text(json.dumps(
        {"provenance": newer, "seconds": 500, "passed": 601, "failed": 0, "skipped": 19, "errors": 0, "exit_code": 0,
         "workers": 2}), encoding="utf-8")
    assert "601 passed" in report.render("suite", tmp_path)  # the newest by its provenance date
    assert "600 passed, 19 skipped, 0 failed in 6 min 40 s" in report.render("suite:cpu-a-2c", tmp_path)
    with pytest.raises(ValueError, match="unknown report block"):
        report.render("speeds", tmp_path)


def test_presets_and_profile_tables(tmp_path):
    write(tmp_path / "m", "presets", {"model": "embedded", "repeats": 3, "presets": [
        {"name": "Answering from retrieved passages", "method": "pld", **aggregate(3.2, 7.3)}]})
    write(tmp_path / "m", "profile", {"model": "embedded", "sizes": [1, 2, 4], "contexts": [128, 512],
                                      "forward": [[20.0, 21.0, 25.0], [22.0, 23.0, 27.0]], "step": 21.5, "loop": 1.5,
                                      "head": 3.0, "draft_tokens": {"size": 8192, "context": 128, "rows": [
                                          {"layers": 6, "full_ms": 10.0, "vocab_ms": 8.0, "full_priced_ms": 12.0,
                                           "vocab_priced_ms": 9.0, "change": -0.2, "priced_change": -0.25}]}})
    assert "| Answering from retrieved passages | `pld` | 3.20× | 3.14× | 3.52× | 7.30 | 2/2 |" in report.render(
        "presets", tmp_path)
    profile = report.render("profile", tmp_path)
    assert "| 4 | 25.00 | 1.25× |" in profile
    assert "draft vocabulary of 8192 ids" in profile and "| 6 | 10.00 (12.00) | 8.00 (9.00) | -20% (-25%) |" in profile


def test_provenance_names_the_command_commit_device_and_versions():
    p = results.provenance("cpu", ["bench", "--save"])
    assert p["command"] == "python -m specgui bench --save"
    assert p["commit"] is None or len(p["commit"].removesuffix("-dirty")) == 40
    assert "cores" in p["device"] and p["torch"] and p["transformers"] and p["python"]
    assert results.measured_at({"provenance": p}).utcoffset().total_seconds() == 0  # an ISO date, in UTC
    assert results.machine_slug("cpu").startswith("cpu-") and results.machine_slug("cpu").endswith("c")
    with pytest.raises(ValueError, match="provenance"):
        results.save("suite", {"seconds": 1})


def test_a_commit_is_dirty_when_code_differs_not_when_only_results_or_their_markdown_do(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "results").mkdir()
    for name, text in (("code.py", "x = 1\n"), ("README.md", "a\n"), ("results/heldout.json", "{}\n")):
        (tmp_path / name).write_text(text)
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = results.commit(tmp_path)
    assert head is not None and len(head) == 40
    (tmp_path / "results" / "heldout.json").write_text('{"a": 1}\n')  # a measurement not yet committed
    (tmp_path / "README.md").write_text("b\n")  # and the table it renders
    assert results.commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.commit(tmp_path) == head + "-dirty"


def test_the_newest_result_wins_whatever_its_date_format_and_a_dirty_commit_says_so(tmp_path):
    """Files written before provenance dates were ISO ('2026-11-26 19:27 UTC') still sort and render."""
    suite = {"seconds": 60, "passed": 1, "failed": 0, "skipped": 0, "errors": 0, "exit_code": 0, "workers": 2}
    write(tmp_path / "old", "suite", {**suite, "passed": 5})
    newer = {**PROVENANCE, "date": "2026-11-26T19:05:09+00:00", "commit": "0123456789abcdef-dirty"}
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "suite.json").write_text(json.dumps({"provenance": newer, **suite}), encoding="utf-8")
    text = report.render("suite", tmp_path)
    assert "1 passed" in text and ", 2026-11-26 19:05 UTC, commit 0123456789ab-dirty, torch" in text


def test_suite_time_runs_the_pytest_part_of_readmes_test_command(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("## Development\n<!-- test-command -->\n```\npython3 -m venv .venv && .venv/bin/ruff check . && "
                      ".venv/bin/python -m pytest -q -n 2 --dist loadfile && .venv/bin/python -m specgui report "
                      "--check\n```\n", encoding="utf-8")
    assert results.suite_command(readme) == [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]
    assert results.suite_counts("...\n1 failed, 650 passed, 19 skipped, 2 errors in 402.57s (0:06:42)\n") == {
        "passed": 650, "failed": 1, "skipped": 19, "errors": 2}
    readme.write_text("no command here\n", encoding="utf-8")
    with pytest.raises(SpecGUIError, match="no pytest command"):
        results.suite_command(readme)


def test_gpucheck_puts_provenance_in_its_report_and_save_writes_the_standard_file(tmp_path, monkeypatch):
    """The bf16 section is skipped on a CPU: the cheapest run of the real command."""
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "results")
    out = tmp_path / "check"
    assert main(["gpucheck", "--out", str(out), "--sections", "bf16", "--device", "cpu", "--save"]) == 0
    written = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert written["provenance"]["command"] == f"python -m specgui gpucheck --out {out} --sections bf16 --device " \
                                               "cpu --save"
    saved = tmp_path / "results" / results.machine_slug("cpu") / "gpucheck.json"
    assert json.loads(saved.read_text(encoding="utf-8"))["provenance"] == written["provenance"]
    text = report.render("gpucheck", tmp_path / "results")
    assert "| bf16 |" in text and text.rstrip().endswith(".*") and "*Measured by `python -m specgui gpucheck" in text


def test_the_repositorys_rendered_blocks_match_their_results(capsys):
    """What CI relies on: every table in README.md and docs/ is the one its JSON gives."""
    assert main(["report", "--check"]) == 0, capsys.readouterr().out
    assert report.documents(REPO_DIR)[0].name == "README.md"


def test_a_run_of_a_forced_vector_form_has_a_folder_of_its_own_and_renders_only_where_named(tmp_path, monkeypatch):
    """`SPECGUI_SIMD=avx2` on an AVX-512 CPU measures a laptop's kernels: its results go to '<machine>-avx2', carry
    the form, and never stand in for the machine's own figures in an unnamed block."""
    from specgui.cpu import kernels

    profile = {"model": "embedded", "sizes": [1, 2], "contexts": [128], "forward": [[20.0, 21.0]], "step": 21.5,
               "loop": 1.5, "head": 3.0}
    write(tmp_path / "own", "profile", {**profile, "simd": "avx512"})
    forced = {**PROVENANCE, "date": "2026-11-27T19:00:00+00:00", "simd": "avx2+fma", "simd_forced": True}
    (tmp_path / "own-avx2").mkdir()
    (tmp_path / "own-avx2" / "profile.json").write_text(json.dumps({"provenance": forced, **profile, "forward": [
        [30.0, 33.0]], "simd": "avx2+fma"}), encoding="utf-8")
    assert "| 2 | 21.00 | 1.05× |" in report.render("profile", tmp_path)  # the newer forced run is not the default
    assert "Skinny kernels: avx512." in report.render("profile", tmp_path)
    named = report.render("profile:own-avx2", tmp_path)
    assert "| 2 | 33.00 | 1.10× |" in named and "Skinny kernels: avx2+fma." in named
    if kernels.best_simd() != "avx512":
        pytest.skip("no AVX-512 here: AVX2 is this CPU's own form, nothing to force")
    monkeypatch.setenv("SPECGUI_SIMD", "avx2")
    kernels.reset()
    try:
        p = results.provenance("cpu", ["profile", "--save"])
        assert results.machine_slug("cpu").endswith("c-avx2") and p["simd_forced"]
        assert p["command"] == "SPECGUI_SIMD=avx2 python -m specgui profile --save"
        monkeypatch.setenv("SPECGUI_SIMD", "avx512")  # the CPU's own form, named: the machine's own folder
        kernels.reset()
        assert results.machine_slug("cpu").endswith("c") and not results.provenance("cpu", [])["simd_forced"]
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_the_first_start_paragraph_states_both_starts_and_each_race_beside_its_prediction(tmp_path):
    race = {"method": "pld", "overall": 2.3, "predicted": 2.4, "per_step": 2.5,
            "prefill_ms": {"method": 700.0, "baseline": 680.0}}
    write(tmp_path / "cpu-a-2c", "startup", {"cold": {"running_s": 95.2, "calibrated_s": 140.0},
                                             "warm": {"running_s": 9.6, "calibrated_s": 31.0}, "races": [race, race]})
    text = report.render("startup", tmp_path)
    assert text.startswith("From a fresh cache folder (the GGUF converted, the C kernel built, the cost profile "
                           'measured) a first start took 95 s to the page\'s "Running on" and 140 s to the end of its '
                           'calibration; a later start took 10 s to the page\'s "Running on" and 31 s')
    assert "| 1 | `pld` | 2.30× | 2.40× | 700 / 680 |" in text and "| 2 | `pld` |" in text
    assert "python -m specgui first-minute" in report.COMMANDS["startup"]

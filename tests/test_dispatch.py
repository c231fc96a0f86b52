"""What a decode would cost the host on a GPU, counted on a CPU (`specgui.dispatch`): programs per forward pass and
host reads per generated token, for every method on the fast path, and the `gpucheck --sections dispatch` report."""

import json

import pytest
import torch

from helpers import tiny_model
from specgui import decode, dispatch, fastpath, methods
from specgui.cli import main
from specgui.methods.fractal import fractal_positions


def test_the_counter_sees_every_kind_of_host_read_and_nothing_outside_it():
    t = torch.tensor([1.0, 2.0])
    with dispatch.counting() as counts:
        t.sum().item()
        t.tolist()
        bool(t[0] > 0)
        int(t[1])
        float(t[0])
        _ = t[[0, 1]]  # a Python list as an index: uploaded to the tensor's device first
        _ = t[0:1]  # a slice reads nothing
        t.cpu()
    assert counts.reads == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "__float__": 1, "list index": 1,
                            "cpu": 1}
    t.sum().item()  # outside: not counted
    assert sum(counts.reads.values()) == 7


def test_a_plain_step_on_the_fast_path_is_one_program_and_one_read():
    """Baseline over the static cache: every pass is the whole-forward program, and a step reads the device once
    (its verdict); the step clock's read follows that read, so it waits for nothing."""
    lm = tiny_model(seed=3)
    decode.run(lm, [1, 2, 3, 4], "baseline", max_new_tokens=4, fast_path="on")  # programs made
    with dispatch.counting() as counts:
        result = decode.run(lm, [1, 2, 3, 4], "baseline", max_new_tokens=12, fast_path="on")
        counts.tokens += len(result.token_ids)
    summary = counts.summary()
    assert summary["passes"] == 12 and set(counts.programs) == {1}  # the prompt forward and 11 steps
    assert summary["programs_per_pass_max"] == 1 and summary["programs_per_pass_mean"] == 1.0
    assert "step clock" not in counts.reads and summary["syncs_per_token"] == 1.0


def test_an_unsynced_clock_read_is_counted():
    with dispatch.counting() as counts:
        clock = decode._Clock(torch.device("cpu"))
        clock.mark()
        clock.read()
        clock.read(synced=True)
    assert counts.reads["step clock"] == 1


@pytest.mark.parametrize("method", ["admg", "clasp", "swift"])
def test_a_skipping_or_recording_pass_is_one_program(method):
    """Layer-skip drafts, CLaSp's recording verify and SWIFT's scoring run one program a pass, whatever they skip."""
    lm = tiny_model(seed=3)
    prompt = [1, 2, 3, 4, 5, 6] * 3
    decode.run(lm, prompt, method, max_new_tokens=4, fast_path="on")
    with dispatch.counting() as counts:
        decode.run(lm, prompt, method, max_new_tokens=16, fast_path="on")
    assert set(counts.programs) == {1}


@pytest.mark.parametrize("method", methods.names())
def test_counting_changes_no_token(method):
    lm = tiny_model(seed=3)
    plain = decode.run(lm, [5, 6, 7, 5, 6], method, max_new_tokens=10, fast_path="on").token_ids
    with dispatch.counting():
        counted = decode.run(lm, [5, 6, 7, 5, 6], method, max_new_tokens=10, fast_path="on").token_ids
    assert counted == plain
    assert fastpath.StaticPass.call.__name__ == "call"  # put back afterwards


def test_gpucheck_dispatch_section_holds_every_method_to_one_program_a_pass_and_one_read_a_token(tmp_path, capsys):
    """The GPU issue's CPU targets: every pass one program and at most one host read per generated token, for every
    method drafting (the fixed schedule). Fractal's spliced forward is one program per piece: its n + 1 stretches of
    the target's layers between n fractal layers, and each compressed pass (docs/gpu.md says why)."""
    status = main(["gpucheck", "--out", str(tmp_path), "--quick", "--device", "cpu", "--sections", "dispatch"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["dispatch"]) == set(methods.names())
    for method, figures in report["dispatch"].items():
        assert set(figures) == {"programs_per_pass_max", "programs_per_pass_mean", "syncs_per_token"}
        assert 0 < figures["syncs_per_token"] <= 1.0, method
        params = methods.params_for("fractal", "random:tiny", "cpu", {"policy": "fixed"})
        pieces = len(fractal_positions(4, params)) + 1  # random:tiny has 4 layers
        assert figures["programs_per_pass_max"] == (pieces if method == "fractal" else 1), method
    assert status == (1 if pieces > 1 else 0)  # the section's Fractal target: reported, not hidden
    out = capsys.readouterr().out
    assert "| dispatch |" in out and "fractal: one program per pass" in out

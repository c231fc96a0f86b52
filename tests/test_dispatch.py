"""What a decode would cost the host on a GPU, counted on a CPU (`specgui.tools.dispatch`): programs per forward pass
and host reads per generated token, for every method on the fast path, and the `gpucheck --sections dispatch` report."""


import pytest
import torch

from helpers import tiny_model
from specgui import costs, fastpath, methods
from specgui.core import decode
from specgui.core.clock import Clock
from specgui.core.events import Step
from specgui.tools import dispatch, gpucheck


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
    # chained on the device: each step launched before the one before it is read, so the device waits for a host's
    # read once, at the first step (its id comes from the prompt forward's read); serially at every step
    with dispatch.counting() as serial:
        serial.steps = len(decode.run(lm, [1, 2, 3, 4], "baseline", max_new_tokens=12, fast_path="on",
                                      pipeline=False).steps)
    assert counts.waited == 1 and serial.waited == serial.steps == 11


def test_an_unsynced_clock_read_is_counted():
    with dispatch.counting() as counts:
        clock = Clock(torch.device("cpu"))
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


def test_every_method_drafts_at_most_two_device_operations_a_step_beyond_plain_decodings():
    """The GPU issue's eager target, over enough steps that each prompt's own operations (its chunks, its head) are a
    small share: a drafting step's host work stays on the host and its device work in the programs (the one upload,
    the one read), on any device. The full form, on the embedded model: `gpucheck --sections dispatch`; its quick
    form's figures are checked in test_gpucheck.py."""
    lm = tiny_model(seed=3)
    prompts = [[1, 2, 3, 4, 5, 6] * 3, [7, 3, 9, 2, 7, 3, 9, 4] * 2]
    per_step = {method: gpucheck.dispatch_counts(lm, method, prompts, 48)["eager_ops_per_step"]
                for method in methods.names()}
    assert all(ops <= per_step["baseline"] + gpucheck.EAGER_OPS_SLACK for ops in per_step.values()), per_step


def test_the_counter_sees_device_operations_between_programs_only():
    """Operations on the model's device count, by name, outside program calls; views and allocations launch nothing;
    what a program's function runs (captured on a GPU) does not count; nothing counts before a pass names the device."""
    lm = tiny_model(seed=3)
    t = torch.ones(4)
    with dispatch.counting() as counts:
        t + 1  # no pass yet: no device known
        assert not counts.eager
        cache = fastpath.cache_for(lm.runner, 8)
        with torch.inference_mode():
            lm.runner.forward(torch.tensor([1, 2]), torch.arange(2), cache)
        before = sum(counts.eager.values())
        (t * 2).view(2, 2).sum()
        torch.empty(3)
    assert sum(counts.eager.values()) - before == 2 and counts.eager["mul"] >= 1 and counts.eager["sum"] >= 1
    assert "index_copy_" not in counts.eager  # the cache's writes happen inside the forward's program


def test_a_paused_method_costs_what_a_plain_step_costs():
    """Priced so that no draft pays (a forward's cost grows with its rows), every method that pauses takes plain steps
    with plain decoding's device operations and reads, step for step. Lookahead's Jacobi window rides only until its
    pool first offers a candidate the cost model can price (the window is how the pool fills): from its pause on, its
    steps are plain ones too."""
    lm = tiny_model(init=0.3)
    layers, ms = lm.runner.num_layers, 10.0
    steep = costs.CostProfile(key=costs.profile_key(lm, True), sizes=[1, 64], contexts=[128], forward=[[ms, 64 * ms]],
                              step=ms, attn=[ms / (2 * layers)] * layers, mlp=[ms / (2 * layers)] * layers,
                              head=ms / 10)
    ids = [1, 5, 9, 3, 7, 2, 11, 4, 1, 5, 9, 3, 7, 2]

    def per_step(method: str) -> list[tuple[int, int, int]]:
        """(draft tokens, device operations, host reads) of every step of a run: serial, so that a step's are what ran
        between its event and the one before (pipelined, a step's event follows the next step's launch)."""
        list(decode.generate(lm, ids, method, max_new_tokens=6, fast_path="on", profile=steep))  # programs made
        found, before = [], (0, 0)
        with dispatch.counting() as counts:
            for event in decode.generate(lm, ids, method, max_new_tokens=16, fast_path="on", profile=steep,
                                         pipeline=False):
                now = (sum(counts.eager.values()), sum(counts.reads.values()))
                if isinstance(event, Step):
                    found.append((len(event.draft_tokens), now[0] - before[0], now[1] - before[1]))
                    windows.append(bool(event.payload.get("window")))
                before = now
        return found

    windows: list[bool] = []
    plain = per_step("baseline")
    assert len(set(plain)) == 1 and plain[0][0] == 0
    for method in methods.names():
        windows.clear()
        steps = per_step(method)
        if method == "lookahead":  # the window's steps first, then plain ones for good
            warm = windows.index(False)
            assert warm < len(steps) // 2 and not any(windows[warm:]), windows
            steps = steps[warm:]
        assert steps == plain[: len(steps)], method

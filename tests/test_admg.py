"""ADMG / ASD: the prompt's attention similarities, the removal rules, the adaptive exit in the events."""

import numpy as np
import pytest
import torch

from helpers import assert_greedy_identical, assert_sampling_lossless, tiny_model
from specgui import costs, fastpath
from specgui.core import decode
from specgui.core.kvcache import KVCache
from specgui.methods.layerskip.admg import AcsMeter, admg_plan
from specgui.methods.layerskip.skipdp import HiddenRecorder
from specgui.tools import dispatch


def test_rules_threshold_every_mth_layer_and_keep_the_last():
    acs = [0.5, 0.95, 0.7, 0.8, 0.99, 0.6, 0.97, 0.4, 0.92, 0.3, 0.99, 0.99]
    plan = admg_plan(acs, alpha=0.9, every=4, keep_last=2)
    # paper layers 4 and 8 (indices 3, 7) go whole; attention >= 0.9 goes unless in the last 2 layers
    assert plan.mlp == {3, 7}
    assert plan.attn == {1, 3, 4, 6, 7, 8}


def test_rules_always_leave_a_draft_model():
    acs = [0.2, 0.6, 0.5, 0.9]
    assert admg_plan(acs, alpha=0.99, every=0, keep_last=2).to_dict() == {"attn": [1], "mlp": []}
    assert admg_plan(acs, alpha=0.99, every=0, keep_last=10).to_dict() == {"attn": [0], "mlp": []}


def test_acs_is_the_mean_cosine_across_each_attention(tiny_lm):
    ids = torch.tensor([4, 8, 15, 16, 23, 42, 7, 7, 1])
    meter, recorder = AcsMeter(4, torch.device("cpu")), HiddenRecorder()
    with torch.no_grad():
        tiny_lm.runner.forward(ids, torch.arange(9), KVCache(), observer=lambda k, h: (meter(k, h), recorder(k, h)))
    for layer in range(4):
        before, after = recorder.states[2 * layer][0], recorder.states[2 * layer + 1][0]  # [T, H]
        expected = torch.nn.functional.cosine_similarity(before, after, dim=-1).mean()
        assert meter.acs(meter.sums.tolist())[layer] == pytest.approx(float(expected), abs=1e-6)


def test_the_fast_paths_recorded_states_give_the_same_acs_in_a_few_operations(tiny_lm):
    """On the fast path the meter takes the recording program's states whole (`AcsMeter.stack`), a long prompt's
    chunk by chunk: the same similarities as one state at a time, in a few device operations a chunk."""
    ids = np.array([4, 8, 15, 16, 23, 42, 7, 7, 1] * 20)  # 180 tokens: two chunks of the largest bucket
    eager = AcsMeter(4, torch.device("cpu"))
    fast = AcsMeter(4, torch.device("cpu"))
    ops = []
    with torch.inference_mode():
        tiny_lm.runner.forward(ids, np.arange(len(ids)), KVCache(), observer=eager)
        cache = fastpath.cache_for(tiny_lm.runner, len(ids))
        for observer in (None, fast):
            cache.crop(0)
            with dispatch.counting() as counts:
                tiny_lm.runner.forward(ids, np.arange(len(ids)), cache, observer=observer, logits_rows=slice(-1, None))
            ops.append(sum(counts.eager.values()))
    assert fast.rows == eager.rows == len(ids)
    assert fast.acs(fast.sums.tolist()) == pytest.approx(eager.acs(eager.sums.tolist()), abs=1e-5)
    assert ops[1] - ops[0] <= 3 * 2  # per chunk: the similarities, their sums, into the meter's


def test_events_carry_acs_skip_set_and_adaptive_exit(tiny_lm):
    params = {"policy": "fixed", "exit_threshold": 0.5, "target_acceptance": 0.99, "exit_step": 0.5}
    result = decode.run(tiny_lm, [1, 2, 3, 4, 5, 6], "admg", max_new_tokens=30, params=params)
    prefill = result.events[1].payload
    assert len(prefill["acs"]) == 4 and prefill["skip"]["attn"]
    # a step that drafted used the prompt's skip set; one that drafted nothing (the budget's last) skipped nothing
    assert all(s.payload["skip"] == (prefill["skip"] if s.drafted else {"attn": [], "mlp": []}) for s in result.steps)
    assert sum(1 for s in result.steps if s.drafted) > len(result.steps) // 2
    thresholds = [s.payload["exit"]["threshold"] for s in result.steps]
    # a random tiny model misses the 99% acceptance target and is never 50% sure: the exit gets stricter
    assert thresholds[0] == 0.5 and thresholds[-1] > 0.5


def test_always_drafting_is_lossless(tiny_lm):
    params = {"policy": "fixed", "exit_threshold": 0.0, "exit_step": 0.0, "every": 2, "keep_last": 1}
    assert_greedy_identical(tiny_lm, "admg", [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7, 6, 5]], 30, params=params)
    sampling_lm = tiny_model(vocab=12, layers=3, hidden=32, init=0.5, seed=1)
    assert_sampling_lossless(sampling_lm, "admg", [5, 3, 8, 1, 0, 11, 7, 2, 9, 4, 6, 10], runs=1500, params=params)


def test_the_skip_sets_program_is_made_only_when_a_step_drafts_with_it():
    """ADMG's set is new with every prompt. Adopted at the prompt, its draft program was made in the run's timed prefill
    (a capture on a GPU) even where the policy then paused all run long; now a paused run makes none and counts plain
    decoding's programs, operations and reads but for the prompt's similarities, and a drafting run makes them once."""
    lm = tiny_model(init=0.3)
    layers, ms = lm.runner.num_layers, 10.0

    def priced(forward: list[float]) -> costs.CostProfile:  # sub-layers: half a forward each kind
        return costs.CostProfile(key=costs.profile_key(lm, True), sizes=[1, 64], contexts=[128], forward=[forward],
                                 step=ms, attn=[ms / (2 * layers)] * layers, mlp=[ms / (2 * layers)] * layers,
                                 head=ms / 10)

    steep, flat = priced([ms, 64 * ms]), priced([ms, ms])  # a verify of two rows: twice a step, or one
    ids, params = [1, 5, 9, 3, 7, 2, 11, 4, 1, 5, 9, 3, 7, 2], {"alpha": 0.0, "keep_last": 0, "exit_threshold": 0.0}
    list(decode.generate(lm, ids, "baseline", max_new_tokens=4, fast_path="on", profile=steep))  # programs made
    fastpath.skips.warm_up(lm.runner.static_cache, range(1, 33))  # and chained layer-skip steps', any plan's (setup's)

    def counted(method: str, profile: costs.CostProfile) -> tuple[decode.Result, int, tuple[int, int, int]]:
        """The run, the programs it made, and its passes' programs, device operations and reads."""
        made = fastpath.stats(lm.runner)["programs"]
        with dispatch.counting() as counts:
            result = decode.run(lm, ids, method, max_new_tokens=16, fast_path="on", profile=profile,
                                params=params if method == "admg" else None)
        return result, fastpath.stats(lm.runner)["programs"] - made, (
            sum(counts.programs), sum(counts.eager.values()), sum(counts.reads.values()))

    plain, _, plain_counts = counted("baseline", steep)
    paused, made, paused_counts = counted("admg", steep)
    assert not any(s.drafted for s in paused.steps) and made == 0
    assert paused_counts[0] == plain_counts[0] and paused_counts[2] == plain_counts[2]
    acs_ops = paused_counts[1] - plain_counts[1]  # the prompt's similarities: a few operations per attention
    assert 0 < acs_ops <= 4
    drafting, made, _ = counted("admg", flat)
    # once: the set's draft forward, plain, ending in its head and chained (`fastpath.adopt`)
    assert sum(s.drafted for s in drafting.steps) > 2 and made == 3
    assert drafting.token_ids == paused.token_ids == plain.token_ids

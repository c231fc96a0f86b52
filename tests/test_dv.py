"""Draft & Verify: the offline search's objective, its disk cache per model, and the run that uses its set.

Losslessness with the presets (greedy on tiny and embedded models, sampling) is in test_lossless.py.
"""

import itertools
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from helpers import assert_greedy_identical, baseline_run, tiny_model
from specgui import cli, methods
from specgui.core import decode
from specgui.core.runner import SkipPlan
from specgui.costs import CostProfile
from specgui.costs import profile_for as costs_for
from specgui.errors import SpecGUIError
from specgui.methods.layerskip import dv

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 7, 8, 9, 10]
QUICK = {"iterations": 6, "init_points": 3, "calibration": "chat-001,code-001", "calibration_tokens": 10,
         "max_draft": 3, "policy": "fixed"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def deep_lm():
    return tiny_model(layers=6, init=0.3, seed=7)


def test_predicted_speedup_weighs_acceptance_against_draft_and_verify_cost():
    costs = dv.Costs(attn=(0.01,) * 100, mlp=(0.02,) * 100, verify=(1.0, 1.1, 1.2, 1.6))
    assert dv.predicted_speedup(0.0, 0.5, costs) == pytest.approx((1 / (0.5 + 1.1), 1))  # nothing accepted
    speedup, k = dv.predicted_speedup(0.9, 0.3, costs)
    expected = max(((1 - 0.9 ** (j + 1)) / 0.1 / (j * 0.3 + costs.verify[j]), j) for j in (1, 2, 3))
    assert (speedup, k) == pytest.approx(expected) and k == 2  # a 4-token verify costs too much
    assert costs.draft(SkipPlan(attn=frozenset({0, 1}), mlp=frozenset({2}))) == pytest.approx(1 - 0.02 - 0.02)
    assert costs.draft(SkipPlan(attn=frozenset(range(100)), mlp=frozenset(range(100)))) == 0.02  # floor


def test_costs_come_from_the_profile_relative_and_never_fall_with_more_tokens():
    profile = CostProfile(key={}, sizes=[1, 2, 4, 8], contexts=[16, 64], forward=[[10, 10, 14, 12], [12, 12, 16, 20]],
                          step=11.0, attn=[2.0, 3.0], mlp=[3.0, 3.0], head=0.5)
    costs = dv.Costs.of(profile, context=64, max_draft=4)
    assert costs.attn == (0.2, 0.3) and costs.mlp == (0.3, 0.3) and costs.floor == 0.05
    plain = 12 + 1  # the forward at context 64 plus the loop's 1 ms
    assert costs.verify == pytest.approx((1.0, 1.0, 15 / plain, 17 / plain, 18 / plain))  # 1 .. K + 1 tokens
    assert costs.draft(SkipPlan(attn=frozenset({1}), mlp=frozenset({0}))) == pytest.approx(0.4)
    assert costs.draft(SkipPlan(attn=frozenset({0, 1}), mlp=frozenset({0, 1}))) == 0.05  # the head stays


def test_calibration_is_the_full_models_greedy_text(deep_lm):
    with torch.no_grad():
        sample = dv.calibrate(deep_lm.runner, deep_lm.tokenizer, ["code-001"], 8)[0]
    assert sample.cache.get_seq_length(0) == sample.prefix  # only the prompt's keys stay
    from specgui.core.text import encode_prompt
    from specgui.tools.prompts import load_prompts

    row = next(r for r in load_prompts(dv.CALIBRATION_PROMPTS) if r.id == "code-001")
    prompt = encode_prompt(deep_lm.tokenizer, row.preview, chat=False)
    base = decode.run(deep_lm, prompt, "baseline", max_new_tokens=8)
    assert sample.text == base.token_ids


def test_unknown_calibration_prompt_is_refused(deep_lm, cache_dir):
    with pytest.raises(SpecGUIError, match="no prompt nope"):
        decode.run(deep_lm, PROMPT, "dv", max_new_tokens=4, params={**QUICK, "calibration": "nope"})


def test_calibration_prompts_count_once_and_at_most_sixteen(deep_lm, cache_dir):
    """Each calibration sample keeps a prefilled cache through the search: one id repeated 500 times took 23 GB."""
    assert dv.calibration_ids(" chat-001, code-001,chat-001 ,,") == ["chat-001", "code-001"]
    same = methods.params_for("dv", "tiny", "cpu", {**QUICK, "calibration": "chat-001,code-001,chat-001"})
    plain = methods.params_for("dv", "tiny", "cpu", QUICK)
    assert dv.cache_path(deep_lm.runner, same) == dv.cache_path(deep_lm.runner, plain)
    many = ",".join(f"chat-{i:03d}" for i in range(1, 18))
    with pytest.raises(SpecGUIError, match=r"dv\.calibration names 17 prompts; a search takes at most 16"):
        decode.run(deep_lm, PROMPT, "dv", max_new_tokens=4, params={**QUICK, "calibration": many})


def test_a_public_deployment_searches_only_its_configured_setting(deep_lm, cache_dir, monkeypatch):
    """A visitor's search setting (5000 iterations: about an hour) would hold the one device: on a public server only
    the configured setting searches; a set already cached still runs."""
    monkeypatch.setenv("SPECGUI_PUBLIC", "1")
    with pytest.raises(SpecGUIError, match="searches dv's skip set only with its configured setting"):
        decode.run(deep_lm, PROMPT, "dv", max_new_tokens=4, params=QUICK)
    monkeypatch.setenv("SPECGUI_PUBLIC", "0")
    decode.run(deep_lm, PROMPT, "dv", max_new_tokens=4, params=QUICK)  # searched and cached here
    monkeypatch.setenv("SPECGUI_PUBLIC", "1")
    assert decode.run(deep_lm, PROMPT, "dv", max_new_tokens=4, params=QUICK).events[1].payload["search"]["cached"]
    found = dv.SkipSetResult(attn=[1], mlp=[], objective=1.0, matchness=1.0, draft_cost=0.5, draft_len=3,
                             iterations=0, seconds=0.0, trace=[1.0])
    monkeypatch.setattr(dv, "search", lambda *args: found)  # the configured setting searches (quickly, here)
    result = decode.run(deep_lm, PROMPT, "dv", max_new_tokens=4)
    assert result.events[1].payload["search"]["cached"] is False and result.events[1].payload["skip"]["attn"] == [1]


def test_search_scores_probes_random_and_bayesian_sets_and_keeps_the_best(deep_lm):
    params = methods.params_for("dv", "tiny", "cpu", QUICK)
    with torch.no_grad():
        samples = dv.calibrate(deep_lm.runner, deep_lm.tokenizer, ["chat-001", "code-001"], 10)
        costs = dv.Costs.of(costs_for(deep_lm, fast_path=False), samples[0].prefix, params.max_draft)
        found = dv.search(deep_lm.runner, samples, params, costs)
    assert found.iterations == 3 + 3 + 6  # three probes, the random start, the Bayesian steps
    assert found.trace == sorted(found.trace) and found.objective == found.trace[-1]
    assert found.attn or found.mlp
    assert 0.0 <= found.matchness <= 1.0 and found.draft_cost == pytest.approx(costs.draft(found.plan), abs=0.2)


def test_search_runs_once_per_model_then_comes_from_the_disk_cache(deep_lm, cache_dir):
    first = decode.run(deep_lm, PROMPT, "dv", max_new_tokens=20, params=QUICK)
    found = first.events[1].payload
    assert found["search"]["cached"] is False and found["search"]["iterations"] == 12
    files = list((cache_dir / "skipsets").glob("dv-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["attn"] == found["skip"]["attn"]
    second = decode.run(deep_lm, PROMPT, "dv", max_new_tokens=20, params=QUICK)
    assert second.events[1].payload == {**found, "search": {**found["search"], "cached": True}}
    assert second.token_ids == first.token_ids
    for step in second.steps:
        assert step.payload["skip"] == (found["skip"] if step.drafted else {"attn": [], "mlp": []})

    def cached(lm):
        return decode.run(lm, PROMPT, "dv", max_new_tokens=4, params=QUICK).events[1].payload["search"]["cached"]

    assert cached(tiny_model(layers=6, init=0.3, seed=8)) is False  # same shape, other weights: its own search
    files[0].write_text("{not json")  # a damaged file is searched again
    assert cached(deep_lm) is False
    assert len(list((cache_dir / "skipsets").glob("dv-*.json"))) == 2


def test_the_search_is_not_timed_as_part_of_the_run(deep_lm, cache_dir, monkeypatch):
    """The paper searches offline: a model's first D&V run pays the search before its clock starts (in the app
    it once made the first run's prefill 38 s, and its race replayed that)."""
    real = dv.search

    def slow(*args, **kwargs):
        time.sleep(2.0)  # far longer than the whole run: it must not show in the run's timings
        return real(*args, **kwargs)

    monkeypatch.setattr(dv, "search", slow)
    result = decode.run(deep_lm, PROMPT, "dv", max_new_tokens=8, params=QUICK)
    assert result.events[1].payload["search"]["cached"] is False  # this run did search
    assert result.events[1].ms < 2000 and result.summary.wall_s < 2.0


def test_a_search_setting_has_its_own_cache_entry(deep_lm, cache_dir):
    a = dv.cache_path(deep_lm.runner, methods.params_for("dv", "tiny", "cpu", QUICK))
    b = dv.cache_path(deep_lm.runner, methods.params_for("dv", "tiny", "cpu", {**QUICK, "iterations": 7}))
    c = dv.cache_path(deep_lm.runner, methods.params_for("dv", "tiny", "cpu", {**QUICK, "exit_step": 0.5}))
    assert a != b and a == c  # the exit rule does not change the search


def test_greedy_identical_with_the_searched_set(deep_lm, cache_dir):
    prompts = [PROMPT, [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]
    assert_greedy_identical(deep_lm, "dv", prompts, max_new_tokens=40, params=QUICK)


def test_cli_checks_search_settings_before_loading_a_model(capsys):
    assert cli.main(["dv-search", "--param", "iterations=-1"]) == 2
    assert "iterations must be >= 0" in capsys.readouterr().err


def test_cli_searches_in_a_fresh_process():
    """`dv-search` in a process of its own (what a GPU lease runs ahead of its check): it prices the search with the
    cost profile, whose plain steps need the decode loop that nothing else there imports."""
    done = subprocess.run([sys.executable, "-m", "specgui", "dv-search", "--model", "random:tiny",
                           *(f"--param={k}={v}" for k, v in {**QUICK, "iterations": 0, "init_points": 1}.items())],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(("searched: ", "cached: ")) and "sets scored in" in done.stdout


def gpu_like(lm) -> CostProfile:
    """A hand-made profile shaped like a GPU's: a verify of any rows costs a plain step, and the sub-layers, each timed
    as a program of its own, add up past the one-program forward, so a deeply skipped draft token is priced at the LM
    head alone. A draft of one token then pays at any acceptance above ~3%: so it was on the H200 (bf16) where dv
    drafted every step with a set that accepted nothing."""
    layers, ms = lm.runner.num_layers, 10.0
    return CostProfile(key={"model": "hand-made", "device": "cuda", "dtype": "bfloat16", "fast_path": False},
                       sizes=[1, 64], contexts=[128], forward=[[ms, ms]], step=ms, attn=[ms / layers] * layers,
                       mlp=[ms / layers] * layers, head=ms / 100)


def cache_set(lm, params: dict, matchness: float) -> None:
    """A skip set of every sub-layer but the last MLP in dv's disk cache, as a search would have left it, claiming
    `matchness`: the draft is the embedding read through one MLP and the head, garbage beside the full model."""
    layers = lm.runner.num_layers
    found = dv.SkipSetResult(attn=list(range(layers)), mlp=list(range(layers - 1)), objective=1.5,
                             matchness=matchness, draft_cost=0.02, draft_len=3, iterations=12, seconds=1.0, trace=[1.5])
    path = dv.cache_path(lm.runner, methods.params_for("dv", lm.name, "cpu", params))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": dv.CACHE_FORMAT, **asdict(found)}))


def test_a_skip_set_that_accepts_nothing_pauses_within_a_few_steps(deep_lm, cache_dir):
    """The search believed its set 90% right (a set found under another profile or dtype may be): the policy's prior
    says drafting pays, the verdicts say next to nothing is accepted, and the verdicts win within four steps.
    Drafting then returns only as probes, each after a pause twice the last, and the output is plain decoding's."""
    params = {**QUICK, "policy": "cost"}
    cache_set(deep_lm, params, matchness=0.9)
    profile = gpu_like(deep_lm)
    result = decode.run(deep_lm, PROMPT, "dv", max_new_tokens=40, profile=profile, params=params)
    assert result.events[1].payload["search"]["cached"] and result.events[1].payload["search"]["matchness"] == 0.9
    assert result.summary.accepted <= 1 and result.steps[0].drafted  # it drafted garbage while its prior held
    modes = [s.payload["plan"]["mode"] for s in result.steps]
    assert "draft" not in modes[4:], modes  # from the fifth step on, paused but for probes
    probes = [i for i, mode in enumerate(modes) if mode == "probe"]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert probes and gaps == sorted(gaps) and len(probes) <= 5  # ever rarer
    assert all(s.drafted == (mode == "probe") for s, mode in zip(result.steps[4:], modes[4:]))
    assert result.token_ids == baseline_run(deep_lm, PROMPT, 40).token_ids
    assert profile.mechanisms == {}  # priced by the hand-made profile alone


def test_a_set_that_cannot_pay_at_its_own_acceptance_is_never_drafted(deep_lm, cache_dir):
    """The searched set's measured acceptance is the policy's prior: where it could not pay even so under the profile
    at hand, dv pauses for good from its first step (no probe) and decodes as plain decoding does."""
    params = {**QUICK, "policy": "cost"}
    cache_set(deep_lm, params, matchness=0.0)
    result = decode.run(deep_lm, PROMPT, "dv", max_new_tokens=24, profile=gpu_like(deep_lm), params=params)
    plans = [s.payload["plan"] for s in result.steps[:-1]]  # the last: the budget's end, nothing left to size
    assert not any(s.drafted for s in result.steps)
    assert all(p["mode"] == "paused" and p["prior"] < 1 and p["alpha"] == 0.0 for p in plans)
    assert result.token_ids == baseline_run(deep_lm, PROMPT, 24).token_ids

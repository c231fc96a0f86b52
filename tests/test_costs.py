"""The cost profile: measured on first use, saved beside the converted weights, read back, refreshed; the
predictions made from it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tiny_model
from specgui import costs, decode
from specgui.runner import SkipPlan

ROOT = Path(__file__).resolve().parent.parent
KEY = {"model": "m", "device": "cpu", "dtype": "float32", "fast_path": False}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path))
    return tmp_path / "profiles"


def test_measured_once_saved_read_back_and_refreshed(cache_dir):
    lm = tiny_model(seed=4)
    first = costs.profile_for(lm, fast_path=False)
    assert first.sizes == list(costs.SIZES) and first.contexts == [128, 1024 - 64]  # the long one fits the model
    assert all(ms > 0 for row in first.forward for ms in row) and len(first.attn) == len(first.mlp) == 4
    assert first.step > 0 and first.measure_s > 0
    [saved] = cache_dir.glob("tiny-llama-*.json")
    assert json.loads(saved.read_text())["key"]["shape"]["num_hidden_layers"] == 4
    again = costs.profile_for(tiny_model(seed=9), fast_path=False)  # another runner, the same shape: from disk
    assert again.forward == first.forward and again.measure_s == first.measure_s
    assert costs.profile_for(lm, fast_path=False) is first  # the same runner: from memory
    fresh = costs.profile_for(lm, fast_path=False, refresh=True)
    assert fresh is not first and json.loads(saved.read_text())["measure_s"] == fresh.measure_s
    other = costs.profile_for(tiny_model(layers=3), fast_path=False)  # another shape: its own profile
    assert len(other.attn) == 3 and len(list(cache_dir.glob("*.json"))) == 2


def test_predictions_interpolate_and_price_skipped_sublayers():
    profile = costs.CostProfile(key=KEY, sizes=[1, 4, 16], contexts=[100, 1100], forward=[[10, 13, 25], [20, 23, 35]],
                                step=12, attn=[1.0, 1.0], mlp=[2.0, 2.0], head=0.5)
    assert profile.forward_ms(1, 100) == 10 and profile.forward_ms(2, 100) == 11
    assert profile.forward_ms(4, 600) == pytest.approx(18)  # halfway between the contexts
    assert profile.forward_ms(32, 100) == pytest.approx(41)  # continued linearly past 16
    assert profile.loop_ms == 2 and profile.verify_ms(4, 100) == 15 and profile.plain_ms(100) == 12
    assert profile.skip_forward_ms(SkipPlan(attn=frozenset({0}), mlp=frozenset({1})), 100) == 7
    assert profile.skip_forward_ms(SkipPlan(attn=frozenset({0}), mlp=frozenset({1})), 1100) == 14  # scaled
    calls = []
    assert profile.mechanism("x.lookup", lambda: calls.append(1) or 0.25) == 0.25
    assert profile.mechanism("x.lookup", lambda: calls.append(1) or 9.0) == 0.25 and calls == [1]
    text = profile.summary()
    assert "forward ms by new tokens" in text and "x.lookup" in text and "plain step 12.00 ms" in text


def test_methods_record_their_mechanisms_in_the_profile(cache_dir):
    lm = tiny_model(seed=5)
    for method in ("pld", "selfdraft", "fractal"):
        decode.run(lm, [1, 2, 3, 4, 1, 2, 3], method, max_new_tokens=6)
    profile = costs.profile_for(lm, fast_path=False)
    assert {"pld.lookup", "selfdraft.retrieve"} <= set(profile.mechanisms)
    assert any(k.startswith("fractal.pass.torch-int8") for k in profile.mechanisms)
    assert set(json.loads(next(cache_dir.glob("*.json")).read_text())["mechanisms"]) == set(profile.mechanisms)


def test_profile_command_prints_the_embedded_models_profile(tmp_path):
    env = {"SPECGUI_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    models = Path.home() / ".cache" / "specgui" / "models"  # reuse the converted weights, not the profiles
    if models.is_dir():
        (tmp_path / "models").symlink_to(models)
    done = subprocess.run([sys.executable, "-m", "specgui", "profile"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "cost profile of SmolLM2-135M-Instruct on cpu" in out and "plain step" in out
    assert "pld.lookup" in out and "fractal.pass" in out and "saved in" in out

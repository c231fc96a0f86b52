"""The cost profile: measured on first use, saved beside the converted weights, read back, refreshed; the
predictions made from it."""

import dataclasses
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from helpers import tiny_model
from specgui import costs
from specgui.core import decode
from specgui.core.runner import SkipPlan
from specgui.methods.policy import DraftPolicy

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


def test_a_mechanism_timed_beside_a_forward_is_priced_at_the_profiles_speed(monkeypatch):
    """A mechanism costing half a forward is priced at half the profile's forward, though the machine runs at half
    speed when it is timed (and slows down further midway): both are timed in turns, the share carries over."""
    profile = costs.CostProfile(key=KEY, sizes=[1, 4, 16], contexts=[100, 1100], forward=[[10, 13, 25], [20, 23, 35]],
                                step=12, attn=[1.0], mlp=[2.0], head=0.5)
    clock = {"now": 0.0, "calls": 0}

    def work(ms: float) -> None:
        clock["calls"] += 1
        clock["now"] += ms * (2 if clock["calls"] < 6 else 3) / 1000  # half speed, then a third

    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock["now"])
    ms = costs.beside_forward_ms(profile, lambda: work(6.5), lambda: work(13), 4, 100, torch.device("cpu"))
    assert ms == pytest.approx(0.5 * profile.forward_ms(4, 100))


def test_a_plain_step_is_priced_by_its_ratio_to_a_one_token_forward_timed_beside_it(monkeypatch):
    """Steps that take 0.95 of a one-token forward timed right after them are priced at 0.95 of the profile's
    one-token forward, whatever speed the machine ran at while they were timed (here a third of the profile's)."""
    profile = costs.CostProfile(key=KEY, sizes=[1, 4], contexts=[128], forward=[[10, 12]], step=0.0, attn=[1.0],
                                mlp=[2.0], head=0.5)
    clock = {"now": 0.0}

    def forward() -> None:
        clock["now"] += 0.030  # 30 ms: three times the profile's 10

    def run(*args, **kwargs):
        step = types.SimpleNamespace(draft_ms=0.0, verify_ms=28.0, overhead_ms=0.5)
        return types.SimpleNamespace(steps=[step] * 8)

    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock["now"])
    lm = types.SimpleNamespace(runner=types.SimpleNamespace(device=torch.device("cpu")))
    assert costs._plain_step_ms(lm, [1] * 16, profile, run=run, beside=forward) == pytest.approx(9.5)
    assert costs._plain_step_ms(lm, [1] * 16, profile, run=run) == pytest.approx(28.5)  # alone: as timed


def test_a_forward_over_more_rows_is_never_priced_below_fewer():
    """Medians taken while the machine slowed once put one row at 35.4 ms and two at 33.0: priced as measured, a
    2-row verify came out cheaper than a plain step. Prices read the least-squares non-decreasing curve; the
    measured medians stay as they were (what `profile` prints)."""
    measured = [35.42, 33.0, 34.96, 39.5, 39.34, 40.36, 39.84, 48.28]
    profile = costs.CostProfile(key=KEY, sizes=[1, 2, 3, 4, 5, 6, 8, 12], contexts=[128], forward=[list(measured)],
                                step=33.93, attn=[1.0], mlp=[1.0], head=0.1)
    fitted = [profile.forward_ms(n, 128) for n in profile.sizes]
    assert fitted == pytest.approx([34.21, 34.21, 34.96, 39.42, 39.42, 40.1, 40.1, 48.28])
    assert fitted == sorted(fitted) and profile.forward == [measured]
    assert profile.verify_ms(2, 128) >= profile.plain_ms(128)
    assert sum(fitted) == pytest.approx(sum(measured))  # pooled runs keep their means


def test_a_noisy_profile_never_prices_a_step_at_zero():
    """A busy machine inflated the long-context reading and the step came out below the one-token forward:
    extrapolated down to a short prompt, a verify was once priced 0 ms and the draft policy divided by it."""
    profile = costs.CostProfile(key=KEY, sizes=[1, 4, 16], contexts=[128, 960], forward=[[3, 4, 3.5], [30, 31, 33]],
                                step=1.0, attn=[1.0], mlp=[1.0], head=0.1)
    assert profile.forward_ms(1, 20) == profile.head  # extrapolated below zero: floored at the LM head
    assert profile.forward_ms(32, 128) == 3.75  # the dip 4 -> 3.5 pooled (3.75, 3.75); flat past the last size
    falling = dataclasses.replace(profile, forward=[[30, 31, 33], [3, 4, 3.5]])
    assert falling.forward_ms(1, 2000) == 3 and falling.forward_ms(1, 20) == 30  # nor past either context
    assert all(profile.verify_ms(n, ctx) >= profile.head for n in range(1, 40) for ctx in (0, 20, 500, 4000))
    plan = DraftPolicy([1, 2, 4, 8]).choose(lambda n: profile.verify_ms(1 + n, 20), profile.plain_ms(20))
    assert plan.size in (0, 1, 2, 4, 8)


def test_methods_record_their_mechanisms_in_the_profile(cache_dir):
    lm = tiny_model(seed=5)
    for method in ("pld", "selfdraft", "fractal"):
        decode.run(lm, [1, 2, 3, 4, 1, 2, 3], method, max_new_tokens=6)
    profile = costs.profile_for(lm, fast_path=False)
    assert {"pld.lookup", "selfdraft.retrieve"} <= set(profile.mechanisms)
    assert any(k.startswith("fractal.pass.") for k in profile.mechanisms)
    assert set(json.loads(next(cache_dir.glob("*.json")).read_text())["mechanisms"]) == set(profile.mechanisms)


def test_profile_command_prints_the_embedded_models_profile():
    # the session's cache: a profile or search another test already made is read, not measured again (what is
    # measured here is the command's own business: whatever is missing, it measures)
    env = {"SPECGUI_CACHE": os.environ["SPECGUI_CACHE"], "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    done = subprocess.run([sys.executable, "-m", "specgui", "profile"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "cost profile of SmolLM2-135M-Instruct on cpu" in out and "plain step" in out
    assert "pld.lookup" in out and "fractal.pass" in out and "saved in" in out
    assert "a layer-skip draft token" in out and "layers skipped" in out


def test_a_profile_saved_by_other_code_is_measured_again(cache_dir, monkeypatch):
    """A profile holds prices this code measured (its mechanisms too): another checkout's is not read."""
    first = costs.profile_for(tiny_model(seed=4), fast_path=False)
    assert first.key["code"] == costs.code_digest() and len(costs.code_digest()) == 12
    assert costs.profile_for(tiny_model(seed=4), fast_path=False).measured_at == first.measured_at  # the same one
    monkeypatch.setattr(costs, "code_digest", lambda: "0123456789ab")
    assert costs.profile_for(tiny_model(seed=4), fast_path=False).measured_at > first.measured_at


def test_a_profile_names_the_cpu_model_and_when_it_was_measured(cache_dir):
    lm = tiny_model(seed=4)
    before = time.time()
    profile = costs.profile_for(lm, fast_path=False)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "model name" in cpuinfo.read_text():
        line = next(x for x in cpuinfo.read_text().splitlines() if x.startswith("model name"))
        assert costs.cpu_name() == " ".join(line.split(":", 1)[1].split())
    assert profile.key["device"] == f"cpu {costs.cpu_name()} x{torch.get_num_threads()}"
    assert before <= profile.measured_at <= time.time()
    assert profile.origin() == f"measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime(profile.measured_at))} UTC " \
                               f"on {profile.key['device']}"
    assert profile.origin() in profile.summary() and profile.curve()["measured_at"] == profile.measured_at


def test_the_tolerance_separates_noise_from_another_machine():
    assert not costs.Drift(saved_ms=10.0, now_ms=12.0).stale and not costs.Drift(10.0, 8.5).stale  # 10-20% noise
    assert costs.Drift(10.0, 17.5).stale and costs.Drift(17.5, 10.0).stale  # the guide's two CPUs: 1.75x apart
    assert "1.75x" in costs.Drift(10.0, 17.5).sentence()


@pytest.mark.parametrize("factor", [8.0, 1 / 8])
def test_a_profile_saved_under_another_plain_step_cost_is_detected_and_replaced(cache_dir, monkeypatch, factor):
    """A profile as a CPU `factor` times slower (or faster) measured it, in a cache folder both machines share:
    the first read checks it against a couple of plain steps, finds it stale, measures again and saves that."""
    honest = costs.profile_for(tiny_model(seed=4), fast_path=False)
    shared = cache_dir.parent / "shared"
    monkeypatch.setenv("SPECGUI_CACHE", str(shared))
    foreign = json.loads(Path(honest.path).read_text())
    foreign.update(step=honest.step * factor, head=honest.head * factor, measured_at=1.0,
                   forward=[[ms * factor for ms in row] for row in honest.forward],
                   attn=[ms * factor for ms in honest.attn], mlp=[ms * factor for ms in honest.mlp])
    saved = shared / "profiles" / Path(honest.path).name
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps(foreign))

    lm = tiny_model(seed=7)  # a runner this process holds no profile for
    found, drift = costs.lookup(lm, fast_path=False)
    assert found.step == pytest.approx(honest.step * factor) and drift.stale
    assert (drift.ratio < 1 / costs.TOLERANCE) if factor > 1 else (drift.ratio > costs.TOLERANCE)
    replaced = costs.profile_for(lm, fast_path=False)
    assert replaced.measured_at > 1.0 and replaced.path == str(saved)
    assert json.loads(saved.read_text())["measured_at"] == replaced.measured_at  # the stale file is gone
    assert replaced.step != pytest.approx(honest.step * factor, rel=0.5)
    assert costs.profile_for(lm, fast_path=False) is replaced  # held now: no second check


def test_a_process_waiting_on_another_ones_measurement_takes_what_it_saved(cache_dir, monkeypatch):
    """Processes sharing a cache measure a profile once: `remeasure` waits on the file's lock, and a profile saved
    while it waited is taken, not measured again (here the other process is a thread holding the lock)."""
    import threading

    from specgui.model.cachedir import exclusive

    lm = tiny_model(seed=4)
    mine = costs.profile_for(lm, fast_path=False)  # a real profile, saved
    path = Path(mine.path)
    holding, release = threading.Event(), threading.Event()

    def other_process():
        with exclusive(path):
            holding.set()
            release.wait(10)
            theirs = json.loads(path.read_text())
            theirs["measured_at"], theirs["step"] = time.time(), 123.0
            path.write_text(json.dumps(theirs))

    def waiting(where: Path):  # the other process saves once this one has asked and waits on the lock, however slow
        release.set()  # the machine: a fixed delay raced the model's construction under load
        return exclusive(where)

    waiter = tiny_model(seed=9)
    other = threading.Thread(target=other_process)
    other.start()
    holding.wait(10)
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("measured although the other process had"))
    monkeypatch.setattr(costs, "exclusive", waiting)
    got = costs.remeasure(waiter, fast_path=False)
    other.join()
    assert got.step == 123.0 and got.path == str(path)


def test_mechanisms_measured_by_two_holders_of_one_file_are_both_kept(cache_dir):
    lm = tiny_model(seed=4)
    a = costs.profile_for(lm, fast_path=False)
    b = costs._read(Path(a.path), a.key)  # another process's copy of the same file
    assert b is not None and b is not a
    a.mechanism("x.one", lambda: 1.0)
    b.mechanism("x.two", lambda: 2.0)
    assert json.loads(Path(a.path).read_text())["mechanisms"] == {"x.one": 1.0, "x.two": 2.0}


def test_calibration_learns_each_row_count_and_prices_the_unseen_by_their_neighbours():
    cal = costs.Calibration()
    assert cal.verify_ratio(5) == 1.0 and cal.work_ratio("pld") == 1.0  # nothing seen: the profile as it is
    for _ in range(40):
        cal.learn("pld", 1, measured_ms=10.0, work_ms=0.0, verify_ms=10.0)  # plain steps as priced
        cal.learn("pld", 8, measured_ms=15.0, work_ms=0.0, verify_ms=10.0)  # 8 rows 1.5x their price
    assert cal.verify_ratio(1) == pytest.approx(1.0, abs=0.02) and cal.verify_ratio(8) == pytest.approx(1.5, rel=0.02)
    assert 1.15 < cal.verify_ratio(4) < 1.3  # between its neighbours (3/7 of the way in log ratio)
    assert cal.verify_ratio(12) == pytest.approx(cal.verify_ratio(8), rel=0.02)  # flat beyond the last seen
    assert cal.work_ratio("pld") == 1.0  # steps with no work of their own teach only the verify


def test_calibration_keeps_a_methods_own_work_apart_and_clips_a_stall():
    cal = costs.Calibration()
    for _ in range(40):
        cal.learn("fractal", 6, measured_ms=50.0, work_ms=20.0, verify_ms=20.0)  # its passes cost 30, priced 20
    assert cal.work_ratio("fractal") == pytest.approx(1.5, rel=0.02) and cal.verify_ratio(6) == 1.0
    assert cal.work_ratio("clasp") == 1.0  # another method's work: its own ratio
    cal.learn("pld", 2, measured_ms=500.0, work_ms=0.0, verify_ms=10.0)  # a stall: counts as 2x at most
    assert 1.0 < cal.verify_ratio(2) <= 2.0


def test_host_work_priced_near_nothing_is_learnt_in_ms_and_kept_out_of_the_verify_prices():
    """Self-Draft on an H200: its retrieval priced 0.007 ms, its drafting phase measured 1.6 ms a step, its verify as
    priced. No ratio on 0.007 ms reaches 1.6 ms, and the verify ratio that took the rest priced every method's verify
    of those rows 1.3x too dear. The calibration learns the 1.6 ms as the method's own, charged to its drafting steps
    only, and the verify prices stay as measured."""
    cal, ratio_only = costs.Calibration(), costs.Calibration()
    for _ in range(60):
        for c, draft_ms in ((cal, 1.6), (ratio_only, None)):  # None: the drafting phase not measured apart
            c.learn("selfdraft", 12, measured_ms=5.1 + 1.6, work_ms=0.007, verify_ms=5.1, draft_ms=draft_ms)
            c.learn("baseline", 1, measured_ms=5.0, work_ms=0.0, verify_ms=5.0, draft_ms=0.0)
    assert ratio_only.verify_ratio(12) == pytest.approx(6.7 / 5.1, rel=0.03) and ratio_only.host_ms("selfdraft") == 0
    assert cal.host_ms("selfdraft") == pytest.approx(1.6 - 0.007, rel=0.03)
    assert cal.verify_ratio(12) == pytest.approx(1.0, abs=0.02) and cal.verify_ratio(1) == pytest.approx(1.0, abs=0.01)
    assert cal.work_ratio("selfdraft") == 1.0 and cal.host_ms("baseline") == 0.0  # a plain step drafts nothing
    profile = costs.CostProfile(key={}, sizes=[1, 64], contexts=[128], forward=[[5.0, 5.0]], step=5.1, attn=[1.0],
                                mlp=[1.0], head=0.5, measured_at=1.0)  # measured: its prices are corrected
    profile.calibration = cal
    assert profile.own_ms("selfdraft", 0.007, rows=12) == pytest.approx(1.6, rel=0.03)  # what a drafting step does
    assert profile.own_ms("selfdraft", 0.007, rows=1) == 0.007  # a step that drafts nothing pays none of it
    cal.learn("selfdraft", 12, measured_ms=500.0, work_ms=0.007, verify_ms=5.1, draft_ms=495.0)  # a stall
    assert cal.host_ms("selfdraft") < 1.6 + 5.1 / 10  # counts as at most a verify's price beyond the cost it met
    assert costs.Calibration.from_dict(cal.to_dict()).host == cal.host  # saved with the rest


def test_host_cost_and_work_ratio_learn_from_different_steps_and_settle_together():
    """A draft whose steps are sometimes light (host work only) and sometimes heavy (draft forwards 1.5x their price,
    0.5 ms of host work besides): the light steps teach the host cost, the heavy ones the ratio with that cost taken
    off, and each settles at its own value instead of one absorbing the other."""
    cal = costs.Calibration()
    for _ in range(60):
        cal.learn("dv", 2, measured_ms=5.1 + 0.65, work_ms=0.1, verify_ms=5.1, draft_ms=0.65)  # 0.5 + 0.1 * 1.5
        cal.learn("dv", 2, measured_ms=5.1 + 3.5, work_ms=2.0, verify_ms=5.1, draft_ms=3.5)  # 0.5 + 2.0 * 1.5
    assert cal.host_ms("dv") == pytest.approx(0.5, rel=0.04) and cal.work_ratio("dv") == pytest.approx(1.5, rel=0.03)
    assert cal.verify_ratio(2) == pytest.approx(1.0, abs=0.02)


def test_steps_price_what_the_steps_before_them_measured(cache_dir):
    """A profile that prices every forward an eighth of what it costs: the run's later steps are priced by what its
    earlier ones measured, and the profile on disk keeps what was measured, not what the process learnt. (An eighth,
    not a quarter: on a shared machine the load moves between the profile's measuring and the run, and a quarter's
    run was once priced at 1.6x, under the 2x below, having measured a machine twice as fast as its profile had.)"""
    lm = tiny_model(seed=4)
    measured = costs.profile_for(lm, fast_path=False)
    cheap = dataclasses.replace(measured, forward=[[ms / 8 for ms in row] for row in measured.forward],
                                step=measured.step / 8, head=measured.head / 8, path="")
    result = decode.run(lm, list(range(3, 40)), "baseline", max_new_tokens=40, profile=cheap)
    first, late = result.steps[0], result.steps[-10:]
    assert first.plain_ms == pytest.approx(cheap.plain_ms(first.index + 37), rel=0.3)
    spent = sorted(s.draft_ms + s.verify_ms for s in late)[len(late) // 2]
    assert sorted(s.predicted_ms for s in late)[len(late) // 2] > 2 * cheap.plain_ms(70)
    assert spent / 2 < sorted(s.predicted_ms for s in late)[len(late) // 2] < spent * 2
    assert json.loads(Path(measured.path).read_text())["forward"] == measured.forward  # the measured prices stay


def test_what_calibration_learnt_is_saved_with_its_profile_and_read_back(cache_dir):
    """A fresh process (the app's first run) starts from what earlier runs on the same profile learnt, and says
    whether its prices were calibrated at all; a profile measured again starts afresh."""
    lm = tiny_model(seed=4)
    profile = costs.profile_for(lm, fast_path=False)
    assert profile.curve()["uncalibrated"] is True
    decode.run(lm, list(range(3, 20)), "pld", max_new_tokens=12, profile=profile)
    assert profile.calibration.learnt and profile.curve()["uncalibrated"] is False
    again = costs._read(Path(profile.path), profile.key)  # what another process reads
    assert again.calibration.verify == profile.calibration.verify  # JSON keeps a float exactly
    assert again.calibration.work == profile.calibration.work and again.curve()["uncalibrated"] is False
    assert costs.Calibration.from_dict({"verify": {"x": 1}}).learnt is False  # malformed: nothing learnt
    fresh = costs.remeasure(lm, False)
    assert not fresh.calibration.learnt and fresh.curve()["uncalibrated"] is True
    hand_made = dataclasses.replace(profile, measured_at=0.0, path="")
    assert hand_made.curve()["uncalibrated"] is False  # a price list taken as given is not corrected at all


def test_what_a_run_learnt_never_overwrites_a_profile_measured_again_meanwhile(cache_dir):
    """A run keeps what it learnt in its profile's file with the mechanisms another holder measured meanwhile; once
    another process has measured the profile again, the new file stays (the old calibration corrects other prices)."""
    lm = tiny_model(seed=4)
    mine = costs.profile_for(lm, fast_path=False)
    costs._read(Path(mine.path), mine.key).mechanism("x.theirs", lambda: 2.0)  # another process's copy
    decode.run(lm, list(range(3, 20)), "baseline", max_new_tokens=6, profile=mine)
    saved = json.loads(Path(mine.path).read_text())
    assert saved["mechanisms"] == {"x.theirs": 2.0} and saved["calibration"] == mine.calibration.to_dict()
    theirs = costs.remeasure(tiny_model(seed=9), fast_path=False)
    decode.run(lm, list(range(3, 20)), "baseline", max_new_tokens=6, profile=mine)
    saved = json.loads(Path(mine.path).read_text())
    assert saved["measured_at"] == theirs.measured_at != mine.measured_at
    assert not costs.Calibration.from_dict(saved["calibration"]).learnt


def test_a_profile_read_from_a_copied_cache_folder_saves_there(cache_dir):
    """Its file is where it was read, not the path saved in it: a copy's runs never write into the original."""
    profile = costs.profile_for(tiny_model(seed=4), fast_path=False)
    copied = cache_dir.parent / "copy" / Path(profile.path).name
    copied.parent.mkdir()
    copied.write_text(Path(profile.path).read_text())
    assert costs._read(copied, profile.key).path == str(copied)

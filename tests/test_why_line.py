"""The why line on a fresh app, through gradio_client: the first runs of the pld, selfdraft and fractal presets each
read a per-step figure beside a per-step prediction and an overall figure beside an overall one (labels, never
timings: whether a prediction is close is measured, not tested); and the app's calibration at start, which prices
those first runs as a bench's warm-up would."""

import re
import threading
from pathlib import Path

import pytest
from gradio_client import Client
from ui_helpers import served as serve

from helpers import tiny_model
from specgui import costs, fastpath
from specgui.core import decode
from specgui.ui import runs

PRESETS = {"pld": "Answering from retrieved passages: pld copies them",
           "selfdraft": "Editing existing code: selfdraft reuses its lines",
           "fractal": "A long step-by-step answer: fractal drafts mid-forward"}
FIGURE = r"(\d+\.\d\d)×"
PREDICTED = rf" \(predicted {FIGURE}(, uncalibrated)?\)"


@pytest.fixture(scope="module")
def client(embedded_lm):
    with serve(embedded_lm) as (_, url):
        yield Client(url, verbose=False)


@pytest.mark.parametrize("method", list(PRESETS))
def test_a_presets_first_run_compares_like_with_like(client, method):
    verdict = client.predict(PRESETS[method], api_name="/preset")
    assert verdict["method"] == method and verdict["summaries"]["method"]["type"] == "summary"
    text = verdict["why"]
    per_step = re.match(rf"{FIGURE} per step{PREDICTED}: tau ", text)
    assert per_step, text
    assert float(per_step[1]) == pytest.approx(verdict["per_step"], abs=0.006)
    assert float(per_step[2]) == pytest.approx(verdict["predicted_per_step"], abs=0.006)
    overall = re.search(rf"Counting the prompt forward: {FIGURE} overall{PREDICTED}\.", text)
    if overall is None:  # left out only where both figures read as the per-step ones do
        assert [f"{verdict['overall']:.2f}", f"{verdict['predicted']:.2f}"] == [per_step[1], per_step[2]], text
    else:
        assert float(overall[1]) == pytest.approx(verdict["overall"], abs=0.006)
        assert float(overall[2]) == pytest.approx(verdict["predicted"], abs=0.006)
        assert (overall[3] is not None) is verdict["uncalibrated"]
    assert (per_step[3] is not None) is verdict["uncalibrated"]
    summary = verdict["summaries"]["method"]  # the figures are the summary's, each of its own kind
    assert verdict["predicted"] == pytest.approx(summary["plain_s"] / summary["predicted_s"])
    assert verdict["predicted_per_step"] == pytest.approx(
        (summary["plain_s"] - summary["prompt_s"]) / (summary["predicted_s"] - summary["prompt_s"]))


def test_an_unknown_preset_is_one_line(client):
    with pytest.raises(Exception, match="unknown preset 'nope'"):
        client.predict("nope", api_name="/preset")


def test_the_app_calibrates_at_start_on_the_device_thread(tmp_path, monkeypatch):
    """A warm-up of plain decoding and of each preset's method, on the thread every run decodes on, that the
    first run's prices are corrected by (and that a later process starts from)."""
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path))
    lm = tiny_model(seed=4)
    threads, real = [], decode.run

    def run(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "run", run)
    assert runs.calibrate(lm, [(list(range(3, 20)), "pld", {})], tokens=4) == 2  # plain decoding and pld
    assert threads and all(name.startswith("specgui-device") for name in threads)
    profile = costs.profile_for(lm, fastpath.resolve("auto", lm.runner))
    assert profile.calibration.learnt and profile.curve()["uncalibrated"] is False
    assert costs._read(Path(profile.path), profile.key).calibration.verify == profile.calibration.verify


def test_on_the_fast_path_the_start_calibration_makes_the_programs_a_presets_first_run_replays(tmp_path,
                                                                                                monkeypatch):
    """Where runs take the fast path (a GPU's default; here forced on the CPU, where the programs are the same, only
    not captured), the start's calibration makes the cache at the presets' room and every program their methods use,
    so that a visitor's first run of a preset makes (on a GPU: captures) none. (Its count in the terminal line once
    failed on a GPU: the program table had no length.)"""
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path))
    lm = tiny_model(seed=4)
    resolve = fastpath.resolve
    monkeypatch.setattr(fastpath, "resolve", lambda mode, runner: resolve("on" if mode == "auto" else mode, runner))
    ids = list(range(3, 40))
    presets = [(ids, "pld", {}), (ids, "lookahead", {})]
    assert runs.calibrate(lm, presets, room=len(ids) + 64) == 4
    made = len(lm.runner.static_cache.programs)
    for prompt, method, params in presets:
        decode.run(lm, prompt, method, max_new_tokens=64, params=params)
    assert made > 0 and len(lm.runner.static_cache.programs) == made

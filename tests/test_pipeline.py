"""The pipelined step (`decode.generate(pipeline=True)`, the default): a step's event goes out after the next step's
forward is launched. The same tokens and events as the serial loop (`pipeline=False`), timings aside; no forward past
the end; and host work moved into the event leaves the time the device waits for (`hosttime`'s critical_ms).

Every run here is priced by a hand-made profile (`helpers.flat_profile`: no calibration, so no learnt timing sizes a
draft or prices a step) at the paper's fixed draft sizes (`helpers.drafting`): two runs of one method then differ
only in what was timed."""

import time

import pytest

from helpers import baseline_run, cuda, drafting, flat_profile, on_cuda, tiny_model
from specgui import costs, fastpath, methods
from specgui.core import decode, text
from specgui.core import launch as launching
from specgui.core.events import untimed
from specgui.methods.fractal.fractal import Fractal
from specgui.tools import hosttime

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [20, 21, 20, 21, 20, 21, 22]]
SLEEP_S = 0.05

OWN_STATE = {"swift": {"persist": False}}  # SWIFT's search goes on across runs: each run here starts its own


def params(method):
    return drafting(method, OWN_STATE.get(method))


@pytest.fixture(scope="module")
def profiles(tiny_lm):
    """One flat profile a path, shared by the module's runs (a method's first-use timings are measured once)."""
    return {path: flat_profile(tiny_lm, path == "on") for path in ("on", "off")}


def both(lm, prompt, method, monkeypatch, **kwargs):
    """The pipelined and the serial run's events, each with the number of verify forwards it launched; after a run
    that makes the method's first-use measurements and searches (D&V's skip set, Fractal's compression), which a
    method's first run of a profile reports and its later runs do not."""
    list(decode.generate(lm, prompt, method, **{k: v for k, v in kwargs.items() if k != "should_stop"}))
    launched = [0]
    launch = launching.launch

    def counted(*args, **kw):
        launched[0] += 1
        return launch(*args, **kw)

    monkeypatch.setattr(launching, "launch", counted)
    runs = []
    for pipeline in (True, False):
        launched[0] = 0
        runs.append((list(decode.generate(lm, prompt, method, pipeline=pipeline, **kwargs)), launched[0]))
    return runs


def assert_same_run(lm, prompt, method, monkeypatch, **kwargs):
    """Pipelined and serial: the same events in type, order and content, timings aside, and a verify forward a step
    (none launched past the end, but for steps chained on the device at a stop token, plain decoding's and prompt
    lookup's: the step after it is launched before it is read)."""
    (piped, piped_launched), (serial, serial_launched) = both(lm, prompt, method, monkeypatch, **kwargs)
    assert [type(e) for e in piped] == [type(e) for e in serial]
    assert [untimed(e, method) for e in piped] == [untimed(e, method) for e in serial]
    steps, chained = serial[-1].steps, method in ("baseline", "pld") and kwargs.get("fast_path") == "on"
    assert serial_launched == steps
    assert piped_launched == steps + (chained and serial[-1].stop == "eos" and steps > 0)
    return decode.Result(piped)


@pytest.mark.parametrize("fast_path", ["on", "off"])
@pytest.mark.parametrize("method", methods.names())
def test_every_method_decodes_the_same_pipelined_and_serially(tiny_lm, profiles, monkeypatch, method, fast_path):
    drafted = 0
    for prompt in PROMPTS:
        result = assert_same_run(tiny_lm, prompt, method, monkeypatch, max_new_tokens=24, fast_path=fast_path,
                                 params=params(method), profile=profiles[fast_path])
        assert result.token_ids == baseline_run(tiny_lm, prompt, 24).token_ids
        drafted += result.summary.drafted
    assert drafted > 0 or method == "baseline"  # a drafting method's events were compared with drafts in them


@pytest.mark.parametrize("method", ["baseline", "pld"])
def test_a_run_stopped_by_should_stop_stops_at_the_same_step(tiny_lm, profiles, monkeypatch, method):
    polls = []

    def should_stop():  # polled before each step's draft, pipelined as serially: true at the fourth
        polls.append(1)
        return len(polls) % 4 == 0

    result = assert_same_run(tiny_lm, PROMPTS[0], method, monkeypatch, max_new_tokens=40, should_stop=should_stop,
                             params=params(method), profile=profiles["on"], fast_path="on")
    assert result.summary.stop == "cancelled" and result.summary.steps == 3 and len(polls) == 8


@pytest.mark.parametrize("method", ["baseline", "pld"])
def test_a_run_that_ends_at_eos_ends_alike(monkeypatch, method):
    lm = tiny_model(eos=24)  # the tiny model's greedy output settles on token 24
    result = assert_same_run(lm, PROMPTS[0], method, monkeypatch, max_new_tokens=30, fast_path="on",
                             params=params(method), profile=flat_profile(lm, True))
    assert result.summary.stop == "eos" and result.token_ids[-1] == 24 and 24 not in result.token_ids[:-1]


@pytest.mark.parametrize("method", ["baseline", "pld"])
def test_a_run_of_one_token_launches_no_step(tiny_lm, profiles, monkeypatch, method):
    result = assert_same_run(tiny_lm, PROMPTS[0], method, monkeypatch, max_new_tokens=1, fast_path="on",
                             profile=profiles["on"])
    assert result.summary.steps == 0 and result.summary.stop == "length"


@pytest.mark.parametrize("method", ["baseline", "pld"])
def test_slow_event_work_is_waited_for_serially_and_not_pipelined(tiny_lm, profiles, monkeypatch, method):
    push = text.Detokenizer.push

    def slow(self, token):  # a slow detokenizer: every token's text takes 50 ms
        time.sleep(SLEEP_S)
        return push(self, token)

    monkeypatch.setattr(text.Detokenizer, "push", slow)
    waited = {}
    for pipeline in (True, False):
        result, steps = hosttime.measured_run(tiny_lm, PROMPTS[0], method, max_new_tokens=8, fast_path="on",
                                              params=params(method), profile=profiles["on"],
                                              pipeline=pipeline)
        assert len(steps) == result.summary.steps >= 2
        assert all(step.host_ms >= SLEEP_S * 1000 for step in steps)  # the generator's own time either way
        waited[pipeline] = [step.critical_ms for step in steps]
    # serially every launch follows the event before it (the prefill's for the first step); pipelined none does but
    # the first step's, which follows the Prefill event (where a step chained on the device records it: its own)
    assert min(waited[False]) >= SLEEP_S * 1000 > max(waited[True][1:])


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_the_decoding_commands_take_pipeline_on_or_off(command):
    from specgui.cli import build_parser

    parser = build_parser()
    required = ["--prompt", "x"] if command == "generate" else []
    assert parser.parse_args([command, *required]).pipeline == "on"
    assert parser.parse_args([command, *required, "--pipeline", "off"]).pipeline == "off"


@pytest.mark.parametrize("method", ["admg", "fractal"])
def test_pauses_chained_on_the_device_decode_the_same(monkeypatch, method):
    """Priced (a verify of any rows costs one step) so that a layer-skip method drafts, pauses, probes and drafts
    again: its paused steps, known ahead (`DraftPolicy.paused_ahead`), chain on the device between drafting ones,
    and the run equals the serial one event for event and plain decoding token for token. (Not CLaSp: its prices
    count its last search's measured time, so two runs may decide differently.) Fractal's compressed passes are
    priced by hand too, at a forward's price: measured, they decided whether it ever paused on a busy machine."""
    lm = tiny_model(init=0.3)
    layers, ms = lm.runner.num_layers, 10.0
    monkeypatch.setattr(Fractal, "_pass_ms", lambda self, state, rows, context, vocab: ms)
    flat = costs.CostProfile(key=costs.profile_key(lm, True), sizes=[1, 64], contexts=[128], forward=[[ms, ms]],
                             step=ms, attn=[ms / (2 * layers)] * layers, mlp=[ms / (2 * layers)] * layers,
                             head=ms / 10)
    ids = [1, 5, 9, 3, 7, 2, 11, 4, 1, 5, 9, 3, 7, 2]
    chained = []
    launch = fastpath.PlainSteps.launch

    def counted(self, position, pending):
        chained.append(pending is None)
        return launch(self, position, pending)

    monkeypatch.setattr(fastpath.PlainSteps, "launch", counted)
    result = assert_same_run(lm, ids, method, monkeypatch, max_new_tokens=24, fast_path="on", profile=flat,
                             params={"admg": {"alpha": 0.0, "keep_last": 0, "exit_threshold": 0.0}}.get(method))
    modes = {step.payload["plan"]["mode"] for step in result.steps}
    assert {"paused", "draft"} <= modes or {"paused", "probe"} <= modes, modes
    assert any(chained), "no paused step was launched ahead"
    assert result.token_ids == baseline_run(lm, ids, 24).token_ids


def test_a_long_chain_reloads_its_inputs_and_keeps_plain_decodings_tokens(tiny_lm, profiles, monkeypatch):
    """Past the chain buffer's rows (`readout.CHAIN`) plain steps reload the one-row inputs at the next position, the
    token left on the device: 100 chained steps give plain decoding's tokens and the serial loop's events."""
    loads = []
    launch = fastpath.PlainSteps.launch

    def counted(self, position, pending):
        reloaded = position - self.origin >= len(self.ring) and pending is None
        loads.append(reloaded)
        return launch(self, position, pending)

    monkeypatch.setattr(fastpath.PlainSteps, "launch", counted)
    result = assert_same_run(tiny_lm, PROMPTS[1], "baseline", monkeypatch, max_new_tokens=101, fast_path="on",
                             profile=profiles["on"])
    assert sum(loads) >= 2  # reloaded past rows 32 and 64 of the chain, mid-chain
    assert result.token_ids == baseline_run(tiny_lm, PROMPTS[1], 101).token_ids


@cuda
@pytest.mark.parametrize("method", ["baseline", "pld", "selfdraft", "fractal", "admg"])
def test_on_a_gpu_the_pipelined_loop_decodes_as_the_serial_one(monkeypatch, method):
    """On CUDA graphs (fp32): the chained plain steps (their pinned readout and events) and the pipelined drafting
    steps give the serial loop's events and plain decoding's tokens, past the chain's rows."""
    lm = on_cuda(tiny_model(seed=3))
    result = assert_same_run(lm, PROMPTS[1], method, monkeypatch, max_new_tokens=80, fast_path="on",
                             profile=flat_profile(lm, True), params=params(method))
    assert result.token_ids == baseline_run(lm, PROMPTS[1], 80).token_ids

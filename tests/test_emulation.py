"""The GPU path run on a CPU as a GPU runs it (`fastpath.emulation`): the emulation's own mechanisms, the defects it
found (each test here fails on the code before its fix), and the smoke's matrix of every method on the emulated
device (`specgui.tools.smoke`)."""

import itertools
import time

import numpy as np
import pytest
import torch

from helpers import flat_profile, tiny_model
from specgui import fastpath
from specgui.core import decode
from specgui.core.runner import SkipPlan
from specgui.fastpath import cursor, emulation
from specgui.fastpath.device import Staging
from specgui.fastpath.emulation import Emulated, EmulationError
from specgui.fastpath.program import Program, Programs
from specgui.fastpath.readout import HostRows
from specgui.tools import smoke

CPU = torch.device("cpu")


@pytest.fixture
def table():
    """A table of programs on the emulated device (the runner is only asked for its device, dtype and shape)."""
    lm = tiny_model(cpu=False)
    with emulation.emulated():
        yield Programs(lm.runner)


def program_of(fn, table, example=None):
    return Program(fn, torch.zeros(3) if example is None else example, table, capturable=True)


# -- capture and replay ---------------------------------------------------------------------------------------------


def test_a_capture_runs_its_function_once_and_a_replay_runs_it_on_the_buffers_as_they_are(table):
    counter, scale = torch.zeros(1), torch.ones(3)

    def fn(x):
        counter.add_(1)
        return x * scale

    program = program_of(fn, table)
    program.input.copy_(torch.tensor([1.0, 2.0, 3.0]))
    program.prepare()
    assert counter.item() == 1  # the warm-up ran, with its effects; the recorded capture left none
    scale.fill_(2.0)  # a buffer the graph reads, changed after the capture: a replay reads it as it is then
    assert program().tolist() == [2.0, 4.0, 6.0]
    assert counter.item() == 2


def test_a_replay_whose_python_would_now_do_other_work_fails(table):
    state = {"double": False}

    def fn(x):
        return x * 2 if state["double"] else x + 1

    program = program_of(fn, table)
    program()
    state["double"] = True  # a graph would go on adding one
    with pytest.raises(EmulationError, match="not the captured one"):
        program()


def test_a_replay_reading_a_tensor_at_another_address_fails(table):
    held = {"bias": torch.ones(3)}

    def fn(x):
        return x + held["bias"]

    program = program_of(fn, table)
    program()
    held["bias"] = torch.full((3,), 5.0)  # a new tensor: the graph still reads the old one's memory
    with pytest.raises(EmulationError, match="not the captured one"):
        program()


def test_a_program_reading_a_device_value_on_the_host_cannot_be_captured(table):
    def fn(x):
        return x * 2 if x.sum().item() > 0 else x

    with pytest.raises(EmulationError, match="reads a device value on the host"):
        program_of(fn, table).prepare()


def test_a_replay_whose_output_holds_nan_fails(table):
    def fn(x):
        return x / x  # 0 / 0

    with pytest.raises(EmulationError, match="NaN or Inf"):
        program_of(fn, table)()


def test_emulated_kernels_wrap_a_negative_index_and_assert_past_the_end(table):
    buffer = torch.zeros(4)

    def fn(x):
        return emulation._as_inductor(lambda b, i, v: b.index_copy_(0, i, v), buffer, x.long(), torch.ones(1))

    program = program_of(fn, table, torch.zeros(1))
    program.input.fill_(-1)
    program()
    assert buffer.tolist() == [0.0, 0.0, 0.0, 1.0]  # inductor wraps -1 to the last column
    program.input.fill_(4)
    with pytest.raises(EmulationError, match="device-side assert"):
        program()


# -- copies and events ----------------------------------------------------------------------------------------------


def test_a_host_row_read_before_its_event_sees_the_old_values():
    device = Emulated(CPU)
    rows = HostRows(3, device)
    first, ready = rows.copy(torch.tensor([1.0, 2.0, 3.0]))
    second, later = rows.copy(torch.tensor([4.0, 5.0, 6.0]))
    assert first.tolist() == [0.0, 0.0, 0.0] and not ready.query()  # not landed: the device runs behind
    ready.synchronize()
    assert first.tolist() == [1.0, 2.0, 3.0]
    assert second.tolist() == [0.0, 0.0, 0.0] and not later.query()  # launched after what was waited for
    later.synchronize()
    assert second.tolist() == [4.0, 5.0, 6.0]


def test_a_staged_copy_lands_when_the_device_gets_to_it_and_the_host_never_waits_for_a_buffer():
    """Uploads through a staging buffer while the device runs behind: each lands as the next program runs, with the
    values packed for it; a buffer in flight is passed over (one more made) rather than waited for."""
    device = Emulated(CPU)
    staging, target = Staging(np.zeros(2, dtype=np.int64), device), torch.zeros(2, dtype=torch.long)
    seen = []
    for value in range(5):  # five uploads, no read between: the device catches up with none of them
        staging.next()[:] = value
        staging.send(target)
        assert target.tolist() == ([0, 0] if value == 0 else [value - 1] * 2)  # not before the device runs it
        device.follow()  # the program that reads it
        seen.append(target.tolist())
    assert seen == [[v, v] for v in range(5)]
    assert staging.waits == 0 and len(staging.buffers) == 5
    device.synchronize()
    staging.next()[:] = 9  # every copy landed: a buffer is reused, none made
    assert len(staging.buffers) == 5


def test_past_its_most_buffers_a_staging_waits_for_the_oldest():
    device = Emulated(CPU)
    staging, target = Staging(np.zeros(1, dtype=np.int64), device), torch.zeros(1, dtype=torch.long)
    for value in range(Staging.MOST + 1):
        staging.next()[:] = value
        staging.send(target)
    assert staging.waits == 1 and len(staging.buffers) == Staging.MOST


# -- the defects it found ---------------------------------------------------------------------------------------------


def test_the_row_programs_capture_builds_its_row_in_the_scratch():
    """The row program's input before any start sends one: a row past the capacity, so that a capture's warm-up run
    builds inputs that write nowhere a run reads (at 45a5c8f zeros: a row at position -1, every layer's write index
    -1, which inductor wraps to the last scratch column and an eager program asserts on)."""
    lm = tiny_model(seed=3, cpu=False)
    with emulation.emulated():
        cache = fastpath.StaticKVCache(lm.runner, 256)
        program = cursor.row_program(cache)
        program.prepare()
        inputs = cache.inputs_for(1)
        assert int(inputs.index.min()) >= cache.capacity and int(inputs.positions[0, 0]) == cache.capacity
        assert bool(inputs.mask.any())


def test_a_warm_up_leaves_no_bucket_owned_and_captures_each_program_on_scratch_inputs():
    """At 45a5c8f a warm-up left each bucket's inputs marked as its own, as a program had left them (the row program
    at position -1, a chained step moved on): a later warm-up at that bucket (a plan adopted) skipped its load."""
    lm = tiny_model(seed=3, cpu=False)
    with emulation.emulated():
        cache = fastpath.cache_for(lm.runner, 16)
        assert cache.inputs and all(inputs.owner is None for inputs in cache.inputs.values())
        loads = []
        load = type(cache.inputs_for(1)).load

        def counted(self, owner, *args, **kwargs):
            loads.append(self.rows)
            return load(self, owner, *args, **kwargs)

        type(cache.inputs_for(1)).load = counted
        try:
            fastpath.adopt(cache, SkipPlan(frozenset({1}), frozenset()))  # a plan's programs, made now
        finally:
            type(cache.inputs_for(1)).load = load
        assert loads and all(rows == 1 for rows in loads)
        assert int(cache.inputs_for(1).index.min()) >= cache.capacity  # what its captures left: the scratch


CAPTURE_S = 1000.0  # what each capture takes on the test's clock: no step's own work comes near it


@pytest.mark.parametrize("method", ["clasp", "swift"])
@pytest.mark.parametrize("pipeline", [True, False])
def test_steps_that_capture_leave_the_capture_out_of_their_time_and_the_cost_model(monkeypatch, pipeline, method):
    """CLaSp re-optimising every other step and SWIFT searching every step adopt plans inside the run; each capture,
    made to take `CAPTURE_S` on the clock the run reads (`time.perf_counter`, moved on inside the capture, so that the
    verdict rests on no real time), shows in a step's capture_ms (serially, the step whose observe adopted; pipelined,
    the step whose span held it) and in no step's draft, verify or overhead ms, nor in the run's time or in what the
    cost model learns."""
    lm = tiny_model(seed=3, cpu=False)
    capture, perf_counter, skipped = Emulated.capture, time.perf_counter, [0.0]

    def slow(self, *args, **kwargs):
        skipped[0] += CAPTURE_S
        return capture(self, *args, **kwargs)

    with emulation.emulated():
        profile = flat_profile(lm, True)
        decode.run(lm, smoke.PROMPT, method, max_new_tokens=4, fast_path="on", compile="on", profile=profile,
                   params={"policy": "fixed"})  # the cache and the method's own programs, before any timing
        monkeypatch.setattr(Emulated, "capture", slow)
        monkeypatch.setattr(time, "perf_counter", lambda: perf_counter() + skipped[0])
        learnt = []
        monkeypatch.setattr(profile, "learn", lambda method, rows, measured_ms, *a, **k: learnt.append(measured_ms))
        result = decode.run(lm, smoke.PROMPT, method, max_new_tokens=24, fast_path="on", compile="on",
                            profile=profile, params={"policy": "fixed", **smoke.REPLANNING[method]},
                            pipeline=pipeline)
    captured = [s for s in result.steps if s.capture_ms]
    assert captured and all(s.capture_ms >= CAPTURE_S * 1000 for s in captured)
    timed_ms = [s.draft_ms + s.verify_ms + s.overhead_ms for s in result.steps]
    assert max(timed_ms) < CAPTURE_S * 1000 / 2
    assert result.summary.wall_s < result.summary.prompt_s + sum(timed_ms) / 1000 + CAPTURE_S / 2  # none in it
    assert len(learnt) == len(result.steps) - len(captured) and max(learnt) < CAPTURE_S * 1000 / 2


# -- the matrix -------------------------------------------------------------------------------------------------------


def assert_all_pass(checks):
    failed = [check.line() for check in checks if not check.ok]
    assert not failed, "\n".join(failed)


def test_every_method_first_on_a_fresh_cache_then_serially_on_the_emulated_device():
    checks = smoke.run(smoke.methods.names(), ["float32"], emulate=True, say=lambda line: None)
    assert len(checks) == 2 * len(smoke.methods.names())
    assert_all_pass(checks)


def test_every_method_after_every_other_on_one_runner_with_toggles_growth_and_plan_changes():
    lm = tiny_model(seed=3, cpu=False)
    names = smoke.methods.names()
    with emulation.emulated():
        lm.runner.compile_mode = "on"
        matrix = smoke.Smoke(lm, "emulated")
        checks = list(matrix.sequence(names))
    assert len(checks) == len(names) * (len(names) - 1) + 1 + 6
    assert_all_pass(checks)


def test_each_pair_puts_every_name_after_every_other_once():
    names = ["a", "b", "c", "d"]
    order = smoke.each_pair(names)
    pairs = list(itertools.pairwise(order))
    assert sorted(pairs) == sorted((a, b) for a in names for b in names if a != b)


def test_the_smoke_command_refuses_bad_input_in_one_line(capsys):
    from specgui.cli import main

    assert main(["smoke", "--emulate", "--dtypes", "float8"]) == 2
    assert "--dtypes takes float32, bfloat16 or float16, got 'float8'" in capsys.readouterr().err
    assert main(["smoke", "--emulate", "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["smoke"]) == 2
        assert "use --emulate" in capsys.readouterr().err


def test_the_smoke_command_prints_a_line_a_check_and_exits_0_when_all_pass(capsys):
    from specgui.cli import main

    assert main(["smoke", "--emulate", "--methods", "baseline,pld", "--tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith(("PASS", "FAIL"))] == [
        "PASS float32 emulated baseline first on a fresh cache, pipelined",
        "PASS float32 emulated baseline serially after it",
        "PASS float32 emulated pld first on a fresh cache, pipelined", "PASS float32 emulated pld serially after it"]
    assert lines[-1].startswith("# 4 passed, 0 failed")


def test_a_smoke_check_fails_where_the_device_refused_a_capture(monkeypatch):
    """A capture CUDA refuses leaves its program eager and the run correct, only slow: the smoke says so."""
    capture = Emulated.capture

    def refusing(self, fn, *args, **kwargs):
        if "row_program" in getattr(fn, "__qualname__", ""):
            raise RuntimeError("operation not permitted when stream is capturing")
        return capture(self, fn, *args, **kwargs)

    monkeypatch.setattr(Emulated, "capture", refusing)
    checks = smoke.run(["swift"], ["float32"], emulate=True, tokens=8, say=lambda line: None)
    assert not checks[0].ok and "could not be captured and ran eagerly" in checks[0].detail

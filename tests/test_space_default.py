"""A Space pushed as it is, with no variables set, is public: through gradio_client, a visitor who names a local
directory as the model or a server path as a trace gets one line of refusal, and the default model still runs."""

import json

import pytest
from gradio_client import Client
from ui_helpers import served as serve

PROMPT = "Name three colours."


@pytest.fixture(scope="module")
def space(embedded_lm):
    with pytest.MonkeyPatch.context() as mp:
        for name in ("SPECGUI_PUBLIC", "SPECGUI_ALLOWED_MODELS", "GRADIO_SERVER_NAME", "SPECGUI_DEFAULT_MODEL"):
            mp.delenv(name, raising=False)
        mp.setenv("SPACE_ID", "someone/specgui")
        with serve(embedded_lm) as (app, url):
            yield app, Client(url, verbose=False)


def test_a_local_directory_as_the_model_is_refused(space, tmp_path):
    app, client = space
    with pytest.raises(Exception, match="this deployment only serves embedded") as refused:
        client.predict(PROMPT, "pld", 8, 0.0, str(tmp_path), api_name="/generate")
    assert "\n" not in str(refused.value).strip()  # one line
    assert app.store.current.spec.name == "embedded"  # nothing else was loaded


def test_a_server_path_as_the_trace_is_refused(space, tmp_path, embedded_lm):
    _, client = space
    events = list(client.submit(PROMPT, "pld", 4, 0.0, api_name="/generate"))
    on_disk = tmp_path / "trace.json"
    on_disk.write_text(json.dumps(events), encoding="utf-8")
    with pytest.raises(Exception, match="only uploaded trace files can be replayed on this deployment"):
        client.predict(str(on_disk), 8.0, api_name="/replay")
    with pytest.raises(Exception, match="only uploaded trace files"):
        client.predict("/etc/passwd", 8.0, api_name="/replay")


def test_the_default_model_still_runs(space):
    _, client = space
    for model in ("", "embedded"):
        events = list(client.submit(PROMPT, "pld", 8, 0.0, model, api_name="/generate"))
        assert events[-1]["type"] == "summary" and events[-1]["new_tokens"] == 8


NO_COMPILER_RUN = """
import json
from specgui.cpu import kernels
from specgui.ui.page import App
app = App()
events = list(app.generate_api("Name three colours.", "pld", 12, 0.0))
print(json.dumps({"library": kernels.skinny_library() is not None, "note": app.kernel_note, "last": events[-1]}))
"""


def test_without_a_c_compiler_the_app_still_runs(tmp_path):
    """A Space without packages.txt has no C compiler: the skinny kernel and the C layers are not built, the app
    says so once (server log and first status line) and decodes through torch's kernels (slower, same tokens within
    rounding)."""
    import os
    import subprocess
    import sys

    from specgui import REPO_DIR
    from specgui.model.cachedir import cache_root

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_root() / "models", target_is_directory=True)  # the converted weights
    bare = tmp_path / "bin"
    bare.mkdir()  # a PATH with no cc or gcc on it
    env = {**os.environ, "PATH": str(bare), "CC": "", "SPECGUI_CACHE": str(cache), "PYTHONPATH": str(REPO_DIR)}
    env.pop("SPACE_ID", None)
    done = subprocess.run([sys.executable, "-c", NO_COMPILER_RUN], env=env, cwd=REPO_DIR, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["library"] is False
    assert out["note"].startswith("The C kernel is not built here") and out["note"] in done.stderr
    assert out["last"]["type"] == "summary" and out["last"]["new_tokens"] == 12

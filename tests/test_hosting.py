"""Deployment policy (default model, public allowlist, ZeroGPU no-op) and big-model placement
(accelerate device maps with layers offloaded to disk run through the runner unchanged)."""

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import tiny_model
from specgui.core.kvcache import KVCache
from specgui.core.runner import Runner
from specgui.errors import SpecGUIError
from specgui.model import hosting

POLICY = ("SPACE_ID", "GRADIO_SERVER_NAME", "SPECGUI_PUBLIC", "SPECGUI_ALLOWED_MODELS")  # who counts as a stranger


def test_default_model_follows_the_environment(monkeypatch):
    monkeypatch.delenv("SPECGUI_DEFAULT_MODEL", raising=False)
    assert hosting.default_model() == "embedded"  # the package is installed for the tests
    monkeypatch.setattr("specgui.model.loading.embedded_gguf", lambda: None)
    assert hosting.default_model() == hosting.HUB_DEFAULT
    monkeypatch.setenv("SPECGUI_DEFAULT_MODEL", "org/model")
    assert hosting.default_model() == "org/model"


def test_public_deployments_only_load_allowed_models(monkeypatch):
    for name in (*POLICY, "SPECGUI_DEFAULT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    hosting.check_model_request("/etc", trust_remote_code=True)  # a private deployment trusts its operator
    monkeypatch.setenv("SPECGUI_ALLOWED_MODELS", "Qwen/Qwen2.5-0.5B-Instruct")
    assert hosting.allowed_models() == ["embedded", "Qwen/Qwen2.5-0.5B-Instruct"]
    hosting.check_model_request("Qwen/Qwen2.5-0.5B-Instruct")
    for name in ("/etc", "../models/x", "some/other-model"):
        with pytest.raises(SpecGUIError, match="only serves"):
            hosting.check_model_request(name)
    with pytest.raises(SpecGUIError, match="remote model code"):
        hosting.check_model_request("embedded", trust_remote_code=True)
    monkeypatch.delenv("SPECGUI_ALLOWED_MODELS")
    monkeypatch.setenv("SPECGUI_PUBLIC", "1")
    assert hosting.allowed_models() == ["embedded"]


@pytest.mark.parametrize("env,public", [
    ({}, False),  # a server on loopback, the default: its user's own machine
    ({"GRADIO_SERVER_NAME": "127.0.0.1"}, False),
    ({"GRADIO_SERVER_NAME": "localhost"}, False),
    ({"GRADIO_SERVER_NAME": "::1"}, False),
    ({"SPACE_ID": "someone/specgui"}, True),  # a Space pushed with no variables set
    ({"GRADIO_SERVER_NAME": "0.0.0.0"}, True),
    ({"GRADIO_SERVER_NAME": "192.168.1.20"}, True),
    ({"SPECGUI_ALLOWED_MODELS": ""}, True),
    ({"SPECGUI_ALLOWED_MODELS": "org/model"}, True),
    ({"SPACE_ID": "someone/specgui", "SPECGUI_PUBLIC": "0"}, False),  # the owner said so, explicitly
    ({"GRADIO_SERVER_NAME": "0.0.0.0", "SPECGUI_PUBLIC": "0"}, False),
    ({"SPECGUI_ALLOWED_MODELS": "org/model", "SPECGUI_PUBLIC": "0"}, False),
    ({"SPECGUI_PUBLIC": "1"}, True),
    ({"SPACE_ID": "someone/specgui", "SPECGUI_PUBLIC": "1"}, True),
    ({"SPACE_ID": "someone/specgui", "SPECGUI_PUBLIC": "false"}, True),  # only "0" opens a Space to everything
    ({"SPECGUI_PUBLIC": "yes"}, True),  # a value that is not "0" errs on the safe side
    ({"SPACE_ID": "someone/specgui", "SPECGUI_PUBLIC": " "}, True),  # blank is unset
])
def test_who_counts_as_a_stranger(monkeypatch, env, public):
    for name in POLICY:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hosting.is_public() is public


def test_a_space_with_no_variables_serves_the_default_model_only(monkeypatch):
    for name in (*POLICY, "SPECGUI_DEFAULT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPACE_ID", "someone/specgui")
    hosting.check_model_request("embedded")
    for name in ("/tmp", "./models", "org/model"):
        with pytest.raises(SpecGUIError, match="only serves embedded"):
            hosting.check_model_request(name)


def test_gpu_decorator_is_a_no_op_without_spaces(monkeypatch):
    monkeypatch.setattr(hosting, "spaces", None)

    def work(x):
        return x + 1

    assert hosting.gpu(work) is work and hosting.gpu(duration=30)(work) is work


def test_gpu_decorator_uses_spaces_gpu_when_present(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(GPU=lambda duration: (lambda f: calls.append(duration) or (lambda *a: ("gpu", f(*a)))))
    monkeypatch.setattr(hosting, "spaces", fake)
    wrapped = hosting.gpu(lambda x: x * 2, duration=45)
    assert wrapped(3) == ("gpu", 6) and calls == [45]


def test_hosting_imports_spaces_before_torch():
    """ZeroGPU requires `spaces` to be imported before torch touches CUDA: the app imports hosting first,
    and hosting must not import torch itself."""
    import subprocess

    code = "import sys, specgui.model.hosting; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_runner_follows_an_offloaded_device_map(tmp_path):
    """Layers and the LM head offloaded to disk (weights on the meta device, loaded by accelerate's hooks at
    call time) give the same logits through the runner as the in-memory model."""
    lm = tiny_model(seed=2)
    lm.model.save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "cpu",
                  "model.norm": "cpu", "lm_head": "disk"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map, dtype=torch.float32,
                                                     offload_folder=str(tmp_path / "offload"))
    assert any(p.device.type == "meta" for p in offloaded.model.layers[1].parameters())
    runner = Runner(offloaded)
    ids = torch.randint(0, 48, (7,))
    with torch.no_grad():
        reference = lm.model(ids[None]).logits[0]
        cache = KVCache()
        got = torch.cat([runner.forward(ids[:4], torch.arange(4), cache),
                         runner.forward(ids[4:], torch.arange(4, 7), cache)])
    assert torch.allclose(got, reference, atol=1e-5)

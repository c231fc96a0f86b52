"""Model loading: the embedded GGUF with its conversion cache, and one-line errors for bad models."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from helpers import tiny_model
from specgui.cpu import arena
from specgui.errors import SpecGUIError
from specgui.model import loading
from specgui.model.loading import ModelSpec


def test_embedded_model_loads_from_the_conversion_cache(embedded_lm):
    again = loading.load()
    assert again.source == "gguf (cached)"
    assert again.runner.num_layers == 30 and again.name == "SmolLM2-135M-Instruct"
    assert again.stop_ids and again.max_context >= 2048
    assert again.tokenizer.chat_template


def test_local_directory_loads_and_generates(tmp_path, embedded_lm):
    from specgui.core import decode

    target = tmp_path / "tiny"
    tiny_model().model.save_pretrained(target)
    embedded_lm.tokenizer.save_pretrained(target)
    lm = loading.load(ModelSpec(name=str(target), dtype="float32"))
    assert lm.source == "local" and lm.runner.num_layers == 4
    plain = decode.run(lm, [1, 2, 3], "pld", max_new_tokens=5).token_ids
    assert len(plain) == 5
    mapped = loading.load(ModelSpec(name=str(target), dtype="float32", device_map="auto"))
    assert decode.run(mapped, [1, 2, 3], "pld", max_new_tokens=5).token_ids == plain


def test_local_directory_without_tokenizer_is_a_clear_error(tmp_path):
    tiny_model().model.save_pretrained(tmp_path)
    loading.check(ModelSpec(name=str(tmp_path)))  # the config is fine: only loading finds the tokenizer missing
    with pytest.raises(SpecGUIError, match="cannot load"):
        loading.load(ModelSpec(name=str(tmp_path)))


@pytest.mark.parametrize("name, message", [
    ("/no/such/dir", "no such model directory"),
    ("./relative/missing", "no such model directory"),
    ("not a valid id!!", "cannot"),
])
def test_bad_model_names(name, message):
    for attempt in (loading.check, loading.load):  # the check before freeing a model says what load would
        with pytest.raises(SpecGUIError, match=message) as info:
            attempt(ModelSpec(name=name))
        assert "\n" not in str(info.value)


def test_hub_id_without_network_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecGUIError, match="hub is unreachable"):
        loading.load(ModelSpec(name="HuggingFaceTB/definitely-not-cached-model"))


def test_unsupported_architecture(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)).save_pretrained(tmp_path)
    for attempt in (loading.check, loading.load):
        with pytest.raises(SpecGUIError, match=r"'gpt2'.*Llama-family"):
            attempt(ModelSpec(name=str(tmp_path)))


@pytest.mark.parametrize("field, value", [("dtype", "float8"), ("device", "tpu"), ("quantization", "3bit"),
                                          ("device_map", "sequential"), ("name", "  ")])
def test_bad_spec_fields(field, value):
    with pytest.raises(SpecGUIError):
        ModelSpec(**{field: value})


def test_a_loaded_cpu_models_weights_share_one_aligned_buffer(embedded_lm):
    """`arena.gather` at load: off the safetensors file's pages (whose tensors began 40 bytes past a cache line)."""
    params = list(embedded_lm.model.parameters())
    assert {p.data_ptr() % arena.LINE for p in params} == {0}
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    head, embedding = embedded_lm.model.lm_head.weight, embedded_lm.model.model.embed_tokens.weight
    assert head is embedding  # still tied: one copy, read by both


def test_gather_moves_misaligned_weights_and_keeps_every_number():
    lm = tiny_model(cpu=False)
    model = lm.model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    params = list(model.parameters())
    mapped = torch.empty(sum(p.numel() for p in params) * 4 + 64 + 40, dtype=torch.uint8)
    offset = -mapped.data_ptr() % 64 + 40  # as a mapped file's tensors: 40 bytes past a cache line
    with torch.no_grad():
        for p in params:
            view = mapped[offset : offset + p.numel() * 4].view(torch.float32).view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += p.numel() * 4
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        before = model(tokens).logits
    assert arena.gather(model) == sum(-(-p.numel() * 4 // 64) * 64 for p in params)
    assert {p.data_ptr() % 64 for p in model.parameters()} == {0}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        assert torch.equal(model(tokens).logits, before)


def test_gather_leaves_a_model_off_the_cpu_alone():
    model = tiny_model(cpu=False).model
    with torch.device("meta"):
        model.extra = torch.nn.Linear(4, 4)
    pointers = [p.data_ptr() for p in model.parameters()]
    assert arena.gather(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers

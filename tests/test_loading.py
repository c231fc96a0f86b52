"""Model loading: the embedded GGUF with its conversion cache, and one-line errors for bad models."""

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from helpers import tiny_model
from specgui import loading
from specgui.errors import SpecGUIError
from specgui.loading import ModelSpec


def test_embedded_model_loads_from_the_conversion_cache(embedded_lm):
    again = loading.load()
    assert again.source == "gguf (cached)"
    assert again.runner.num_layers == 30 and again.name == "SmolLM2-135M-Instruct"
    assert again.stop_ids and again.max_context >= 2048
    assert again.tokenizer.chat_template


def test_local_directory_loads_and_generates(tmp_path, embedded_lm):
    from specgui import decode

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

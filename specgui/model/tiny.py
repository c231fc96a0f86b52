"""Tiny random Llama-family models built in-process, with a character tokenizer: every code path in milliseconds, no
weights to fetch. The tests decode thousands of steps on them, and `python -m specgui smoke` checks a GPU with one
before any model is staged there."""

from __future__ import annotations

from typing import Any

import torch

from specgui.core.runner import Runner
from specgui.cpu import arena, kernels
from specgui.cpu import layers as cpu_layers
from specgui.model.loading import LoadedModel, ModelSpec


class CharTokenizer:
    """Token i is the letter chr(97 + i % 26): enough tokenizer for models built in-process."""

    chat_template = None

    def __init__(self, vocab: int, eos: int | None = None) -> None:
        self.vocab = vocab
        self.eos_token_id = eos

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [(ord(c) - 97) % self.vocab for c in text]}

    def decode(self, ids: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(97 + int(i) % 26) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def _architectures() -> dict[str, tuple[Any, Any]]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny_model(*, vocab: int = 48, layers: int = 4, hidden: int = 64, seed: int = 0, arch: str = "llama",
               init: float = 0.08, eos: int | None = None, attn: str = "sdpa", cpu: bool = True,
               device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A random Llama-family model small enough to run thousands of steps in a test.

    `init` scales the random weights: larger values make the next-token distribution peakier, which keeps greedy
    decisions away from numerical ties. `cpu`: on a CPU its decoder layers run as C calls where they can
    (`specgui.cpu.layers`, as a loaded model's do); else transformers' modules. Elsewhere (`device`) it is moved
    there in `dtype`.
    """
    torch.manual_seed(seed)
    config_cls, model_cls = _architectures()[arch]
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                        max_position_embeddings=1024, initializer_range=init, tie_word_embeddings=False,
                        eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    model = model_cls(config).eval()
    model.set_attn_implementation(attn)
    if device != "cpu" or dtype != torch.float32:
        model = model.to(device, dtype)
    else:
        arena.gather(model)  # as `loading.load` does: the weights in one aligned buffer
        if cpu:  # as `loading.load` does: the machine's own matmul forms, then the C layers
            kernels.install(model)
            cpu_layers.install(model)
    return LoadedModel(spec=ModelSpec(name=f"tiny-{arch}"), name=f"tiny-{arch}", model=model,
                       tokenizer=CharTokenizer(vocab, eos), runner=Runner(model),
                       stop_ids=frozenset() if eos is None else frozenset({eos}), max_context=1024, load_s=0.0,
                       source="in-process")

"""Int8 copies of a model's decoder layers, LM head and embedding, used only for drafting (Fractal).

Fractal splices a compressed copy of the model into the full model's own forward; the copy is worth
having only if it is cheaper than the full-precision stack on the same device. Which int8 kernel is
cheaper differs by device, so the backend is a choice:

  * "bnb-int8" (CUDA): bitsandbytes' LLM.int8 `Linear8bitLt` (outlier threshold 6.0, transformers' default),
    the paper's choice. bitsandbytes also runs it on CPU, but there it was ~5x *slower* than fp32.
  * "torch-int8" (CPU): torch's dynamic int8 linear (fbgemm/oneDNN, VNNI on this machine): int8 weights with
    a scale per output channel, activations quantized per call. On the embedded model's shapes it took
    22-55 us against fp32's 28-220 us per linear over 1-9 rows, and the LM head 0.4-0.8 ms against 3-10 ms
    (measured against the small-batch fp32 kernel of `specgui/kernels.py`). Weight-only
    `torch._weight_int8pack_mm` has no fast fp32 path here (>10x slower than fp32).
  * "torch-fp16" (CPU): fbgemm's fp16-weight linear, not int8: the measured comparison point for the
    int8 path's accuracy against its cost.
"auto" picks bnb-int8 on CUDA and torch-int8 elsewhere.

The final norm is shared with the model (a vector of `hidden` weights: nothing to compress or gain). The
embedding is an int8 table with one scale per row: a lookup of a few rows costs nothing either way, but
the copy is what the paper's compressed model embeds with and keeps the drafting copy's memory small.

Copies keep their `layer_idx`, so a copy of layer i reads and writes cache slot i like the original;
the original modules are never touched. Building the copies quantizes every weight once (seconds on a
CPU), so `compressed_copy` keeps one copy per runner and backend for the runner's lifetime.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specgui.errors import SpecGUIError
from specgui.runner import ATTN, MLP, Pass, Runner, execution_device

BACKENDS = ("auto", "torch-int8", "bnb-int8", "torch-fp16")
BNB_THRESHOLD = 6.0  # LLM.int8 outlier threshold: transformers' `BitsAndBytesConfig` default


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one float scale per row (symmetric, absmax)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # [V, 1]
        self.register_buffer("table", torch.round(w / scale).to(torch.int8))  # [V, H]
        self.register_buffer("scale", scale.to(dtype))
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.table.device)
        return self.table[ids].to(self.dtype) * self.scale[ids]


class TorchInt8Linear(nn.Module):
    """torch's dynamic int8 linear (fbgemm / oneDNN): int8 weights, one scale per output channel.

    Activations are quantized per call to 8 bits. torch's own module hard-codes `reduce_range=True`
    (7-bit activations, which keeps AVX2's int16 accumulation from saturating); on the embedded model
    that cost 4 points of top-1 agreement with fp32 (89% vs 93%), so the full range is used wherever
    the CPU has VNNI (int32 accumulation).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensor constructors are deprecated, the kernels are not
            qweight = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.reduce_range = not _cpu_has_vnni()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, reduce_range=self.reduce_range)


class TorchFp16Linear(nn.Module):
    """fbgemm's fp16-weight linear: weights stored in fp16, products in fp32."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


class FusedRMSNorm(nn.Module):
    """The original norm's weight through torch's single-kernel `rms_norm` (HF's takes six ops)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class CompressedAttention(nn.Module):
    """Llama-family self-attention (Llama, Mistral, Qwen2 biases, Qwen3 q/k norms) over one fused q/k/v
    projection, called like the transformers module it copies (`Pass.run_unit` does)."""

    def __init__(self, attn: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.qkv_proj = make(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
        self.o_proj = make(attn.o_proj)
        has_norms = hasattr(attn, "q_norm")
        self.q_norm = FusedRMSNorm(attn.q_norm) if has_norms else None
        self.k_norm = FusedRMSNorm(attn.k_norm) if has_norms else None

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, past_key_values: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        b, t, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).view(b, t, -1, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (e.unsqueeze(1) for e in position_embeddings)
        q, k = _rotary(q.transpose(1, 2), cos, sin), _rotary(k.transpose(1, 2), cos, sin)
        k, v = past_key_values.update(k, v.transpose(1, 2), self.layer_idx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling,
                                             enable_gqa=self.heads != self.kv_heads)
        return (self.o_proj(out.transpose(1, 2).reshape(b, t, -1)),)


class CompressedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection."""

    def __init__(self, mlp: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        self.gate_up_proj = make(_fuse([mlp.gate_proj, mlp.up_proj]))
        self.down_proj = make(mlp.down_proj)
        self.act_fn = mlp.act_fn
        self.split = mlp.gate_proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.split, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class CompressedLayer(nn.Module):
    """A decoder layer's compressed copy, with the parts `Pass.run_unit` calls."""

    def __init__(self, layer: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        self.input_layernorm = FusedRMSNorm(layer.input_layernorm)
        self.self_attn = CompressedAttention(layer.self_attn, make)
        self.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm)
        self.mlp = CompressedMLP(layer.mlp, make)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama applies it (rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _fuse(linears: list[nn.Linear]) -> nn.Linear:
    """One linear computing several over the same input, outputs concatenated (weights are shared copies)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=any(lin.bias is not None for lin in linears),
                      device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() if lin.bias is not None else
                                             weight.new_zeros(lin.out_features) for lin in linears]),
                                  requires_grad=False)
    return fused


@dataclass
class CompressedModel:
    """The drafting copy: one compressed decoder layer per original layer, LM head and embedding."""

    layers: list[nn.Module]
    lm_head: nn.Module
    embed: Int8Embedding
    norm: nn.Module  # shared with the model
    norm_device: torch.device
    head_device: torch.device
    backend: str
    build_ms: float

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + compressed LM head over hidden states [..., H] -> float32 logits [..., V]."""
        h = self.norm(hidden.to(self.norm_device))
        return self.lm_head(h.to(self.head_device)).float()

    def run(self, step: Pass, h: torch.Tensor, layers: range) -> torch.Tensor:
        """Run the compressed copies of `layers` on hidden states [1, T, H] within pass `step`."""
        for layer in layers:
            for kind in (ATTN, MLP):
                h = step.run_unit(h, layer, kind, module=self.layers[layer])
        return h


_COPIES: weakref.WeakKeyDictionary[Runner, dict[str, CompressedModel]] = weakref.WeakKeyDictionary()


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise SpecGUIError(f"unknown compression backend {backend!r}: use {', '.join(BACKENDS)}")
    if backend == "auto":
        return "bnb-int8" if device.type == "cuda" else "torch-int8"
    return backend


def compressed_copy(runner: Runner, backend: str = "auto") -> tuple[CompressedModel, bool]:
    """The runner's compressed copy for `backend`, and whether this call built it (first use only)."""
    backend = resolve_backend(backend, runner.device)
    per_runner = _COPIES.setdefault(runner, {})
    built = backend not in per_runner
    if built:
        per_runner[backend] = compress(runner, backend)
    return per_runner[backend], built


def compress(runner: Runner, backend: str) -> CompressedModel:
    """Build compressed copies of every decoder layer, the LM head and the embedding of `runner`'s model."""
    start = time.perf_counter()
    backend = resolve_backend(backend, runner.device)
    for module in (runner.embed, runner.lm_head, *runner.layers):
        for p in module.parameters():
            if p.device.type == "meta":
                raise SpecGUIError("Fractal needs every weight in memory: offloaded layers cannot be compressed")
            if backend.startswith("torch-") and p.device.type != "cpu":
                raise SpecGUIError(f"the {backend} backend runs on CPU only: use bnb-int8 on CUDA")
    if backend == "bnb-int8":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise SpecGUIError("the bnb-int8 backend needs bitsandbytes: pip install bitsandbytes") from None
        make = partial(_bnb_linear, bnb)
    else:
        make = TorchInt8Linear if backend == "torch-int8" else TorchFp16Linear
    try:
        layers = [CompressedLayer(layer, make) for layer in runner.layers]
    except AttributeError as exc:
        raise SpecGUIError(f"Fractal cannot compress {type(runner.layers[0]).__name__}: {exc}") from None
    return CompressedModel(layers=layers, lm_head=make(runner.lm_head),
                           embed=Int8Embedding(runner.embed.weight, runner.dtype), norm=runner.norm,
                           norm_device=execution_device(runner.norm), head_device=runner.head_device,
                           backend=backend, build_ms=(time.perf_counter() - start) * 1000)


def _bnb_linear(bnb: Any, linear: nn.Linear) -> nn.Module:
    """LLM.int8 linear quantized where the weight already is (no round trip through host memory)."""
    q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            has_fp16_weights=False, threshold=BNB_THRESHOLD, device="meta")
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(linear.weight.detach().to(torch.float16))
    q.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return q


@cache
def _cpu_has_vnni() -> bool:
    """AVX512-VNNI / AVX-VNNI accumulate u8 x s8 products in int32, so 8-bit activations cannot saturate."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags

"""Compressed copies of a model's decoder layers, LM head and embedding, used only for drafting (Fractal).

Fractal splices a compressed copy of the model into the full model's own forward; the copy is worth
having only if it is cheaper than the full-precision stack on the same device. Which kernel is cheaper
differs by device and shape, so the backend is a choice:

  * "bnb-int8" (CUDA): bitsandbytes' LLM.int8 `Linear8bitLt` (outlier threshold 6.0, transformers' default),
    the paper's choice. On an H100 it was barely cheaper than the fp16 forward: the outlier search and casts eat
    the int8 gain at decode's few rows. On a CPU it is several times *slower* than fp32.
  * "int8-weight-only" (CUDA, and CPUs with AVX2 + FMA): int8 weights with a scale per output channel,
    activations in the model's dtype: half the weight bytes of bf16 (a quarter of fp32), no activation
    quantization; what a memory-bound decode step wants. On CUDA `torch._weight_int8pack_mm`; on a CPU the
    skinny kernel's int8 form (`specgui/cpu/csrc/skinny_linear.c`: torch's own kernel there is far slower than
    fp32), which streams the int8 weights once for all of a pass's rows.
  * "fp8" (CUDA, compute capability 8.9+: Ada, Hopper): e4m3 weights with a scale per output channel,
    activations quantized per row at each call, `torch._scaled_mm` on the fp8 tensor cores.
  * "bnb-nf4" (CUDA): bitsandbytes' 4-bit NormalFloat `Linear4bit`, a quarter of the weight bytes.
  * "torch-int8" (CPU): torch's dynamic int8 linear (fbgemm/oneDNN): int8 weights with a scale per output
    channel, activations quantized per call (7-bit where the CPU lacks VNNI).
  * "torch-fp16" (CPU): fbgemm's fp16-weight linear, not int8: the measured comparison point for the
    int8 path's accuracy against its cost.
"auto" on CUDA measures the candidates the device can run (every CUDA backend above) on the projections of
as many layers as it takes to read past the caches, and the LM head, at the rows the caller's passes carry,
and builds the cheapest: the fastest measured is each device's default, not a guess. On a CPU it builds
int8-weight-only where the skinny kernel builds, else torch-int8. Measured on the embedded model (AMD EPYC,
two threads, 2026-11-25): every projection and the head of one pass took 8.9 ms against torch-int8's 11.8
at 3 rows and 12.7 against 13.9 at 5 (torch-int8 wins from 8 rows on, past what Fractal's CPU passes
carry); the compressed model's top-1 agreement with the full one was 94-99% against 81-93% on four held-out
prompts, the activations' quantization being what costs it; and Fractal on the held-out prompts (one per
category, 64 tokens) ran 1.24x against 1.09x, accepting 100% of its drafts against 98%.

On a CPU (fp32, int8-weight-only through the skinny library, Llama-shaped layers) a compressed pass does not go
through these modules' ~25 torch operations a layer: each copy carries a plan for `specgui.cpu.layers` (`_cpu_plan`),
the same three C calls a layer as the target model's own layers (norm, q/k/v products and rotary; attention, output
product and residual; norm, gate/up products, SiLU, down product and residual), over the int8 weights, with the new
keys handed to the pass's cache in between by its own `update`. A pass over 5 rows at a 128-token context took
20-21 ms through the modules, ~9 of them the int8 products, and 12.6-13.8 ms in C (AMD EPYC, two threads,
2026-11-25); Fractal on the held-out prompts went from 1.11-1.19x to 1.29x. Only drafts read these numbers;
`tests/test_fractal.py` checks them against the modules' over every cache window a pass uses.

The final norm is shared with the model (a vector of `hidden` weights: nothing to compress or gain). The
embedding is an int8 table with one scale per row: a lookup of a few rows costs nothing either way, but
the copy is what the paper's compressed model embeds with and keeps the drafting copy's memory small.

Copies keep their `layer_idx`, so a copy of layer i reads and writes cache slot i like the original;
the original modules are never touched. Building the copies quantizes every weight once (seconds on a
CPU), so `compressed_copy` keeps one copy per runner and backend for the runner's lifetime.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specgui.core.runner import Pass, Runner, execution_device
from specgui.cpu import kernels
from specgui.cpu import layers as cpu_layers
from specgui.errors import SpecGUIError

if TYPE_CHECKING:
    from specgui.core.vocab import DraftVocab

BACKENDS = ("auto", "torch-int8", "torch-fp16", "bnb-int8", "int8-weight-only", "fp8", "bnb-nf4")
CUDA_BACKENDS = ("bnb-int8", "int8-weight-only", "fp8", "bnb-nf4")
CPU_BACKENDS = ("torch-int8", "torch-fp16")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BNB_THRESHOLD = 6.0  # LLM.int8 outlier threshold: transformers' `BitsAndBytesConfig` default
LOG = logging.getLogger("specgui.compress")


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
    that costs a few points of top-1 agreement with fp32, so the full range is used wherever
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


class Int8WeightOnlyLinear(nn.Module):
    """int8 weights with one scale per output channel; activations stay in the model's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("weight", torch.round(w.float() / scale[:, None]).to(torch.int8))  # [N, K]
        self.register_buffer("scale", scale.to(w.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _int8_product(x, self.weight, self.scale, self.bias)

    def part(self, take: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The product of some of its outputs, `take` cutting them from each per-output tensor (a draft vocabulary's
        rows of a compressed head: `specgui.core.vocab.rows_of`); the skinny kernel sums each output alike whatever
        the count, so they are this module's outputs bit for bit."""
        weight, scale, bias = take(self.weight), take(self.scale), None if self.bias is None else take(self.bias)
        return lambda x: _int8_product(x, weight, scale, bias)


def _int8_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and x.dtype in kernels.DTYPES and kernels.skinny_library() is not None:
        return kernels.skinny_int8(rows, weight, scale, bias).view(*x.shape[:-1], -1)
    out = torch._weight_int8pack_mm(rows, weight, scale.to(x.dtype))
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], -1)


class Fp8Linear(nn.Module):
    """e4m3 weights with one scale per output channel; each call quantizes its rows (one scale per row)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
        self.register_buffer("weight", (w / scale[:, None]).to(torch.float8_e4m3fn))  # [N, K]
        self.register_buffer("scale", scale[None, :])  # [1, N], float32 as _scaled_mm wants
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        m = rows.shape[0]
        pad = -m % 16 if x.is_cuda else 0  # fp8 tensor-core GEMMs want dimensions in multiples of 16
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [M, 1]
        out = torch._scaled_mm((rows / scale).to(torch.float8_e4m3fn), self.weight.t(), scale_a=scale,
                               scale_b=self.scale, out_dtype=x.dtype)[:m]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], -1)


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

    def __init__(self, layer: nn.Module, make: Callable[[nn.Linear], nn.Module], capturable: bool = True) -> None:
        super().__init__()
        self.capturable = capturable  # whether a CUDA graph can hold it (`specgui.fastpath.Program`)
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
    fused: bool = False  # every layer carries a CPU plan (`_cpu_plan`): its passes run in C where the plan runs

    def logits(self, hidden: torch.Tensor, vocab: DraftVocab | None = None) -> torch.Tensor:
        """Final norm + compressed LM head (over a draft vocabulary's ids where given) over hidden states [R, H]
        -> float32 logits [R, V]."""
        h = self.norm(hidden.to(self.norm_device)).to(self.head_device)
        return self.lm_head(h).float() if vocab is None else vocab.logits(h, self.lm_head)

    def run(self, step: Pass, h: torch.Tensor, layers: range) -> torch.Tensor:
        """Run the compressed copies of `layers` on hidden states [1, T, H] within pass `step`."""
        return step.run_layers(h, layers, self.layers)


def _cpu_plan(runner: Runner, copy: CompressedLayer) -> cpu_layers.CPlan | None:
    """The plan `specgui.cpu.layers` runs a copy by: an fp32 model on a CPU, int8 weights through the skinny library,
    Llama's shape (no q/k norms, SiLU, query heads a multiple of the key/value heads); else None (its modules run)."""
    attn, mlp = copy.self_attn, copy.mlp
    int8 = all(type(m) is Int8WeightOnlyLinear and m.weight.device.type == "cpu" and m.scale.dtype == torch.float32
               for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    llama = attn.q_norm is None and cpu_layers.llama_shaped(attn.heads, attn.kv_heads, attn.head_dim, mlp.act_fn)
    if (runner.device.type != "cpu" or runner.dtype != torch.float32 or kernels.skinny_library() is None
            or not (int8 and llama)):
        return None
    q, kv, inner = attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim, mlp.split
    qkv, gate_up = partial(cpu_layers.Product.of, attn.qkv_proj), partial(cpu_layers.Product.of, mlp.gate_up_proj)
    products = {"q": qkv(0, q), "k": qkv(q, kv), "v": qkv(q + kv, kv), "o": cpu_layers.Product.of(attn.o_proj),
                "gate": gate_up(0, inner), "up": gate_up(inner, inner), "down": cpu_layers.Product.of(mlp.down_proj)}
    shape = (copy.input_layernorm.weight.shape[0], attn.heads, attn.kv_heads, attn.head_dim, inner)
    return cpu_layers.CPlan(attn.layer_idx, (copy.input_layernorm, copy.post_attention_layernorm), attn.scaling, shape,
                           products)


_COPIES: weakref.WeakKeyDictionary[Runner, dict[str, CompressedModel]] = weakref.WeakKeyDictionary()


def check_backend(backend: str, device: torch.device) -> None:
    """Refuse a backend this device cannot run, in one line."""
    if backend not in BACKENDS:
        raise SpecGUIError(f"unknown compression backend {backend!r}: use {', '.join(BACKENDS)}")
    if backend in CPU_BACKENDS and device.type != "cpu":
        raise SpecGUIError(f"the {backend} backend runs on CPU only: use one of {', '.join(CUDA_BACKENDS)} on CUDA")
    if backend == "int8-weight-only" and device.type == "cpu":
        if kernels.skinny_library() is None:
            raise SpecGUIError("the int8-weight-only backend needs the skinny kernel on a CPU (x86-64 with AVX2 and "
                               "FMA, and a C compiler): use torch-int8")
    elif backend in CUDA_BACKENDS and backend != "bnb-int8" and device.type != "cuda":
        raise SpecGUIError(f"the {backend} backend is for CUDA GPUs: use torch-int8 on a CPU")
    if backend == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        raise SpecGUIError("the fp8 backend needs an Ada or Hopper GPU (compute capability 8.9+)")


def compressed_copy(runner: Runner, backend: str = "auto", rows: int = 5) -> tuple[CompressedModel, bool]:
    """The runner's compressed copy for `backend` ("auto": the cheapest measured over `rows` rows, the rows the
    caller's passes carry; chosen once per runner), and whether this call built it (first use only)."""
    check_backend(backend, runner.device)
    per_runner = _COPIES.setdefault(runner, {})
    auto = backend == "auto"
    if auto:
        backend = per_runner["auto"].backend if "auto" in per_runner else cheapest(runner, rows)
    built = backend not in per_runner
    if built:
        per_runner[backend] = compress(runner, backend)
    if auto:  # an explicitly named backend never becomes what "auto" means
        per_runner["auto"] = per_runner[backend]
    return per_runner[backend], built


def candidates(device: torch.device) -> list[str]:
    """The backends `auto` chooses among on a device. On a CPU one: int8 weights with fp32 activations where the
    skinny kernel builds, as cheap as torch's dynamic int8 at a pass's 3-5 rows and more often right (see the
    module's notes), else torch's dynamic int8."""
    if device.type != "cuda":
        return ["int8-weight-only" if kernels.skinny_library() is not None else "torch-int8"]
    fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    return [b for b in CUDA_BACKENDS if b != "fp8" or fp8]


def cheapest(runner: Runner, rows: int = 5) -> str:
    """The candidate whose compressed pass over `rows` rows costs least: every layer's projections plus the
    compressed LM head, the largest single matrix of a small model. The projections are timed on copies of as
    many layers as it takes to read past the CPU's last-level cache (`kernels.STREAM_BYTES` at a byte a weight),
    and scaled to the layer count: a pass streams its weights from memory, and one layer's copy timed over and
    over would sit in cache and price arithmetic instead. Attention over the cache and the norms are the same
    whatever the backend, so they do not decide."""
    options = candidates(runner.device)
    per_layer = sum(p.numel() for p in runner.layers[0].parameters())
    count = min(runner.num_layers, -(-kernels.STREAM_BYTES // max(1, per_layer)))
    hidden = runner.config.hidden_size
    timings = {}
    for backend in options:
        try:
            make = _maker(backend)
            if len(options) == 1:  # nothing to choose between (a CPU's one candidate): that it can be made is enough
                timings[backend] = 0.0
                continue
            copies = [CompressedLayer(layer, make) for layer in runner.layers[:count]]
            linears = [m for c in copies for m in (c.self_attn.qkv_proj, c.self_attn.o_proj, c.mlp.gate_up_proj,
                                                  c.mlp.down_proj)]
            inputs = [torch.randn(1, rows, m_in, dtype=runner.dtype, device=runner.device)
                      for m_in in (hidden, runner.layers[0].self_attn.o_proj.in_features, hidden,
                                   runner.layers[0].mlp.down_proj.in_features)] * count
            head = make(runner.lm_head)
            x = torch.randn(rows, hidden, dtype=runner.dtype, device=runner.device)
            timings[backend] = (runner.num_layers / count * _time(linears, inputs, runner.device)
                                + _time([head], [x], runner.device))
        except (RuntimeError, SpecGUIError) as exc:  # a kernel this device or build lacks
            LOG.info("compression backend %s unavailable here: %s", backend, str(exc).splitlines()[0])
    if not timings:
        raise SpecGUIError(f"no compression backend runs here (tried {', '.join(options)})")
    LOG.info("compression backends over %d rows (ms a pass's linears): %s", rows,
             ", ".join(f"{b} {t * 1000:.2f}" for b, t in timings.items()))
    return min(timings, key=timings.get)


def _time(modules: list[nn.Module], inputs: list[torch.Tensor], device: torch.device, repeats: int = 20) -> float:
    """Median seconds of one call of every module on its input (after two warm-up calls)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = []
    with torch.inference_mode():
        for step in range(repeats + 2):
            sync()
            start = time.perf_counter()
            for module, x in zip(modules, inputs):
                module(x)
            sync()
            if step >= 2:
                samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _maker(backend: str) -> Callable[[nn.Linear], nn.Module]:
    """The function that builds one compressed linear for `backend`."""
    if backend.startswith("bnb-"):
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise SpecGUIError(f"the {backend} backend needs bitsandbytes: pip install bitsandbytes") from None
        return partial(_bnb_linear if backend == "bnb-int8" else _bnb_nf4, bnb)
    return {"torch-int8": TorchInt8Linear, "torch-fp16": TorchFp16Linear, "int8-weight-only": Int8WeightOnlyLinear,
            "fp8": Fp8Linear}[backend]


def compress(runner: Runner, backend: str) -> CompressedModel:
    """Build compressed copies of every decoder layer, the LM head and the embedding of `runner`'s model."""
    start = time.perf_counter()
    check_backend(backend, runner.device)
    for module in (runner.embed, runner.lm_head, *runner.layers):
        for p in module.parameters():
            if p.device.type == "meta":
                raise SpecGUIError("Fractal needs every weight in memory: offloaded layers cannot be compressed")
    make = _maker(backend)
    try:
        # bitsandbytes reads values on the host inside its kernels (outlier columns, quantization state)
        layers = [CompressedLayer(layer, make, capturable=not backend.startswith("bnb-")) for layer in runner.layers]
    except AttributeError as exc:
        raise SpecGUIError(f"Fractal cannot compress {type(runner.layers[0]).__name__}: {exc}") from None
    plans = [_cpu_plan(runner, copy) for copy in layers]
    if all(plans):
        for copy, plan in zip(layers, plans):
            copy.cpu_plan = plan
    return CompressedModel(layers=layers, lm_head=make(runner.lm_head),
                           embed=Int8Embedding(runner.embed.weight, runner.dtype), norm=runner.norm,
                           norm_device=execution_device(runner.norm), head_device=runner.head_device,
                           backend=backend, build_ms=(time.perf_counter() - start) * 1000,
                           fused=all(plans))


def _bnb_linear(bnb: Any, linear: nn.Linear) -> nn.Module:
    """LLM.int8 linear quantized where the weight already is (no round trip through host memory)."""
    q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            has_fp16_weights=False, threshold=BNB_THRESHOLD, device="meta")
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(linear.weight.detach().to(torch.float16))
    q.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return q


def _bnb_nf4(bnb: Any, linear: nn.Linear) -> nn.Module:
    """4-bit NormalFloat linear computing in the weight's dtype; bitsandbytes quantizes on the move to the device."""
    device, dtype = linear.weight.device, linear.weight.dtype
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=dtype, quant_type="nf4", device="cpu")
    q.weight = bnb.nn.Params4bit(linear.weight.detach().to("cpu", dtype), requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().to("cpu"), requires_grad=False)
    return q.to(device)


@cache
def _cpu_has_vnni() -> bool:
    """AVX512-VNNI / AVX-VNNI accumulate u8 x s8 products in int32, so 8-bit activations cannot saturate."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags

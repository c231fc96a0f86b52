"""Compiled programs: a decoder layer as a function of its weights, compiled once and shared by every layer.

Why: a fast-path program captured as a CUDA graph still replays every kernel the eager modules launch (a norm, rotary,
the cache write, the mask, the residual and the activation each its own kernel, ~25 a layer), and a captured launch
still costs microseconds: the embedded model's forward in one graph of eager kernels took several times the same forward
compiled by inductor on a GPU (docs/gpu.md). Here a layer's arithmetic is written once as plain tensor functions of its
weights (`attention_unit`, `mlp_unit`, `layer`), compiled by inductor, and called by the fast path's programs
(`fastpath`) with each layer's weights and cache buffers as arguments: one compilation serves all layers and all skip
plans, whatever stretch, plan or recording a program runs ("regional compilation"), so compile time does not grow with
plans. The programs stay as they were, captured as CUDA graphs on a GPU: the graph now replays inductor's kernels.

What is fused: q, k and v are one product and gate and up another (`LayerWeights.of` concatenates them; on a device
without CPU plans the modules' own weights become views of the fused ones, so nothing is held twice), the residual
is added in the kernel that follows each product, and inductor fuses the norms, rotary, the cache write and the
activation around them. Attention is grouped by hand: the query heads that share a key head become rows of one
product with that head's keys, so keys and values are read once and never repeated to every query head.

Rows of the static cache that no row of a forward sees are not zeroed here (the eager program masks them with a copy
of each layer's keys and values): a masked column's softmax weight is exactly zero, and the cache's buffers hold only
zeros (as allocated) and keys computed from real or padded rows, all finite, so zero times them adds nothing.

Numbers: fused products and kernels round differently from transformers' modules, so the compiled path equals the
eager one within rounding (near-ties may differ, as between any two kernels); every method on the compiled path
equals plain decoding on the same path token for token, as the tests hold. In half precision that needs inductor to
round each intermediate as eager does (`configure`): the whole-layer function and its two units then give the same
bits, so a skip plan's or recording program's layers equal the plain program's.

Compile once per machine: inductor's caches live under SpecGUI's cache directory (`configure`), so a second start
re-traces (seconds) but compiles nothing. The row count is a dynamic dimension: one compilation serves buckets of 2
rows and more, another the one-row step (dynamo specialises sizes 0 and 1).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specgui.errors import SpecGUIError
from specgui.model import hosting
from specgui.model.cachedir import cache_root

MODES = ("auto", "on", "off")
RECOMPILE_LIMIT = 64  # distinct (shape, row class, capacity) specialisations a process may hold per function


class Shape(NamedTuple):
    """The constants of a decoder layer's arithmetic, the same for every layer of a model."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    eps: float  # the input and post-attention norms'
    qk_eps: float  # q/k norms' (Qwen3), 0 where the layer has none
    by_hand: bool  # attention as grouped products and a softmax (CUDA), not torch's fused kernel (CPU)


class LayerWeights(NamedTuple):
    """One decoder layer's weights in the compiled functions' form (None where the layer has no such part)."""

    in_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [H, heads * head_dim]
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


def checked(mode: object) -> str:
    """`mode` if it names a compile mode; else a one-line error (front ends check before queueing a run)."""
    if mode not in MODES:
        raise SpecGUIError(f"compile must be one of {', '.join(MODES)}, got {mode!r}")
    return str(mode)


@functools.cache
def available(device_type: str) -> str | None:
    """Why inductor cannot compile for a device of `device_type` here, or None where it can (asked once a process:
    the CPU check runs the C++ compiler)."""
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_compiler_version_info(cpp_builder.get_cpp_compiler())
        except Exception as exc:  # no C++ compiler: inductor's CPU backend cannot build its kernels
            return f"no C++ compiler for inductor's CPU backend ({type(exc).__name__})"
        return None
    return f"inductor does not compile for {device_type} here"


def with_path(fast_path: str, mode: object) -> str:
    """`mode` checked beside the fast-path setting a front end was given: compiled programs are the fast path's, so
    asking for them with the fast path off is a one-line error rather than a setting that does nothing."""
    if checked(mode) == "on" and fast_path == "off":
        raise SpecGUIError("compiled programs run on the fast path; use --fast-path on (or --compile off)")
    return str(mode)


def resolve(mode: str, device: torch.device) -> bool:
    """Whether the fast path's programs are compiled. `auto`: on a CUDA GPU where inductor works, except on a ZeroGPU
    Space (its GPU comes and goes per call, so a compilation would be lost with it); `on`: wherever inductor works (a
    CPU included: slow to compile, how CI checks this path); `off`: eager programs."""
    if checked(mode) == "off":
        return False
    if mode == "auto":
        return device.type == "cuda" and available("cuda") is None and not hosting.on_zero_gpu()
    missing = available(device.type)
    if missing:
        raise SpecGUIError(f"cannot compile programs on {device.type}: {missing}; use --compile off")
    return True


@functools.cache
def _cache_directories() -> None:
    """Inductor's caches under SpecGUI's cache directory (a second start compiles nothing): environment variables,
    once a process."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # an older torch: its default is what it would name
        def default_cache_dir() -> str:
            return ""

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # inductor writes its default there once it has looked
    root = Path(chosen) if chosen and chosen != default_cache_dir() else cache_root() / "inductor"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root)
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


_configured = threading.local()


def configure() -> None:
    """Inductor's and dynamo's settings for SpecGUI's programs: caches under SpecGUI's cache directory, precision casts
    rounded as eager rounds them, and room for a few specialisations per function. Once a thread: torch keeps a setting
    made in code for the thread that made it (its config's user overrides are thread-local), and a function compiles
    in the thread that first calls it (the app's device thread, a test's, a CLI's main thread): a thread that had not
    made these settings compiled without the precision casts, its bf16 whole layer and units then disagreeing in the
    last bit."""
    if getattr(_configured, "done", False):
        return
    _cache_directories()
    import torch._dynamo
    import torch._inductor.config as inductor

    inductor.fx_graph_cache = True
    # round every bf16/fp16 intermediate as eager does: else fusion keeps some in float32 and a kernel's bits depend on
    # what it fused with, so the whole layer (plain programs) and its two units (skip plans, recording variants)
    # disagree in the last bit and a layer-skip method leaves plain decoding's tokens at a near-tie (H200, bf16)
    inductor.emulate_precision_casts = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * RECOMPILE_LIMIT)
    _configured.done = True


def shape_of(config: Any, by_hand: bool) -> Shape:
    """A model's layer constants, and the attention form (`by_hand`: the device's, `fastpath.device.Host.by_hand`):
    on a CPU torch's fused kernel takes grouped heads and a mask as they are (one call); on CUDA its fused kernels
    refuse that pair and its fallback repeats the keys and values to every query head (a copy of the cache per layer),
    so attention there is written out."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(heads, kv_heads, head_dim, head_dim ** -0.5, float(config.rms_norm_eps),
                 float(config.rms_norm_eps) if getattr(config, "model_type", "") == "qwen3" else 0.0, by_hand)


def supported(block: nn.Module) -> bool:
    """Whether a decoder layer has the shape the compiled functions compute: a pre-norm Llama-family layer with RMS
    norms, separate q/k/v products (q/k norms and q/k/v biases allowed), a gated SiLU MLP, no output biases."""
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
              [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(x) is nn.Linear for x in linears):
        return False
    act = getattr(getattr(mlp, "config", None), "hidden_act", None) or getattr(mlp, "hidden_act", "silu")
    norms = (getattr(block, "input_layernorm", None), getattr(block, "post_attention_layernorm", None))
    return (act in ("silu", "swish") and all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms)
            and linears[3].bias is None and all(x.bias is None for x in linears[4:])
            and not getattr(getattr(attn, "config", None), "sliding_window", None))


def _fused(parts: list[torch.Tensor], share: bool) -> torch.Tensor:
    """`parts` concatenated along rows; `share`: the parts' storage becomes views of the result (nothing held twice)."""
    whole = torch.cat([p.detach() for p in parts])
    if share:
        start = 0
        for p in parts:
            p.data = whole[start : start + p.shape[0]]
            start += p.shape[0]
    return whole


def weights_of(block: nn.Module) -> LayerWeights:
    """A supported layer's weights in the compiled form, made once and kept on the layer. Where the layer has a CPU
    plan (`specgui.cpu.layers`, whose C code holds the modules' weight pointers) the fused weights are copies; else
    the modules' weights become views of them."""
    found = getattr(block, "compiled_weights", None)
    if found is not None:
        return found
    attn, mlp = block.self_attn, block.mlp
    share = getattr(block, "cpu_plan", None) is None
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    bias = None if q.bias is None else _fused([q.bias, k.bias, v.bias], share)
    weights = LayerWeights(
        in_norm=block.input_layernorm.weight.detach(),
        qkv=_fused([q.weight, k.weight, v.weight], share), qkv_bias=bias,
        q_norm=None if getattr(attn, "q_norm", None) is None else attn.q_norm.weight.detach(),
        k_norm=None if getattr(attn, "k_norm", None) is None else attn.k_norm.weight.detach(),
        o=attn.o_proj.weight.detach(), post_norm=block.post_attention_layernorm.weight.detach(),
        gate_up=_fused([mlp.gate_proj.weight, mlp.up_proj.weight], share), down=mlp.down_proj.weight.detach())
    block.compiled_weights = weights
    return weights


# -- the arithmetic (plain tensor functions; `compiled()` compiles them) --------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, back to the input's dtype before the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [1, heads, T, D] with tables [1, T, D] (transformers' rotate_half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def attention_unit(h: torch.Tensor, w: LayerWeights, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, shape: Shape) -> torch.Tensor:
    """h + attention(norm(h)) for h [1, T, H]; the new keys and values are written into `keys`/`values`
    [1, kv_heads, C, D] at columns `index` [T]; row t reads the columns `mask` [1, 1, T, C] (bool) allows."""
    t, d, kvh = h.shape[1], shape.head_dim, shape.kv_heads
    groups = shape.heads // kvh
    qkv = F.linear(_rms_norm(h, w.in_norm, shape.eps), w.qkv, w.qkv_bias)
    q, k, v = qkv.split([shape.heads * d, kvh * d, kvh * d], dim=-1)
    q = q.view(1, t, shape.heads, d).transpose(1, 2)
    k = k.view(1, t, kvh, d).transpose(1, 2)
    if w.q_norm is not None:
        q, k = _rms_norm(q, w.q_norm, shape.qk_eps), _rms_norm(k, w.k_norm, shape.qk_eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    keys.index_copy_(2, index, k)
    values.index_copy_(2, index, v.view(1, t, kvh, d).transpose(1, 2))
    if shape.by_hand:  # the query heads of one key head as rows of one product with its keys
        grouped = q.reshape(kvh, groups * t, d)
        scores = torch.bmm(grouped, keys[0].transpose(1, 2)).float() * shape.scaling  # [kvh, groups * T, C]
        scores = scores.masked_fill(~mask.view(1, t, -1).repeat(1, groups, 1), float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1).to(values.dtype), values[0])  # [kvh, groups * T, D]
        out = out.view(1, shape.heads, t, d)  # query head kv * groups + g, as transformers repeats key heads
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=shape.scaling, enable_gqa=True)
    return h + F.linear(out.transpose(1, 2).reshape(1, t, shape.heads * d), w.o)


def mlp_unit(h: torch.Tensor, w: LayerWeights, shape: Shape) -> torch.Tensor:
    """h + down(silu(gate(x)) * up(x)) for x = norm(h)."""
    gate, up = F.linear(_rms_norm(h, w.post_norm, shape.eps), w.gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, w.down)


def layer(h: torch.Tensor, w: LayerWeights, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, shape: Shape) -> torch.Tensor:
    """A whole decoder layer: both units in one function, so that inductor fuses across them."""
    return mlp_unit(attention_unit(h, w, keys, values, cos, sin, mask, index, shape), w, shape)


FUNCTIONS: dict[str, Callable[..., Any]] = {"attention": attention_unit, "mlp": mlp_unit, "layer": layer}
_compiled: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a function of the fast path's programs one of `FUNCTIONS` (its programs call `compiled(name)` where they
    compile: many small operations become a few kernels), the function itself unchanged."""

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        FUNCTIONS[name] = fn
        return fn

    return add


def compiled(name: str) -> Callable[..., Any]:
    """The compiled form of `FUNCTIONS[name]`, one per process (dynamo keeps its specialisations), with this thread's
    settings made (`configure`: the call that follows compiles in this thread)."""
    configure()
    if name not in _compiled:
        _compiled[name] = torch.compile(FUNCTIONS[name], fullgraph=True, dynamic=None)
    return _compiled[name]


# -- what a compiled layer runs: counted from inductor's generated code, in fresh processes -------------------------

# a line of inductor's generated `call` that runs a kernel: its own (C++ or Triton), or an extern one (a product,
# attention) called by name or through torch.ops
_KERNEL_CALL = re.compile(
    r"^\s+(?:\w+ = )?(?:cpp_fused\w*\(|triton_\w+\.run\(|extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+)")


def probe_spec(runner: Any, rows: int = 1, capacity: int = 256) -> dict[str, Any]:
    """What `probe` needs to compile one layer of `runner`'s model: shapes and dtype, no weights."""
    config, block = runner.config, runner.layers[0]
    attn = block.self_attn
    return {"shape": list(shape_of(config, runner.device.type == "cuda")), "hidden": config.hidden_size,
            "inner": config.intermediate_size, "bias": attn.q_proj.bias is not None,
            "qk_norm": getattr(attn, "q_norm", None) is not None, "dtype": str(runner.dtype).removeprefix("torch."),
            "device": str(runner.device), "rows": rows, "capacity": capacity}


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile the whole-layer function for `spec` (`probe_spec`) on zero weights and run it once: the kernel calls
    in inductor's generated code, in order, and the FX graph cache's hits and misses. Meant for a fresh process
    (`probe_in_subprocess`): it resets dynamo, and a process that compiled before would count nothing new."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    shape = Shape(*spec["shape"])
    dtype, device = getattr(torch, spec["dtype"]), torch.device(spec["device"])
    hidden, inner, rows, columns = spec["hidden"], spec["inner"], spec["rows"], spec["capacity"]
    width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim

    def zeros(*size: int) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype, device=device)

    qk_norm = zeros(shape.head_dim) if spec["qk_norm"] else None
    weights = LayerWeights(zeros(hidden), zeros(width, hidden), zeros(width) if spec["bias"] else None, qk_norm,
                           qk_norm, zeros(hidden, shape.heads * shape.head_dim), zeros(hidden),
                           zeros(2 * inner, hidden), zeros(hidden, inner))
    keys, values = zeros(1, shape.kv_heads, columns, shape.head_dim), zeros(1, shape.kv_heads, columns, shape.head_dim)
    tables = zeros(1, rows, shape.head_dim)
    mask = torch.ones(1, 1, rows, columns, dtype=torch.bool, device=device)
    index = torch.arange(rows, device=device)
    with torch.inference_mode():
        _, codes = run_and_get_code(compiled("layer"), zeros(1, rows, hidden), weights, keys, values, tables, tables,
                                    mask, index, shape)
    calls = []
    for code in codes:
        body = code.split("\ndef call(", 1)[-1].split("\ndef ", 1)[0]
        calls += [re.sub(r"^\w+ = ", "", line.strip()).split("(")[0] for line in body.splitlines()
                  if _KERNEL_CALL.match(line)]
    found = counters["inductor"]
    return {"calls": calls, "cache_hits": found["fxgraph_cache_hit"], "cache_misses": found["fxgraph_cache_miss"]}


def probe_in_subprocess(spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """`probe` in a fresh Python process (with SpecGUI's cache directory, as any start has)."""
    code = ("import json, sys; from specgui.fastpath.compiled import probe; "
            "print(json.dumps(probe(json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        raise RuntimeError(f"compiling a layer in a fresh process failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])

"""Decoder layers on a CPU as three C calls each: the target model's (fp32) and Fractal's int8 copy.

Why: on a CPU a forward over a few rows is bound by streaming the weights through the products
(`specgui/cpu/kernels.py`), yet through transformers' modules every decoder layer also runs ~25 small torch operations
(norms, rotary, reshapes, grouped attention, SiLU, residuals), each 3-50 us of dispatch. For SmolLM2-135M on an AMD
EPYC (two threads) that was ~11 ms of a ~32 ms one-row forward, more than a third, paid again by every draft pass.
Here a layer is `layer_attention_in` (norm, q/k/v products, rotary), the cache's own `update` with the new keys and
values, `layer_attention_out` (attention, output product, residual) and `layer_mlp` (norm, gate/up products, SiLU,
down product, residual): cpu/csrc/skinny_linear.c, beside the products it calls. Where the cache has room in place
for the new keys (`KVCache.slot`), consecutive layers run as one call (`run_layers`), their keys and values written
by the C code: no Python between layers.

Exactness: each row's numbers depend only on its own input and the keys it sees, in column order (see the C file),
so a verify forward's rows equal the plain steps that produce the same tokens bit for bit, trees included.
`tests/test_cpu_layers.py` holds the layers to transformers' modules (within float rounding) and to that.

`install(model)` puts a `CPlan` on every Llama-shaped decoder layer of an fp32 CPU model and routes the layer's own
forward through it, so transformers' `generate` runs what SpecGUI's loop runs (`runner.sublayer` calls the two units
itself: methods skip, observe and splice sub-layers); comparisons stay like for like. It comes with the skinny kernel
(`--small-batch-matmul off` measures without either). What a plan does not cover runs transformers' modules: a prompt of
more than `PROMPT_ROWS` rows, a float mask (eager attention), a batch, gradients, another device or dtype, attention
weights asked for, layers of another shape (q/k norms, biases are fine).
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specgui.cpu import kernels

WEIGHT_TYPES = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}  # the C file's `enum weights`
PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")
_SUSPENDED = [False]  # `suspended()`: every layer runs its modules (comparisons in tests)
# A forward of more rows than this with nothing cached before them (a prompt's prefill) runs the modules: there the
# products are bound by arithmetic, where BLAS beats the skinny kernel (AMD EPYC, two threads, the embedded model's
# prefill: 16 rows 43 ms in C against 53, 32 rows 80 against 77, 41 rows 105 against 88, 64 rows 155 against 128).
# Verify forwards always follow a prefix and keep the C layers at any row count (a paper's Lookahead window verifies
# 120 rows): their rows must equal plain steps bit for bit on every machine, which BLAS does not give (its rounding
# follows the product's shape); a prompt's numbers only need to be the same for every method, and are.
PROMPT_ROWS = 24
MAX_HEAD_DIM = 256  # the C file's MAX_HEAD_DIM: its attention lays a block of keys out on the stack, this wide at most


class _Linear(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("out", ctypes.c_long)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("in_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("scaling", ctypes.c_float), ("hidden", ctypes.c_long),
                ("heads", ctypes.c_long), ("kv_heads", ctypes.c_long), ("head_dim", ctypes.c_long),
                ("inner", ctypes.c_long)] + [(name, _Linear) for name in PRODUCTS]


@dataclass(frozen=True)
class Product:
    """Rows [start, start + rows) of a weight [N, K] (int8 with one `scale` per row, fp32 or bf16), with its bias."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    start: int
    rows: int

    @classmethod
    def of(cls, linear: nn.Module, start: int = 0, rows: int | None = None) -> Product:
        """A linear module's product (an `nn.Linear`, or any module with `weight`, `bias` and optionally `scale`)."""
        rows = linear.weight.shape[0] if rows is None else rows
        return cls(linear.weight, getattr(linear, "scale", None), linear.bias, start, rows)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scale, self.bias) if t is not None]


class CPlan:
    """What the three calls need of one decoder layer (or a stand-in for layer `layer_idx`), as the C file's
    `struct layer`. Weights are read through their tensors' current addresses, checked at every call: a model moved
    or reloaded after the plan was made gets a new struct, never a stale pointer."""

    def __init__(self, layer_idx: int, norms: tuple[nn.Module, nn.Module], scaling: float,
                 shape: tuple[int, int, int, int, int], products: dict[str, Product]) -> None:
        self.layer_idx = layer_idx
        self.norms = norms
        self.scaling = scaling
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.inner = shape
        self.products = products
        self._tensors = [n.weight for n in norms] + [t for p in products.values() for t in p.tensors()]
        self._addresses: tuple[int, ...] = ()
        self._struct: _Layer | None = None

    def runs(self, h: torch.Tensor, mask: torch.Tensor | None) -> bool:
        """Whether `attention` and `mlp` compute a sub-layer over hidden states `h` [1, T, H] with `mask` (None:
        causal): the C library, fp32 rows on the CPU (at most `PROMPT_ROWS` for a prompt), no batch, no gradients, a
        bool mask, and every weight on the CPU in a type the C code takes (its struct rebuilt if a weight moved)."""
        if not covers(h, mask):
            return False
        addresses = tuple(t.data_ptr() for t in self._tensors)
        if addresses != self._addresses:
            self._struct = self._build()
            self._addresses = addresses
        return self._struct is not None

    def attention(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                  cache: Any) -> torch.Tensor:
        """h + attn(norm(h)) where `runs`; the new keys and values go through `cache.update` (None: no cache, as
        transformers' layers take it)."""
        library, address = kernels.skinny_library(), ctypes.addressof(self._struct)
        rows, threads, dim = h.shape[1], torch.get_num_threads(), self.head_dim
        x, (cos, sin) = _rows(h), _tables(rope, rows, dim)
        qkv = torch.empty(rows, (self.heads + 2 * self.kv_heads) * dim)
        _check(library.layer_attention_in(address, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.data_ptr(), rows,
                                          threads))
        heads = qkv.view(rows, -1, dim).transpose(0, 1).unsqueeze(0)  # [1, heads + 2 kv heads, T, D]
        keys, values = heads[:, self.heads : self.heads + self.kv_heads], heads[:, self.heads + self.kv_heads :]
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)
        keys, values = (t if t.stride(-1) == 1 and t.stride(-2) == dim else t.contiguous() for t in (keys, values))
        columns = keys.shape[-2]
        visible, out = _visible(mask, rows, columns), torch.empty(rows, self.hidden)
        _check(library.layer_attention_out(address, x.data_ptr(), out.data_ptr(), qkv.data_ptr(), keys.data_ptr(),
                                           values.data_ptr(), keys.stride(1), columns, _address(visible), rows,
                                           threads))
        return out.view(1, rows, self.hidden)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """h + mlp(norm(h)) where `runs`."""
        rows, x = h.shape[1], _rows(h)
        out = torch.empty(rows, self.hidden)
        _check(kernels.skinny_library().layer_mlp(ctypes.addressof(self._struct), x.data_ptr(), out.data_ptr(), rows,
                                                  torch.get_num_threads()))
        return out.view(1, rows, self.hidden)

    def _build(self) -> _Layer | None:
        if kernels.skinny_library() is None or any(t.device.type != "cpu" or not t.is_contiguous()
                                                   for t in self._tensors):
            return None
        if any(n.weight.dtype != torch.float32 for n in self.norms):
            return None
        linears = {}
        for name, p in self.products.items():
            vectors = [v for v in (p.scale, p.bias) if v is not None]
            if p.weight.dtype not in WEIGHT_TYPES or any(v.dtype != torch.float32 for v in vectors):
                return None
            linears[name] = _Linear(WEIGHT_TYPES[p.weight.dtype],
                                    p.weight.data_ptr() + p.start * p.weight.stride(0) * p.weight.element_size(),
                                    None if p.scale is None else p.scale.data_ptr() + 4 * p.start,
                                    None if p.bias is None else p.bias.data_ptr() + 4 * p.start, p.rows)
        before, after = self.norms
        return _Layer(before.weight.data_ptr(), after.weight.data_ptr(), _eps(before), _eps(after), self.scaling,
                      self.hidden, self.heads, self.kv_heads, self.head_dim, self.inner, **linears)


class _Call(ctypes.Structure):  # the C file's `struct layer_call`
    _fields_ = [("layer", ctypes.c_void_p), ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("head_stride", ctypes.c_long), ("start", ctypes.c_long), ("mask", ctypes.c_void_p)]


def run_layers(plans: list[CPlan], h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               masks: list[torch.Tensor | None], cache: Any) -> tuple[torch.Tensor, int]:
    """Consecutive layers over `h` as one C call (`layers_forward`), each as mlp(attention(h)) with its new keys and
    values written into the cache's buffers by the C code: the layers of one model (one shape), each with the
    `mask` of its own cache layout, every plan checked by `CPlan.runs` for these rows. Takes the cache's room in
    place for each layer in order (`KVCache.slot`) and runs the layers that got it: (output, how many ran); (h, 0),
    and nothing done, where the first gets none."""
    rows, slot = h.shape[1], getattr(cache, "slot", None)
    calls, kept = [], []  # kept: the masks' contiguous copies, alive through the call
    for plan, mask in zip(plans, masks):
        room = None if slot is None else slot(plan.layer_idx, rows)
        if room is None:
            break
        keys, values, start = room
        if keys.dtype != torch.float32 or not (keys.is_contiguous() and values.is_contiguous()):
            raise RuntimeError("a CPU decoder layer needs the cache's fp32 buffers as they were made")
        visible = _visible(mask, rows, start + rows)
        kept.append(visible)
        calls.append((ctypes.addressof(plan._struct), keys.data_ptr(), values.data_ptr(), keys.stride(1), start,
                      _address(visible)))
    if not calls:
        return h, 0
    first = plans[0]
    x, (cos, sin) = _rows(h), _tables(rope, rows, first.head_dim)
    out = torch.empty(rows, first.hidden)
    _check(kernels.skinny_library().layers_forward((_Call * len(calls))(*calls), len(calls), x.data_ptr(),
                                                   out.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows,
                                                   torch.get_num_threads()))
    return out.view(1, rows, first.hidden), len(calls)


def covers(h: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether hidden states `h` [1, T, H] and `mask` are of the kind the C units take (see `CPlan.runs`). A prompt:
    rows that see no cached column, a mask as wide as its rows or none over several rows (transformers passes none
    where every key is a new row's)."""
    if _SUSPENDED[0] or h.device.type != "cpu" or h.dtype != torch.float32 or h.dim() != 3 or h.requires_grad:
        return False
    rows = h.shape[1]
    prompt = rows > PROMPT_ROWS and (mask is None or mask.shape[-1] == rows)
    return (h.shape[0] == 1 and rows >= 1 and not prompt
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[:2] == (1, 1))))


def install(model: nn.Module) -> int:
    """Put a `CPlan` on every Llama-shaped decoder layer of an fp32 CPU `model` and route the layer's forward
    through it; returns how many layers got one (none where the skinny library does not build)."""
    decoder = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if (kernels.skinny_library() is None or decoder is None or not hasattr(decoder, "layers")
            or getattr(config, "_attn_implementation", None) != "sdpa"):
        return 0
    count = 0
    for layer in decoder.layers:
        plan = target_plan(layer)
        if plan is not None:
            layer.cpu_plan = plan
            layer.forward = types.MethodType(_layer_forward, layer)
            count += 1
    return count


def signature(model: nn.Module) -> str:
    """Which layers run: "c" where `install` put plans on the model's layers, else "modules" (a cost profile's key)."""
    layers = getattr(getattr(model, "model", None), "layers", [])
    return "c" if any(hasattr(layer, "cpu_plan") for layer in layers) else "modules"


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Within: every layer runs transformers' modules (for comparisons; process-wide, not for concurrent use)."""
    _SUSPENDED[0] = True
    try:
        yield
    finally:
        _SUSPENDED[0] = False


def target_plan(layer: nn.Module) -> CPlan | None:
    """A plan for one of the model's own decoder layers, or None where it is not Llama-shaped in fp32 on the CPU."""
    attn, ffn = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    parts = [getattr(attn, f"{p}_proj", None) for p in PRODUCTS[:4]] + [getattr(ffn, f"{p}_proj", None)
                                                                         for p in PRODUCTS[4:]]
    if (any(type(p) is not nn.Linear or p.weight.dtype != torch.float32 or p.weight.device.type != "cpu"
            for p in parts) or hasattr(attn, "q_norm") or not all(hasattr(n, "variance_epsilon") for n in norms)):
        return None
    dim = attn.head_dim
    heads, kv_heads = parts[0].out_features // dim, parts[1].out_features // dim
    if not llama_shaped(heads, kv_heads, dim, getattr(ffn, "act_fn", None)):
        return None
    shape = (parts[0].in_features, heads, kv_heads, dim, parts[4].out_features)
    return CPlan(attn.layer_idx, norms, attn.scaling, shape, {name: Product.of(p) for name, p in zip(PRODUCTS, parts)})


def llama_shaped(heads: int, kv_heads: int, head_dim: int, act_fn: nn.Module | None) -> bool:
    """Whether the C layer computes this shape: query heads a multiple of the key/value heads, an even head width
    (rotate-half rotary) of at most `MAX_HEAD_DIM`, a SiLU-gated MLP (q/k norms are the caller's to rule out)."""
    return (heads % kv_heads == 0 and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and type(act_fn).__name__ in ("SiLUActivation", "SiLU"))


def _layer_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                   use_cache: bool | None = False,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' decoder layer forward (same arguments, same result) through the layer's plan where it runs,
    else the class's own forward."""
    plan = self.cpu_plan
    if (position_embeddings is not None and not self.training and not kwargs.get("output_attentions")
            and plan.runs(hidden_states, attention_mask)):
        return plan.mlp(plan.attention(hidden_states, position_embeddings, attention_mask, past_key_values))
    return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache,
                              position_embeddings=position_embeddings, **kwargs)


def _rows(h: torch.Tensor) -> torch.Tensor:
    """Hidden states [1, T, H] as the C calls read them: [T, H], contiguous."""
    return h[0] if h.is_contiguous() else h[0].contiguous()


def _tables(rope: tuple[torch.Tensor, torch.Tensor], rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables [T, head_dim] as fp32, contiguous."""
    cos, sin = (e.reshape(rows, dim) for e in rope)
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return cos, sin


def _visible(mask: torch.Tensor | None, rows: int, columns: int) -> torch.Tensor | None:
    """A bool mask [1, 1, T, columns] as contiguous [T, columns] rows (None: causal)."""
    if mask is None:
        return None
    visible = mask.reshape(rows, columns)
    return visible if visible.is_contiguous() else visible.contiguous()


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _eps(norm: nn.Module) -> float:
    """A norm's epsilon: transformers' RMSNorm names it `variance_epsilon`, Fractal's copy (`FusedRMSNorm`) `eps`."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def _check(status: int) -> None:
    if status:
        raise RuntimeError("a CPU decoder layer call refused its shapes")

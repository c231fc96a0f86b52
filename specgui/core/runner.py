"""The layer runner: SpecGUI's own decoder loop over the model's modules.

`model.forward` hides what self-speculative methods need, so the runner drives the modules directly:
embedding -> rotary tables -> for each layer its attention and MLP *sub-layers* -> final norm -> LM head.
That lets a caller
  * skip any attention or MLP sub-layer (`SkipPlan`; a whole layer is both halves),
  * pass its own visibility matrix among the new tokens (branches and candidates in one forward),
  * watch the hidden state after every sub-layer (`observer`),
  * rewrite hidden states before a layer (`pre_layer`, how Fractal splices compressed passes in),
  * compute logits only for the rows it needs (the LM head is a large share of a small model).

With nothing skipped and the default causal visibility the result equals `model.forward` within rounding; a test holds
it to that. Exactness between the runner's own forwards: on a CPU that builds the skinny library, a row of a forward
that follows a cached prefix (a verify, a tree, a draft pass, at any row count) equals, bit for bit, the plain step that
produces the same token over the same prefix, on every such machine: its decoder layers run in C and its products (LM
head included) through the skinny kernel, whose rows never depend on the rows beside them (`specgui/cpu/kernels.py`
lists exactly where this holds and where rows agree only within rounding: a long prompt's prefill, transformers'
modules, a GPU). Greedy identity leans on it; what differs only within rounding is compared with a tolerance derived
from the arithmetic (`tests/helpers.py`). Layers may live on different devices (accelerate's `device_map`): hidden
states, rotary tables and masks follow each layer to its execution device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from specgui.core.kvcache import Cache, Layout, to_device
from specgui.cpu import attention
from specgui.cpu import layers as cpu_layers
from specgui.errors import SpecGUIError

ATTN, MLP = 0, 1
VERIFY_TOP = 2  # the ids a verify's head keeps per row (`Top`): the target's choice and the runner-up, for the margin

# observer(k, h): k = 0 is the embedding output, k = unit_index(layer, kind) the state after that sub-layer. An
# observer with a `stack(states)` method takes the fast path's recorded states of a forward that skips nothing whole
# instead, [2 * layers + 1, 1, T, H] in that order, in one call: a program's output, to copy what it keeps.
Observer = Callable[[int, torch.Tensor], None]
# pre_layer(layer, h, pass) -> h: may rewrite the hidden states [1, T, H] entering `layer`. It is called before every
# layer, or, where it names them in a `layers` attribute, before those only (`num_layers` among them: before the final
# norm); the layers between run as one piece (`Pass.run_layers`).
PreLayer = Callable[[int, torch.Tensor, "Pass"], torch.Tensor]


class DraftHead(Protocol):
    """The LM head over part of the vocabulary that a draft forward may end in (`specgui.core.vocab.DraftVocab`): float
    logits [R, V] of final-normed states [R, H], -inf for the ids it leaves out."""

    def logits(self, normed: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Top:
    """The head's verdict on some rows, in one float32 tensor [R, 3k + 1] that a step reads with one read: per row
    the k likeliest ids (exact in float32: vocabularies are far below 2**24), their logits, their probabilities,
    and the top-1 minus top-2 logit margin. The fast path computes it inside a forward's program; elsewhere
    `top_of` computes it from the logits, by the same arithmetic, so that every greedy choice (a verify's, a
    draft's) is made alike on every path."""

    packed: torch.Tensor
    k: int

    def __len__(self) -> int:
        return self.packed.shape[0]

    @property
    def ids(self) -> torch.Tensor:
        return self.packed[:, : self.k]

    @property
    def probs(self) -> torch.Tensor:
        return self.packed[:, 2 * self.k : 3 * self.k]

    def choices(self, values: list[float]) -> list[int]:
        """Each row's likeliest id, from `values`: `packed` as read, flattened (what follows it is left alone)."""
        width = self.packed.shape[1]
        return [int(values[r * width]) for r in range(len(self))]


def top_of(logits: torch.Tensor, k: int) -> Top:
    """The `Top` of float logits [R, V] (k at least 2: the margin needs the runner-up)."""
    k = max(2, k)
    values, ids = logits.topk(k, dim=-1)
    probs = (values - logits.logsumexp(-1, keepdim=True)).exp()
    return Top(torch.cat([ids.float(), values, probs, values[:, :1] - values[:, 1:2]], dim=1), k)


def as_tensor(values: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A host numpy array as a tensor sharing its memory, or a copy of a read-only one (a mask made once a shape, which
    torch would warn about sharing); a tensor as it is."""
    if not isinstance(values, np.ndarray):
        return values
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def _rows_of(packed: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    return packed[rows] if isinstance(rows, slice) else packed.index_select(0, to_device(rows, packed.device))


@dataclass(frozen=True)
class SkipPlan:
    """Which sub-layers a draft pass leaves out: attention and MLP, by layer index."""

    attn: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    def skips(self, layer: int, kind: int) -> bool:
        return layer in (self.attn if kind == ATTN else self.mlp)

    def __len__(self) -> int:
        return len(self.attn) + len(self.mlp)

    def to_dict(self) -> dict:
        return {"attn": sorted(self.attn), "mlp": sorted(self.mlp)}


def kept_units(skip: SkipPlan | None, layers: range) -> list[tuple[int, int]]:
    """The sub-layers (layer, kind) of `layers` that a pass with `skip` runs, in order (all of them without a plan)."""
    return [(layer, kind) for layer in layers for kind in (ATTN, MLP) if skip is None or not skip.skips(layer, kind)]


def unit_index(layer: int, kind: int) -> int:
    """Observer index of the hidden state after sub-layer (`layer`, `kind`); 0 is the embedding output."""
    return 2 * layer + kind + 1


def unit_at(index: int) -> tuple[int, int]:
    """(layer, kind) of the sub-layer after which the observer sees index `index` (>= 1)."""
    return divmod(index - 1, 2)


def execution_device(module: nn.Module) -> torch.device:
    """Where a module computes: accelerate's hook device if dispatched, else its first real parameter."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        if hook is not None and getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
        for param in sub.parameters(recurse=False):
            if param.device.type != "meta":
                return param.device
    return torch.device("cpu")


SUBLAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class Runner:
    """Owns the decoder loop of one Llama-family causal LM (Llama, Mistral, Qwen2/3, SmolLM)."""

    def __init__(self, model: nn.Module) -> None:
        decoder = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if decoder is None or not all(hasattr(decoder, p) for p in parts) or not hasattr(model, "lm_head"):
            raise SpecGUIError(
                f"unsupported architecture {type(model).__name__}: SpecGUI needs a Llama-family decoder "
                "(model.model.embed_tokens/layers/norm/rotary_emb and lm_head)"
            )
        layer0 = decoder.layers[0]
        if not all(hasattr(layer0, p) for p in SUBLAYER_PARTS):
            raise SpecGUIError(
                f"unsupported decoder layer {type(layer0).__name__}: SpecGUI needs pre-norm layers with "
                "input_layernorm, self_attn, post_attention_layernorm and mlp"
            )
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise SpecGUIError(f"attention implementation {impl!r} cannot take tree masks; load with sdpa or eager")
        self.model = model
        self.config = model.config
        self.embed = decoder.embed_tokens
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        self.lm_head = model.lm_head
        self.num_layers = len(self.layers)
        self.bool_masks = impl == "sdpa"
        if self.bool_masks:
            attention.install()  # grouped heads over a mask without copying the cache (CPU; see the module)
        self.dtype = next(model.parameters()).dtype
        self.embed_device = execution_device(self.embed)
        self.head_device = execution_device(self.lm_head)
        self.layer_devices = [execution_device(layer) for layer in self.layers]
        self.device = self.embed_device
        # bitsandbytes' quantized linears read values on the host inside their kernels: no CUDA graph holds them
        self.capturable = not any(type(m).__module__.startswith("bitsandbytes") for m in model.modules())
        self.static_cache: Any = None  # the fast path's cache (`specgui.fastpath.cache_for`), owned here
        self.compile_mode = "auto"  # whether the fast path's programs are compiled (`fastpath.compiled.resolve`)

    # -- public API -------------------------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor | np.ndarray,
        positions: torch.Tensor | np.ndarray,
        cache: Cache,
        *,
        visibility: torch.Tensor | np.ndarray | None = None,
        skip: SkipPlan | None = None,
        logits_rows: torch.Tensor | slice | None = None,
        observer: Observer | None = None,
        pre_layer: PreLayer | None = None,
        vocab: DraftHead | None = None,
        top: int = 0,
    ) -> torch.Tensor | Top:
        """Run new `tokens` [T] at absolute `positions` [T] over `cache`; return float logits [R, V].

        `visibility` [T, T] (bool, row attends to column) says which new tokens see each other; every
        new token sees the whole cached prefix. None means causal. Host values may come as numpy arrays (tokens,
        positions, visibility): the fast path packs them into its one upload as they are, where a host tensor would
        be read first (on a CPU a read like any other: `tools.dispatch` cannot tell the host's from the device's).
        `logits_rows` picks the rows whose logits are computed (None: all). Keys and values of every executed
        attention are appended to `cache` (pass `cache.view(n)` to leave it untouched).

        `top` = k > 0 returns the head's verdict on those rows instead (`Top`: the k likeliest ids, their logits and
        probabilities, the top-two margin), what greedy decoding reads; on the fast path the forward's one program
        computes it after the last layer, so that the final norm, the head and the reductions run inside it (on a
        GPU, captured with the layers instead of a launch each), and a `pre_layer` hook that offers its work as a
        program's (`in_program()`: `fastpath.InProgram`) runs inside the same program.

        A cache with `chunk_rows` (the fast path's) takes a causal forward over more tokens than that as
        consecutive chunks, each seeing the ones before through the cache: the same result, in the shapes
        the cache has programs for. An observer then hears each state once, for all rows. With a draft
        vocabulary (`specgui.core.vocab`) the head computes its ids' logits only, -inf elsewhere.
        """
        top = max(2, top) if top else 0
        chunk = getattr(cache, "chunk_rows", None)
        if chunk is None or len(tokens) <= chunk or visibility is not None or pre_layer is not None:
            step = self.new_pass(positions, cache, visibility)
            if top and observer is None and vocab is None:
                hook = None if pre_layer is None else getattr(pre_layer, "in_program", lambda: None)()
                packed = step.whole_forward(tokens, skip, top=top, hook=hook) if hook or pre_layer is None else None
                if packed is not None:
                    return Top(packed if logits_rows is None else _rows_of(packed, logits_rows), top)
            logits = self.logits(self._hidden(step, tokens, skip, observer, pre_layer), logits_rows, vocab)
            return top_of(logits, top) if top else logits
        stacks = hasattr(observer, "stack") and not skip
        collect = None if observer is None else _StackedChunks() if stacks else _Chunks()
        parts = [self._hidden(self.new_pass(positions[a : a + chunk], cache), tokens[a : a + chunk], skip, collect,
                              None).clone() for a in range(0, len(tokens), chunk)]  # clone: outputs are reused
        if collect is not None:
            collect.tell(observer)
        logits = self.logits(torch.cat(parts, dim=1), logits_rows, vocab)
        return top_of(logits, top) if top else logits

    def _hidden(self, step: Pass, tokens: torch.Tensor | np.ndarray, skip: SkipPlan | None, observer: Observer | None,
                pre_layer: PreLayer | None) -> torch.Tensor:
        """The last layer's output [1, T, H] of one forward, the pass `step`."""
        if pre_layer is None:
            h = step.whole_forward(tokens, skip, observer)
            if h is not None:
                return h
        h = self.embed(to_device(as_tensor(tokens), self.embed_device).view(1, -1))
        if observer is not None:
            observer(0, h)
        hooked = frozenset() if pre_layer is None else frozenset(getattr(pre_layer, "layers", range(self.num_layers)))

        def kinds(layer: int) -> list[int]:
            return [kind for _, kind in kept_units(skip, range(layer, layer + 1))]

        layer = 0
        while layer < self.num_layers:
            if layer in hooked:
                h = pre_layer(layer, h, step)
            if observer is None and len(kinds(layer)) == 2:  # whole layers, up to a hook or a skipped sub-layer
                end = layer + 1
                while end < self.num_layers and end not in hooked and len(kinds(end)) == 2:
                    end += 1
                h = step.run_layers(h, range(layer, end))
                layer = end
                continue
            for kind in kinds(layer):
                h = step.run_unit(h, layer, kind)
                if observer is not None:
                    observer(unit_index(layer, kind), step.lasting(h))
            layer += 1
        if self.num_layers in hooked:
            h = pre_layer(self.num_layers, h, step)
        return h

    def new_pass(self, positions: torch.Tensor | np.ndarray, cache: Cache,
                 visibility: torch.Tensor | np.ndarray | None = None) -> Pass:
        """The state one forward's sub-layers share; over the fast path's static cache, a `StaticPass`."""
        return getattr(cache, "pass_type", Pass)(self, positions, cache, visibility)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | slice | None = None,
               vocab: DraftHead | None = None) -> torch.Tensor:
        """Final norm + LM head (or a draft vocabulary's part of it) over the chosen rows of hidden states
        [1, T, H] -> float32 [R, V]."""
        if isinstance(rows, torch.Tensor):
            rows = to_device(rows, hidden.device)
        h = hidden[0] if rows is None else hidden[0, rows]
        h = self.norm(h.to(execution_device(self.norm))).to(self.head_device)
        return self.lm_head(h).float() if vocab is None else vocab.logits(h)


class _Chunks:
    """A chunked forward's states for its observer, a state per sub-layer, told once all chunks have run."""

    def __init__(self) -> None:
        self.states: dict[int, list[torch.Tensor]] = {}

    def __call__(self, k: int, h: torch.Tensor) -> None:
        self.states.setdefault(k, []).append(h)

    def tell(self, observer: Observer) -> None:
        for k, hs in self.states.items():
            observer(k, torch.cat(hs, dim=1))


class _StackedChunks(_Chunks):
    """`_Chunks` for an observer that takes a forward's states whole (`Observer`): each chunk's stack kept (a
    program's output is reused by the next chunk's program), told joined along the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks: list[torch.Tensor] = []

    def stack(self, states: torch.Tensor) -> None:
        self.stacks.append(states.clone())

    def tell(self, observer: Observer) -> None:
        if self.stacks:
            observer.stack(torch.cat(self.stacks, dim=2))
        super().tell(observer)


class Pass:
    """What every sub-layer of one forward shares: positions, rotary tables per device, masks, cache."""

    def __init__(self, runner: Runner, positions: torch.Tensor | np.ndarray, cache: Cache,
                 visibility: torch.Tensor | np.ndarray | None) -> None:
        self.runner = runner
        self.positions = to_device(as_tensor(positions), runner.embed_device).view(1, -1)
        self.cache = cache
        self.visibility = visibility
        self.length = self.positions.shape[1]
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[tuple[int, torch.device], torch.Tensor | None] = {}

    def rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._rope:
            if not self._rope:
                probe = torch.empty(0, dtype=self.runner.dtype, device=self.runner.embed_device)
                self._rope[self.runner.embed_device] = self.runner.rotary(probe, self.positions)
            cos, sin = next(iter(self._rope.values()))
            self._rope[device] = (cos.to(device), sin.to(device))
        return self._rope[device]

    def mask(self, layer: int, device: torch.device) -> torch.Tensor | None:
        """[1, 1, T, columns] attention mask for one layer, laid out by that layer's own cache length."""
        layout = self.cache.layout(layer, self.length)
        key = (layout, device)
        if key not in self._masks:
            self._masks[key] = self._build_mask(layout, device)
        return self._masks[key]

    def _build_mask(self, layout: Layout, device: torch.device) -> torch.Tensor | None:
        t = self.length
        if self.visibility is None:
            if t == 1 and layout.columns == layout.prefix + 1:
                return None  # one new token that sees everything: no mask needed
            visible = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        else:
            visible = as_tensor(self.visibility).to(device=device, dtype=torch.bool)
        allowed = torch.zeros(t, layout.columns, dtype=torch.bool, device=device)
        allowed[:, : layout.prefix] = True
        allowed[:, layout.offset : layout.offset + t] = visible
        allowed = allowed.view(1, 1, t, layout.columns)
        if self.runner.bool_masks:
            return allowed
        zero = torch.zeros((), dtype=self.runner.dtype, device=device)
        return torch.where(allowed, zero, torch.finfo(self.runner.dtype).min)

    def run_unit(self, h: torch.Tensor, layer: int, kind: int, module: nn.Module | None = None) -> torch.Tensor:
        """One residual sub-layer of `runner.layers[layer]`, or of `module` standing in for it.

        `module` substitutes another decoder layer of the same shape (a compressed copy); it still reads and
        writes this pass's cache at index `layer`.
        """
        device = self.runner.layer_devices[layer]
        if h.device != device:
            h = h.to(device)
        block = module if module is not None else self.runner.layers[layer]
        mask = self.mask(layer, device) if kind == ATTN else None
        rope = self.rope(device) if kind == ATTN else None
        return sublayer(block, kind, h, rope, mask, self.positions.to(device), self.cache)

    def run_layers(self, h: torch.Tensor, layers: range, modules: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """Both sub-layers of each of `layers` in order (of `modules[layer]` standing in for `runner.layers[layer]`
        where given, as in `run_unit`): consecutive ones as one call where this path has one (`one_call`), any other
        as its two sub-layers."""
        todo = list(layers)
        while todo:
            h, ran = self.one_call(h, todo, modules)
            if not ran:
                block = None if modules is None else modules[todo[0]]
                h = self.run_unit(self.run_unit(h, todo[0], ATTN, block), todo[0], MLP, block)
                ran = 1
            del todo[:ran]
        return h

    def one_call(self, h: torch.Tensor, layers: list[int],
                 modules: Sequence[nn.Module] | None = None) -> tuple[torch.Tensor, int]:
        """The leading layers of `layers` whose CPU plans run these rows, as one C call that writes their new keys
        into the cache's buffers in place (`specgui.cpu.layers.run_layers`): (output, how many ran); (h, 0), and
        nothing done, where the first cannot (no plan, or a cache without room in place: `KVCache.slot`)."""
        if getattr(self.cache, "slot", None) is None:
            return h, 0
        plans, masks = [], []
        for layer in layers:
            block = self.runner.layers[layer] if modules is None else modules[layer]
            plan, device = getattr(block, "cpu_plan", None), self.runner.layer_devices[layer]
            mask = self.mask(layer, device) if plan is not None and h.device == device else None
            if plan is None or h.device != device or not plan.runs(h, mask):
                break
            plans.append(plan)
            masks.append(mask)
        if not plans:
            return h, 0
        return cpu_layers.run_layers(plans, h, self.rope(h.device), masks, self.cache)

    def lasting(self, h: torch.Tensor) -> torch.Tensor:
        """`h` as returned by `run_unit`, made safe to keep past the next sub-layer (here it already is)."""
        return h

    def whole_forward(self, tokens: torch.Tensor, skip: SkipPlan | None = None,
                      observer: Observer | None = None, top: int = 0, hook: Any = None) -> torch.Tensor | None:
        """The last layer's output of the whole forward, `skip`'s sub-layers left out, `observer` told every state
        (or, with `top`, the packed `Top` of every row, a `hook` run inside: `fastpath.InProgram`), in one piece where
        this path has such a program (the fast path's); None: the caller runs the sub-layers."""
        return None

    def run_segment(self, h: torch.Tensor, layers: range, skip: SkipPlan | None = None) -> torch.Tensor:
        """`layers` in order on hidden states [1, T, H], `skip`'s sub-layers left out: one program on the fast path,
        the sub-layers one by one here."""
        for layer, kind in kept_units(skip, layers):
            h = self.run_unit(h, layer, kind)
        return h


def sublayer(block: nn.Module, kind: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
             mask: torch.Tensor | None, positions: torch.Tensor, cache: Cache) -> torch.Tensor:
    """One residual sub-layer of a pre-norm decoder layer: h + attn(norm(h)) or h + mlp(norm(h)); through the
    layer's CPU plan where it has one that runs these rows (`specgui.cpu.layers`), else through its modules."""
    plan = getattr(block, "cpu_plan", None)
    if plan is not None and plan.runs(h, mask):
        return plan.mlp(h) if kind == MLP else plan.attention(h, rope, mask, cache)
    if kind == MLP:
        return h + block.mlp(block.post_attention_layernorm(h))
    out = block.self_attn(hidden_states=block.input_layernorm(h), position_embeddings=rope, attention_mask=mask,
                          position_ids=positions, past_key_values=cache)[0]
    return h + out

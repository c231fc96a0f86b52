"""The fast path: every forward in static shapes, so that on a GPU each sub-layer is one CUDA graph replay.

Why: on a GPU the eager runner is dispatch-bound. One eager forward of the embedded 135M model cost 23.8 ms
on an H100, the same forward captured as a CUDA graph 3.0 ms, and 32 tokens in a graph only 1.15x one
token (`shared/GPU.md`). That flat verify cost is what speculative decoding lives on; eager dispatch
hides it, and every draft pass pays the dispatch again.

How, without giving up what methods need (skip plans that change every few steps, observers of hidden
states, Fractal's compressed passes spliced in mid-forward, ragged per-layer caches):
  * `StaticKVCache`: buffers of a capacity fixed when the run starts. Attention reads a layer's whole
    buffer and a mask hides what is not there; keys are written through device index tensors
    (`index_copy_`), so one captured kernel serves every step. Lengths stay on the host; `crop` and `keep`
    work in place as in `KVCache`. Read-only passes (`view`) put their own keys in a scratch region
    past the capacity, which no other pass sees.
  * Buckets: a forward of T tokens runs as the next size in `BUCKETS`. Padded rows see only themselves,
    no real row sees them, and their keys land past the layer's length, where the next forward
    overwrites them. Forwards beyond the largest bucket (a long prompt) run eagerly.
  * `BucketInputs`: per bucket, the device tensors every program of that bucket reads (rotary tables,
    masks [L, 1, 1, Tb, C], write indices [L, Tb]). A pass copies its own into them before it runs a
    sub-layer, unless they are already there; passes nest (Fractal's splices), so "already there" is
    checked per sub-layer, and a reload is a handful of copies.
  * `Program`: one sub-layer (a module, attention or MLP) at one bucket size. It reads its own input
    buffer and returns its own output buffer. On CUDA it is captured as a CUDA graph on first use and
    replayed afterwards; elsewhere it is the same function called on the same buffers, so a test on a
    CPU checks everything but the capture itself. A program's output lives until it runs again: the
    runner hands observers copies.
Per sub-layer programs are what lets skip plans, observers and splices keep working; the price is one
input copy and one launch per sub-layer.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specgui.errors import SpecGUIError
from specgui.kvcache import KVCache, Layout
from specgui.runner import ATTN, Pass, Runner, sublayer

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SCRATCH = 2 * BUCKETS[-1]  # rows past the capacity where read-only passes keep their own keys
SLACK = 512  # room past a run's last position for its largest forward (tree, branches, slots)
MODES = ("auto", "on", "off")
LOG = logging.getLogger("specgui.fastpath")
_CACHES: weakref.WeakKeyDictionary[Runner, StaticKVCache] = weakref.WeakKeyDictionary()


def bucket(rows: int) -> int | None:
    """The bucket a forward of `rows` tokens runs as; None beyond the largest (it runs eagerly)."""
    return next((b for b in BUCKETS if b >= rows), None)


def checked(mode: object) -> str:
    """`mode` if it names a fast-path mode; else a one-line error (front ends check before queueing a run)."""
    if mode not in MODES:
        raise SpecGUIError(f"fast path must be one of {', '.join(MODES)}, got {mode!r}")
    return str(mode)


def resolve(mode: str, runner: Runner) -> bool:
    """Whether a run uses the fast path: `auto` means on a CUDA GPU; `on` anywhere it can run."""
    checked(mode)
    usable = runner.bool_masks and len(set(runner.layer_devices) | {runner.embed_device, runner.head_device}) == 1
    if mode == "auto":
        return usable and runner.device.type == "cuda"
    if mode == "on" and not usable:
        raise SpecGUIError("the fast path needs sdpa attention and the whole model on one device; "
                           "use --fast-path off")
    return mode == "on"


def cache_for(runner: Runner, needed: int) -> StaticKVCache:
    """The runner's static cache, emptied, with room for `needed` positions plus one forward's slack.

    One cache serves a runner's runs, because captured graphs hold the addresses of its buffers: a new
    cache would capture every sub-layer again. A run that needs more room gets a larger cache (capacity
    doubled past the need, so that growth is rare), and its programs are captured anew.
    """
    cache = _CACHES.get(runner)
    if cache is None or cache.capacity < needed + SLACK:
        capacity = 256
        while capacity < needed + SLACK:
            capacity *= 2
        _CACHES[runner] = cache = StaticKVCache(runner, capacity)
    cache.crop(0)
    return cache


class StaticKVCache(KVCache):
    """Keys and values in buffers of `capacity` positions (plus scratch) per layer, allocated once."""

    pass_type: type[Pass]  # set below: forwards over this cache run as `StaticPass`

    def __init__(self, runner: Runner, capacity: int) -> None:
        super().__init__()
        config = runner.config
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.runner = runner
        self.capacity = capacity
        self.columns = capacity + SCRATCH
        self.graphs = runner.device.type == "cuda"
        shape = (1, heads, self.columns, head_dim)
        device = runner.device
        self.keys = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.values = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.lengths = [0] * runner.num_layers
        self.inputs: dict[int, BucketInputs] = {}
        self.programs: dict[tuple[int, int, int], Program] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None

    @property
    def store(self) -> StaticKVCache:
        return self

    def layout(self, layer: int, rows: int) -> Layout:
        n = self.lengths[layer]
        if n + rows > self.capacity:
            raise SpecGUIError(f"a forward of {rows} tokens at {n} does not fit the fast path's capacity of "
                               f"{self.capacity} positions; use --fast-path off")
        return Layout(n, n, self.columns)

    def view(self, length: int) -> StaticView:
        return StaticView(self, length)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a StaticKVCache is written by fast-path passes (runner.new_pass), not directly")

    def inputs_for(self, rows: int) -> BucketInputs:
        """The persistent inputs of a bucket (made on first use); a larger forward gets its own, once."""
        if bucket(rows) != rows:
            return BucketInputs.empty(self, rows)
        if rows not in self.inputs:
            self.inputs[rows] = BucketInputs.empty(self, rows)
        return self.inputs[rows]

    def program(self, block: nn.Module, layer: int, kind: int, inputs: BucketInputs) -> Program:
        """The program running `kind` of `block` (a decoder layer or a stand-in for layer `layer`) at a bucket."""
        key = (id(block), kind, inputs.rows)
        if key not in self.programs:
            mask = inputs.mask[layer]

            def run(x: torch.Tensor) -> torch.Tensor:
                return sublayer(block, kind, x, (inputs.cos, inputs.sin), mask, inputs.positions, inputs)

            example = torch.zeros(1, inputs.rows, self.runner.config.hidden_size, dtype=self.runner.dtype,
                                  device=self.runner.device)
            capturable = self.graphs and getattr(block, "capturable", True)
            self.programs[key] = Program(run, example, capturable, self.pool)
        return self.programs[key]


class StaticView:
    """A read-only window on the first `length` positions of a `StaticKVCache`: new keys go to scratch."""

    def __init__(self, store: StaticKVCache, length: int) -> None:
        self.store = store
        self.length = length

    pass_type: type[Pass]  # set below

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.length, self.store.lengths[layer_idx])

    def layout(self, layer: int, rows: int) -> Layout:
        if rows > SCRATCH:
            raise SpecGUIError(f"a read-only pass of {rows} tokens exceeds the fast path's scratch of {SCRATCH}")
        return Layout(self.get_seq_length(layer), self.store.capacity, self.store.columns)

    def view(self, length: int) -> StaticView:
        return StaticView(self.store, min(length, self.length))

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a StaticView is written by fast-path passes (runner.new_pass), not directly")


@dataclass
class BucketInputs:
    """The device tensors every program of one bucket reads, and which pass's values they hold now.

    It is also the cache object attention sees while a program runs: `update` writes a forward's keys at
    this bucket's write indices and returns the layer's whole buffers.
    """

    store: StaticKVCache
    rows: int
    positions: torch.Tensor  # [1, Tb]
    cos: torch.Tensor  # [1, Tb, D]
    sin: torch.Tensor
    mask: torch.Tensor  # [L, 1, 1, Tb, C] bool
    index: torch.Tensor  # [L, Tb] where each row's keys go, per layer
    owner: object = field(default=None, repr=False)

    @classmethod
    def empty(cls, store: StaticKVCache, rows: int) -> BucketInputs:
        runner, device = store.runner, store.runner.device
        positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        cos, sin = runner.rotary(torch.empty(0, dtype=runner.dtype, device=device), positions)
        return cls(store, rows, positions, cos, sin,
                   torch.zeros(runner.num_layers, 1, 1, rows, store.columns, dtype=torch.bool, device=device),
                   torch.zeros(runner.num_layers, rows, dtype=torch.long, device=device))

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.store.keys[layer_idx], self.store.values[layer_idx]
        k.index_copy_(2, self.index[layer_idx], keys)
        v.index_copy_(2, self.index[layer_idx], values)
        return k, v

    def load(self, owner: object, positions: torch.Tensor, layouts: list[Layout], visible: torch.Tensor) -> None:
        """Fill these inputs for a forward at `positions` [T] with `visible` [T, T], unless `owner`'s are here."""
        if self.owner is owner:
            return
        t, rows, runner = positions.shape[0], self.rows, self.store.runner
        device = self.positions.device
        padded = torch.empty(rows, dtype=torch.long)
        padded[:t] = positions
        padded[t:] = positions[-1]  # any real position: padded rows are never read
        self.positions.copy_(padded.view(1, rows))
        cos, sin = runner.rotary(self.cos, self.positions)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.mask.copy_(masks(layouts, visible, rows, device).unsqueeze(1).unsqueeze(1))
        offsets = torch.tensor([layout.offset for layout in layouts], device=device)
        self.index.copy_(offsets[:, None] + torch.arange(rows, device=device))
        self.owner = owner


def masks(layouts: list[Layout], visible: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """[L, rows, C] bool: row t of layer l sees [0, prefix_l) and the block at offset_l as `visible` says.

    `visible` [T, T] is padded to `rows`: a padded row sees only itself (a row seeing nothing would make
    softmax NaN, which would reach the cache), and no row sees a padded one.
    """
    t = visible.shape[0]
    block = torch.eye(rows, dtype=torch.bool)
    block[:t, :t] = visible
    block = block.to(device)
    columns = layouts[0].columns
    prefix = torch.tensor([x.prefix for x in layouts], device=device)[:, None]  # [L, 1]
    offset = torch.tensor([x.offset for x in layouts], device=device)[:, None]
    col = torch.arange(columns, device=device)[None, :]  # [1, C]
    rel = col - offset  # [L, C]: column j's row in the new block, if 0 <= rel < rows
    in_block = (rel >= 0) & (rel < rows)
    seen = block[:, rel.clamp(0, rows - 1)]  # [rows, L, C]
    allowed = (col < prefix)[None] | (in_block[None] & seen)
    return allowed.permute(1, 0, 2).contiguous()


class Program:
    """A function of one static input buffer, run by CUDA graph replay on CUDA, by a plain call elsewhere.

    `__call__` returns the output buffer, the same tensor every time. On CUDA the first call warms the
    function up on a side stream (lazy initialisations, allocator), captures it, and replays it; a
    function that cannot be captured (one that reads values on the host, like bitsandbytes' int8 outlier
    search) stays eager, once logged.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor, graphs: bool,
                 pool: Any) -> None:
        self.fn = fn
        self.input = torch.zeros_like(example)
        self.output: torch.Tensor | None = None
        self.graphs = graphs
        self.pool = pool
        self.graph: Any = None

    def __call__(self) -> torch.Tensor:
        if self.graphs and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            return self.output
        out = self.fn(self.input)
        if self.output is None:
            self.output = torch.empty_like(out)
        return self.output.copy_(out)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(self.input)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.output = self.fn(self.input)
        except RuntimeError as exc:
            LOG.warning("a sub-layer could not be captured as a CUDA graph and runs eagerly: %s",
                        str(exc).splitlines()[0])
            self.graphs, self.output = False, None
            return
        self.graph = graph


class StaticPass(Pass):
    """A forward over a `StaticKVCache` (or a view of one): bucketed rows, programs, device-side inputs."""

    def __init__(self, runner: Runner, positions: torch.Tensor, cache: StaticKVCache | StaticView,
                 visibility: torch.Tensor | None) -> None:
        super().__init__(runner, positions, cache, visibility)
        t = self.length
        self.host_positions = positions.cpu().view(-1)  # callers build positions on the host: no copy back
        self.store = cache.store
        self.writes = isinstance(cache, StaticKVCache)  # a view stores nothing
        self.layouts = [cache.layout(layer, t) for layer in range(runner.num_layers)]
        self.visible = (torch.ones(t, t, dtype=torch.bool).tril() if visibility is None
                        else visibility.to(device="cpu", dtype=torch.bool))
        self.inputs = self.store.inputs_for(bucket(t) or t)
        self.bucketed = bucket(t) is not None

    def run_unit(self, h: torch.Tensor, layer: int, kind: int, module: nn.Module | None = None) -> torch.Tensor:
        block = module if module is not None else self.runner.layers[layer]
        inputs, t = self.inputs, self.length
        inputs.load(self, self.host_positions, self.layouts, self.visible)
        if self.bucketed:
            program = self.store.program(block, layer, kind, inputs)
            program.input[:, :t].copy_(h)
            out = program()[:, :t]
        else:  # beyond the largest bucket (a long prompt): the same sub-layer, eagerly
            out = sublayer(block, kind, h, (inputs.cos, inputs.sin), inputs.mask[layer], inputs.positions, inputs)
        if kind == ATTN and self.writes:
            self.store.lengths[layer] = self.layouts[layer].offset + t
        return out

    def lasting(self, h: torch.Tensor) -> torch.Tensor:
        return h.clone()  # program outputs are overwritten when the program runs again


StaticKVCache.pass_type = StaticPass
StaticView.pass_type = StaticPass

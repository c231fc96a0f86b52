"""The fast path: every forward in static shapes, so that on a GPU it is one or a few CUDA graph replays.

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
    past the capacity, which no other pass sees. One cache per runner, held by the runner (so that
    dropping a model frees its cache and every graph with it).
  * Buckets: a forward of T tokens runs as the next size in `BUCKETS`. Padded rows see only themselves,
    no real row sees them, and their keys land past the layer's length, where the next forward
    overwrites them. A causal forward beyond the largest bucket (a long prompt) runs as bucketed chunks.
  * `BucketInputs`: per bucket, the device tensors every program of that bucket reads (rotary tables,
    masks [L, 1, 1, Tb, C], write indices [L, Tb]). A pass uploads what it needs in one non-blocking
    copy from pinned memory and builds the rest on the device, so loading never stalls the host.
  * `Program`: a function of one static input buffer at one bucket size, returning its own output buffer.
    On CUDA it is captured as a CUDA graph and replayed; elsewhere it is the same function called on the
    same buffers, so a test on a CPU checks everything but the capture itself. Two kinds:
      - whole: the whole forward (embedding to last layer) of a pass with no skip, observer or splice
        (baseline steps, most verifies): one replay a forward;
      - sub-layer: one attention or MLP sub-layer, for passes that skip, observe or splice.
    Every bucket's programs are captured at warm-up (`warm_up`), outside any timed step.

The contract that keeps held outputs right: a program's output is valid only until the next program runs.
Whatever a caller keeps across another program call it makes lasting (`Pass.lasting`): observers get
copies, Fractal's splice keeps the exact rows it returns, CLaSp's search keeps its states.
`overwrite_check()` enforces that contract for tests on any device: inside it, every program call fills
every other program's output with NaN, so a held output poisons the tokens instead of passing silently.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specgui.errors import SpecGUIError
from specgui.kvcache import KVCache, Layout, to_device
from specgui.runner import ATTN, MLP, Pass, Runner, sublayer

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # 128: Lookahead's window and branch, Self-Draft's wide trees
SCRATCH = 2 * BUCKETS[-1]  # rows past the capacity where read-only passes keep their own keys
SLACK = 512  # room past a run's last position for its largest forward (tree, branches, slots)
MODES = ("auto", "on", "off")
WHOLE = -1  # the `kind` of a whole-forward program
LOG = logging.getLogger("specgui.fastpath")


def bucket(rows: int) -> int | None:
    """The bucket a forward of `rows` tokens runs as; None beyond the largest."""
    return next((b for b in BUCKETS if b >= rows), None)


def checked(mode: object) -> str:
    """`mode` if it names a fast-path mode; else a one-line error (front ends check before queueing a run)."""
    if mode not in MODES:
        raise SpecGUIError(f"fast path must be one of {', '.join(MODES)}, got {mode!r}")
    return str(mode)


def resolve(mode: str, runner: Runner) -> bool:
    """Whether a run uses the fast path: `auto` means on a CUDA GPU with a model graphs can hold; `on`
    anywhere it can run (a quantized model then runs its static shapes eagerly)."""
    checked(mode)
    usable = runner.bool_masks and len(set(runner.layer_devices) | {runner.embed_device, runner.head_device}) == 1
    if mode == "auto":
        return usable and runner.device.type == "cuda" and runner.capturable
    if mode == "on" and not usable:
        raise SpecGUIError("the fast path needs sdpa attention and the whole model on one device; "
                           "use --fast-path off")
    return mode == "on"


def cache_for(runner: Runner, needed: int) -> StaticKVCache:
    """The runner's static cache, emptied, with room for `needed` positions plus one forward's slack.

    One cache serves a runner's runs, because captured graphs hold the addresses of its buffers: a new
    cache would capture every program again. A run that needs more room gets a larger cache (capacity
    doubled past the need, so that growth is rare). The runner holds it, so it lives exactly as long as
    the model (a module-level table would keep every model ever loaded alive, graphs and all).
    """
    cache = runner.static_cache
    if cache is None or cache.capacity < needed + SLACK:
        capacity = 256
        while capacity < needed + SLACK:
            capacity *= 2
        runner.static_cache = None  # the old cache's buffers and graphs go before the new ones are made
        runner.static_cache = cache = StaticKVCache(runner, capacity)
        warm_up(cache)
    cache.crop(0)
    return cache


def warm_up(cache: StaticKVCache, blocks: list[tuple[int, nn.Module]] | None = None) -> None:
    """Make (on CUDA: capture) every bucket's programs now, outside any timed step: the whole forward and
    each sub-layer of every layer, or, given `blocks` [(layer, module)], those of modules standing in for
    layers (Fractal's compressed copies). Captures run on inputs that touch only the scratch region, so
    the cache's contents stay as they are. Programs made before are skipped: a second call is free."""
    runner = cache.runner
    if blocks is None:
        blocks = [(None, None)] + [(layer, runner.layers[layer]) for layer in range(runner.num_layers)]
    started = time.perf_counter()
    made = 0
    with torch.inference_mode():
        for rows in BUCKETS:
            missing = [(layer, block, kind) for layer, block in blocks
                       for kind in ((WHOLE,) if block is None else (ATTN, MLP))
                       if _key(block, kind, rows) not in cache.programs]
            if not missing:
                continue
            inputs = cache.inputs_for(rows)
            inputs.load(_WARM_UP, torch.zeros(rows, dtype=torch.long),
                        [Layout(0, cache.capacity, cache.columns)] * runner.num_layers,
                        torch.eye(rows, dtype=torch.bool))
            for layer, block, kind in missing:
                program = cache.whole(inputs) if block is None else cache.program(block, layer, kind, inputs)
                program.prepare()
                made += 1
    if made:
        cache.capture_s += time.perf_counter() - started
        if cache.graphs:
            torch.cuda.synchronize()
            cache.graph_bytes = torch.cuda.memory_allocated(runner.device) - cache.base_bytes


def stats(runner: Runner) -> dict[str, Any]:
    """What the runner's fast path holds: programs, captured graphs, failed captures, time and memory."""
    cache = runner.static_cache
    if cache is None:
        return {"programs": 0, "graphs": 0, "whole_graphs": 0, "failed": 0, "capture_s": 0.0, "graph_bytes": 0}
    programs = cache.programs.values()
    return {"programs": len(cache.programs), "graphs": sum(p.graph is not None for p in programs),
            "whole_graphs": sum(p.graph is not None for k, p in cache.programs.items() if k[1] == WHOLE),
            "failed": sum(p.failed for p in programs), "capture_s": cache.capture_s,
            "graph_bytes": cache.graph_bytes}


@contextlib.contextmanager
def overwrite_check() -> Iterator[None]:
    """Inside: every program call fills every other program's output with NaN (any device).

    Stricter than the hardware (which overwrites an output only when the same program runs again), so a
    caller that keeps an output across any other program call gets NaN logits and wrong tokens.
    """
    global _checking
    before, _checking = _checking, True
    try:
        yield
    finally:
        _checking = before
        _live.clear()


_checking = False
_live: list[Program] = []  # outputs not yet poisoned, in check mode
_WARM_UP = object()  # the owner of inputs loaded for captures


def _key(block: nn.Module | None, kind: int, rows: int) -> tuple[int, int, int]:
    return (0 if block is None else id(block), kind, rows)


class StaticKVCache(KVCache):
    """Keys and values in buffers of `capacity` positions (plus scratch) per layer, allocated once."""

    pass_type: type[Pass]  # set below: forwards over this cache run as `StaticPass`
    chunk_rows = BUCKETS[-1]  # a causal forward over more rows runs as chunks of this many (the runner asks)

    def __init__(self, runner: Runner, capacity: int) -> None:
        super().__init__()
        config = runner.config
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.runner = runner
        self.capacity = capacity
        self.columns = capacity + SCRATCH
        self.graphs = runner.device.type == "cuda" and runner.capturable
        shape = (1, heads, self.columns, head_dim)
        device = runner.device
        self.keys = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.values = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.lengths = [0] * runner.num_layers
        self.inputs: dict[int, BucketInputs] = {}
        self.programs: dict[tuple[int, int, int], Program] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.side = torch.cuda.Stream(device) if self.graphs else None  # every capture's warm-up runs here
        self.capture_s = 0.0
        self.graph_bytes = 0
        if self.graphs:
            self.base_bytes = torch.cuda.memory_allocated(runner.device)

    @property
    def store(self) -> StaticKVCache:
        return self

    def layout(self, layer: int, rows: int) -> Layout:
        n = self.lengths[layer]
        if n + rows > self.capacity:
            raise SpecGUIError(f"a forward of {rows} tokens at {n} does not fit the fast path's capacity of "
                               f"{self.capacity} positions; use --fast-path off")
        return Layout(n, n, self.columns)

    def view(self, length: int, scratch: bool = False) -> StaticView:
        return StaticView(self, length)  # a static view's keys always go to the scratch region

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a StaticKVCache is written by fast-path passes (runner.new_pass), not directly")

    def slot(self, layer: int, rows: int) -> None:
        """No room for a one-call layer (`KVCache.slot`): fast-path passes write this cache, as `update` says."""
        return None

    def inputs_for(self, rows: int) -> BucketInputs:
        """The persistent inputs of a bucket (made on first use); a larger forward gets its own, once."""
        if bucket(rows) != rows:
            return BucketInputs.empty(self, rows)
        if rows not in self.inputs:
            self.inputs[rows] = BucketInputs.empty(self, rows)
        return self.inputs[rows]

    def program(self, block: nn.Module, layer: int, kind: int, inputs: BucketInputs) -> Program:
        """The program running `kind` of `block` (a decoder layer or a stand-in for layer `layer`) at a bucket."""
        key = _key(block, kind, inputs.rows)
        if key not in self.programs:
            mask = inputs.mask[layer]

            def run(x: torch.Tensor) -> torch.Tensor:
                return sublayer(block, kind, x, (inputs.cos, inputs.sin), mask, inputs.positions, inputs)

            example = torch.zeros(1, inputs.rows, self.runner.config.hidden_size, dtype=self.runner.dtype,
                                  device=self.runner.device)
            self.programs[key] = Program(run, example, self, getattr(block, "capturable", True))
        return self.programs[key]

    def whole(self, inputs: BucketInputs) -> Program:
        """The program running a whole forward at a bucket: token ids [1, Tb] in, last layer's output out."""
        key = _key(None, WHOLE, inputs.rows)
        if key not in self.programs:
            runner = self.runner

            def run(ids: torch.Tensor) -> torch.Tensor:
                h = runner.embed(ids)
                for layer in range(runner.num_layers):
                    for kind in (ATTN, MLP):
                        h = sublayer(runner.layers[layer], kind, h, (inputs.cos, inputs.sin), inputs.mask[layer],
                                     inputs.positions, inputs)
                return h

            example = torch.zeros(1, inputs.rows, dtype=torch.long, device=runner.device)
            self.programs[key] = Program(run, example, self, True)
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

    def view(self, length: int, scratch: bool = False) -> StaticView:
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
        """Fill these inputs for a forward at `positions` [T] (host) with `visible` [T, T], unless `owner`'s
        are here. One upload of [positions, prefixes, offsets, visible block] packed in one host tensor;
        rotary tables, masks and write indices are then built on the device."""
        if self.owner is owner:
            return
        t, rows, n = positions.shape[0], self.rows, len(layouts)
        packed = torch.empty(rows + 2 * n + rows * rows, dtype=torch.long)
        packed[:t] = positions
        packed[t:rows] = positions[-1]  # any real position: padded rows are never read
        packed[rows : rows + n] = torch.tensor([x.prefix for x in layouts])
        packed[rows + n : rows + 2 * n] = torch.tensor([x.offset for x in layouts])
        block = torch.eye(rows, dtype=torch.long)  # a padded row sees only itself
        block[:t, :t] = visible
        packed[rows + 2 * n :] = block.view(-1)
        data = to_device(packed, self.positions.device)
        self.positions.copy_(data[:rows].view(1, rows))
        cos, sin = self.store.runner.rotary(self.cos, self.positions)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        prefix, offset = data[rows : rows + n, None], data[rows + n : rows + 2 * n, None]
        self.mask.copy_(masks(prefix, offset, data[rows + 2 * n :].view(rows, rows).bool(), layouts[0].columns)
                        .unsqueeze(1).unsqueeze(1))
        self.index.copy_(offset + torch.arange(rows, device=data.device))
        self.owner = owner


def masks(prefix: torch.Tensor, offset: torch.Tensor, block: torch.Tensor, columns: int) -> torch.Tensor:
    """[L, rows, C] bool: row t of layer l sees [0, prefix_l) and the block at offset_l as `block` says.

    `prefix`, `offset` [L, 1] and `block` [rows, rows] (already padded: a padded row sees only itself, as a
    row seeing nothing would make softmax NaN, which would reach the cache) live on the target device.
    """
    rows = block.shape[0]
    col = torch.arange(columns, device=block.device)[None, :]  # [1, C]
    rel = col - offset  # [L, C]: column j's row in the new block, if 0 <= rel < rows
    in_block = (rel >= 0) & (rel < rows)
    seen = block[:, rel.clamp(0, rows - 1)]  # [rows, L, C]
    allowed = (col < prefix)[None] | (in_block[None] & seen)
    return allowed.permute(1, 0, 2).contiguous()


class Program:
    """A function of one static input buffer, run by CUDA graph replay on CUDA, by a plain call elsewhere.

    `__call__` returns the output buffer, the same tensor every time. On CUDA `prepare` (at warm-up, or on
    first use) runs the function once on the cache's side stream (lazy initialisations, allocator), then
    captures it into the cache's graph memory pool; a function that cannot be captured stays eager.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor, store: StaticKVCache,
                 capturable: bool) -> None:
        self.fn = fn
        self.store = store
        self.input = torch.zeros_like(example)
        self.output: torch.Tensor | None = None
        self.graphs = store.graphs and capturable
        self.graph: Any = None
        self.failed = False
        self.ready = False

    def prepare(self) -> None:
        """Capture now (CUDA) or mark ready (elsewhere); called once, before the first call."""
        self.ready = True
        if self.graphs:
            self._capture()

    def __call__(self) -> torch.Tensor:
        if not self.ready:
            self.prepare()
        if self.graph is not None:
            self.graph.replay()
        else:
            out = self.fn(self.input)
            if self.output is None:
                self.output = torch.empty_like(out)
            self.output.copy_(out)
        if _checking:
            for other in _live:
                if other is not self and other.output is not None:
                    other.output.fill_(float("nan"))
            _live[:] = [self]
        return self.output

    def _capture(self) -> None:
        side = self.store.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(self.input)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.store.pool, stream=side):
                self.output = self.fn(self.input)
        except RuntimeError as exc:
            if not any(p.failed for p in self.store.programs.values()):
                LOG.warning("a program could not be captured as a CUDA graph and runs eagerly (others may "
                            "follow, logged once): %s", str(exc).splitlines()[0])
            self.graphs, self.output, self.failed = False, None, True
            return
        self.graph = graph


class StaticPass(Pass):
    """A forward over a `StaticKVCache` (or a view of one): bucketed rows, programs, device-side inputs."""

    def __init__(self, runner: Runner, positions: torch.Tensor, cache: StaticKVCache | StaticView,
                 visibility: torch.Tensor | None) -> None:
        # positions stay on the host (callers build them there): they reach the device inside the one upload
        self.runner, self.cache, self.visibility = runner, cache, visibility
        self.host_positions = positions.view(-1).cpu()
        t = self.length = self.host_positions.shape[0]
        self.store = cache.store
        self.writes = isinstance(cache, StaticKVCache)  # a view stores nothing
        self.layouts = [cache.layout(layer, t) for layer in range(runner.num_layers)]
        self.visible = (torch.ones(t, t, dtype=torch.bool).tril() if visibility is None
                        else visibility.to(device="cpu", dtype=torch.bool))
        self.bucketed = bucket(t) is not None
        self.inputs = self.store.inputs_for(bucket(t) or t)

    def _load(self) -> None:
        self.inputs.load(self, self.host_positions, self.layouts, self.visible)

    def whole_forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The whole forward as one program: token ids [T] (host) -> last layer's output [1, T, H]."""
        if not self.bucketed:
            return None
        self._load()
        t = self.length
        program = self.store.whole(self.inputs)
        program.input[0, :t].copy_(to_device(tokens.view(-1), program.input.device))
        out = program()[:, :t]
        if self.writes:
            for layer, layout in enumerate(self.layouts):
                self.store.lengths[layer] = layout.offset + t
        return out

    def run_unit(self, h: torch.Tensor, layer: int, kind: int, module: nn.Module | None = None) -> torch.Tensor:
        block = module if module is not None else self.runner.layers[layer]
        inputs = self.inputs
        self._load()
        if self.bucketed:
            program = self.store.program(block, layer, kind, inputs)
            program.input[:, : self.length].copy_(h)
            out = program()[:, : self.length]
        else:  # beyond the largest bucket and not causal (a huge tree): the same sub-layer, eagerly
            out = sublayer(block, kind, h, (inputs.cos, inputs.sin), inputs.mask[layer], inputs.positions, inputs)
        if kind == ATTN and self.writes:
            self.store.lengths[layer] = self.layouts[layer].offset + self.length
        return out

    def one_call(self, h: torch.Tensor, layers: list[int],
                 modules: Sequence[nn.Module] | None = None) -> tuple[torch.Tensor, int]:
        """None run: a layer here is its two sub-layers' programs."""
        return h, 0

    def lasting(self, h: torch.Tensor) -> torch.Tensor:
        return h.clone()  # program outputs are overwritten when the program runs again


StaticKVCache.pass_type = StaticPass
StaticView.pass_type = StaticPass

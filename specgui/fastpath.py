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
    copy from pinned memory, and one program of the bucket (its `builder`) builds the rest on the device: loading
    never stalls the host and costs the device a copy and a replay, not a launch per tensor operation.
  * `Program`: a function of one static input buffer at one bucket size, returning its own output buffer.
    On CUDA it is captured as a CUDA graph and replayed; elsewhere it is the same function called on the
    same buffers, so a test on a CPU checks everything but the capture itself. A pass runs as one program:
      - forward: a stretch of layers (the whole model from the embedding, for a forward; a piece of one, for what
        runs piecewise) with a skip plan's sub-layers left out and, where the pass is observed, every sub-layer's
        state recorded into the output, or a pre-layer hook's work inside it (Fractal's splice: `InProgram`)
        (`StaticKVCache.forward_program`). The plain forward's programs are made at warm-up (`warm_up`); a skip
        plan's when a method adopts it (`adopt`), a bounded number of plans kept (`PLANS`), a method's own at its
        setup, so that a capture is never taken inside a step that is timed;
      - rows: a function over a bucket of rows that runs many layers' sub-layers on them (CLaSp's whole search:
        `StaticPass.rows_program`);
      - sub-layer: one attention or MLP sub-layer, for what still runs piecewise (the cost model's per-sub-layer
        prices, a pass whose observer or hook sits between sub-layers).
    Every program owns its output buffer, allocated before capture outside the graphs' shared memory pool: a
    replay of a program captured earlier can reuse the pool's memory of one captured later, never its output. The
    verify forwards' Tops are the exception: they go to the cache's `readout`, just before a draft chain's, so that
    a step reads the verdict and the chain as one span.

The contract that keeps held outputs right: a program's output is valid only until the next program runs.
Whatever a caller keeps across another program call it makes lasting (`Pass.lasting`): observers get
copies, Fractal's splice keeps the exact rows it returns, CLaSp's search keeps its states.
`overwrite_check()` enforces that contract for tests on any device: inside it, every program call fills
every other program's output with NaN, so a held output poisons the tokens instead of passing silently.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from specgui import compiled
from specgui.errors import SpecGUIError
from specgui.kvcache import Cache, KVCache, Layout, to_device, upload
from specgui.runner import (
    ATTN,
    MLP,
    VERIFY_TOP,
    Observer,
    Pass,
    Runner,
    SkipPlan,
    kept_units,
    sublayer,
    top_of,
    unit_index,
)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # 128: Lookahead's window and branch, Self-Draft's wide trees
SCRATCH = 2 * BUCKETS[-1]  # rows past the capacity where read-only passes keep their own keys
SLACK = 512  # room past a run's last position for its largest forward (tree, branches, slots)
MODES = ("auto", "on", "off")
FORWARD = -1  # the `kind` of a forward program (a stretch of layers as one program)
KEEP = -2  # the `kind` of a keeper program (moves a step's accepted keys into place in every layer)
CHAINED = -3  # the `kind` of a chained draft program (`StaticKVCache.chain`)
ROWS = -4  # the `kind` of a rows program (`StaticPass.rows_program`)
CHAIN = 32  # the longest draft chain a chained program keeps (`LayerSkipParams.max_draft`'s bound)
CHAIN_NODES = 16  # the most ids a chained draft keeps a position (SWIFT's widest candidate width)
PLANS = 8  # skip plans whose forward programs a cache keeps (the least recently used goes first)
Piece = tuple[Sequence[nn.Module] | None, range]  # a stretch of layers run as one program (modules standing in)
RunRows = Callable[[torch.Tensor, int, tuple[int, ...]], torch.Tensor]  # (h [Tb, H], layer, kinds) -> h, in a program
# (h [1, T, H], layers, modules, rows) -> h: those layers of `modules` on h inside a forward's program, over the
# forward's own inputs or, given `rows` (start, count), over those rows of them
RunLayers = Callable[[torch.Tensor, range, Sequence[nn.Module], tuple[int, int] | None], torch.Tensor]


class InProgram(Protocol):
    """A pre-layer hook's work inside a whole forward's program (Fractal's splice), where the hook offers one
    (`Runner.forward` asks its `in_program()`): before each of `layers`, `inside(layer, h, run)` -> h. `key` names
    what the function does (a program is made per key and bucket: `rows` is the forward's rows); the tensors it
    writes for the host live at fixed addresses (the cache's `tail`)."""

    key: Any
    layers: frozenset[int]
    rows: int

    def inside(self, layer: int, h: torch.Tensor, run: RunLayers) -> torch.Tensor: ...
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
    compiles = compiles_for(runner)
    if cache is None or cache.capacity < needed + SLACK or cache.compiled != compiles:
        capacity = 256
        while capacity < needed + SLACK:
            capacity *= 2
        runner.static_cache = None  # the old cache's buffers and graphs go before the new ones are made
        runner.static_cache = cache = StaticKVCache(runner, capacity)
        warm_up(cache)
    cache.crop(0)
    return cache


def compiles_for(runner: Runner) -> bool:
    """Whether the runner's fast-path programs run compiled kernels, by its `compile_mode` (`compiled.resolve`)."""
    return compiled.resolve(runner.compile_mode, runner.device)


def warm_up(cache: StaticKVCache, pieces: Sequence[Piece] | None = None, plans: Sequence[SkipPlan] = (),
            buckets: Sequence[int] = BUCKETS, nodes: int = 1, hooks: Sequence[InProgram] = ()) -> None:
    """Make (on CUDA: capture) programs now, outside any timed step: by default every bucket's plain forward, the
    same ending in a verify's head (`Runner.forward(top=)`), its recording variant and, at one row, each sub-layer
    of every layer (what the cost model times: no pass runs a sub-layer alone at more rows but a forward past the
    buckets, and a capture costs a device synchronisation and an emptied allocator cache, so the 60 a bucket would
    be most of a cache's captures); given `pieces`, those stretches of layers, one program each (`Drafter.pieces`);
    given `plans`, those skip plans' forwards, plain, ending in a draft's head and chained with `nodes` ids a
    position (`chain`); given `hooks`, the whole forward with each hook inside, ending in a verify's head, at its
    bucket. At `buckets`.
    Captures run on inputs that touch only the scratch region, so the cache's contents stay as they are. Programs
    made before are skipped: a second call is free."""
    runner = cache.runner

    def wanted(inputs: BucketInputs) -> list[Program]:
        if hooks:
            return [cache.forward_program(inputs, top=VERIFY_TOP, hook=hook) for hook in hooks
                    if bucket(hook.rows) == inputs.rows]
        if plans:
            chained = [cache.chained_program(inputs, plan, nodes)[0] for plan in plans if inputs.rows == 1]
            top = max(VERIFY_TOP, nodes)
            return [cache.forward_program(inputs, plan, top=k) for plan in plans for k in (0, top)] + chained
        if pieces is not None:
            return [cache.forward_program(inputs, layers=layers, modules=modules) for modules, layers in pieces]
        return ([cache.forward_program(inputs, record=record) for record in (False, True)]
                + [cache.forward_program(inputs, top=VERIFY_TOP), cache.keeper(inputs.rows)]
                + [cache.program(runner.layers[layer], layer, kind, inputs)
                   for layer in range(runner.num_layers) for kind in (ATTN, MLP) if inputs.rows == 1])

    made = 0
    with torch.inference_mode():
        for rows in buckets:
            inputs = cache.inputs_for(rows)
            programs = [program for program in wanted(inputs) if not program.ready]
            if not programs:
                continue
            inputs.load(_WARM_UP, np.zeros(rows, dtype=np.int64),
                        [Layout(0, cache.capacity, cache.columns)] * runner.num_layers, np.eye(rows, dtype=bool))
            for program in programs:
                program.prepare()
                made += 1
    if made and cache.graphs:
        torch.cuda.synchronize()
        cache.graph_bytes = torch.cuda.memory_allocated(runner.device) - cache.base_bytes


def adopt(cache: Cache, plan: SkipPlan, nodes: int = 1) -> None:
    """Make a skip plan's draft forwards (one row; plain, ending in a head, and chained with `nodes` ids a position:
    `StaticKVCache.chain`) ready before they are used, where `cache` is the fast path's: a method calls it when it
    adopts a plan, so that the capture falls outside the steps it drafts in."""
    if isinstance(cache, StaticKVCache) and plan:
        warm_up(cache, plans=[plan], buckets=(1,), nodes=nodes)


def stats(runner: Runner) -> dict[str, Any]:
    """What the runner's fast path holds: programs, captured graphs, failed captures, time and memory."""
    cache = runner.static_cache
    if cache is None:
        return {"programs": 0, "graphs": 0, "whole_graphs": 0, "failed": 0, "capture_s": 0.0, "graph_bytes": 0,
                "compiled": False}
    programs = cache.programs.values()
    return {"programs": len(cache.programs), "compiled": cache.compiled,
            "graphs": sum(p.graph is not None for p in programs),
            "whole_graphs": sum(p.graph is not None for k, p in cache.programs.items() if k[1] == FORWARD),
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


def _key(block: nn.Module | None, kind: int, rows: int, *variant: Any) -> tuple[Any, ...]:
    return (0 if block is None else id(block), kind, rows, *variant)


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
        self.compiled = compiles_for(runner)
        self.shape = compiled.shape_of(config, runner.device)
        shape = (1, heads, self.columns, head_dim)
        device = runner.device
        self.keys = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.values = [torch.zeros(shape, dtype=runner.dtype, device=device) for _ in range(runner.num_layers)]
        self.lengths = [0] * runner.num_layers
        self.inputs: dict[int, BucketInputs] = {}
        self.programs: dict[tuple[Any, ...], Program] = {}
        self.plans: collections.OrderedDict[SkipPlan, None] = collections.OrderedDict()  # most recently used last
        # what a greedy step reads, in one float32 buffer: every bucket's verify `Top` (the plain forward ending in
        # the verify's head) ending where a draft chain's Tops begin (`ring`), so that a step reading both reads one
        # span of it (`verify`), no join on the device
        self.readout = torch.zeros(BUCKETS[-1] * _width(VERIFY_TOP) + CHAIN * _width(CHAIN_NODES), device=device)
        # the token ids every whole-model forward program reads (a bucket's first rows): written by the pass's upload
        # (`BucketInputs.load`) or on the device by a chained draft (`chain`), where the next forward finds them
        self.tokens = torch.zeros(1, BUCKETS[-1], dtype=torch.long, device=device)
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
        return StaticView(self, length, scratch)

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

            def run(x: torch.Tensor) -> torch.Tensor:
                return self.units(block, layer, (kind,), x, inputs)

            example = torch.zeros(1, inputs.rows, self.runner.config.hidden_size, dtype=self.runner.dtype,
                                  device=self.runner.device)
            self.programs[key] = Program(run, example, self, _capturable([block]))
        return self.programs[key]

    def forward_program(self, inputs: BucketInputs, skip: SkipPlan | None = None, layers: range | None = None,
                        record: bool = False, modules: Sequence[nn.Module] | None = None, top: int = 0,
                        hook: InProgram | None = None) -> Program:
        """The program running `layers` at a bucket as one piece, `skip`'s sub-layers left out, `modules[layer]`
        standing in for the runner's layers where given (Fractal's compressed copies). Without `layers`: the whole
        model from token ids [1, Tb]; with them, from hidden states [1, Tb, H]. Out: the last layer's output
        [1, Tb, H], or, `record`ing, the state before the first and after every sub-layer [2 * len(layers) + 1, 1,
        Tb, H] (a skipped one's: its input), the last being the output; or, with `top` (the whole model, not
        recording), the head's verdict on every row, the packed `runner.Top` [Tb, 3 top + 1]: the final norm, the
        head and its reductions inside the program. A `hook` (the whole model, not recording) runs inside it before
        its layers (`InProgram`)."""
        runner = self.runner
        embeds = layers is None
        layers = range(runner.num_layers) if layers is None else layers
        blocks = runner.layers if modules is None else modules
        skip = skip or None
        key = _key(None, FORWARD, inputs.rows, skip, layers.start, layers.stop, embeds, record,
                   0 if modules is None else id(modules), top, None if hook is None else hook.key)
        if skip is not None:
            self.plans[skip] = None
            self.plans.move_to_end(skip)
            if len(self.plans) > PLANS:
                dropped, _ = self.plans.popitem(last=False)
                self.programs = {k: p for k, p in self.programs.items() if dropped not in k}
        if key not in self.programs:

            def stretch(h: torch.Tensor, span: range, modules: Sequence[nn.Module], rows: tuple[int, int] | None
                        ) -> torch.Tensor:
                on = inputs if rows is None else inputs.rows_of(*rows)
                for layer in span:
                    h = self.units(modules[layer], layer, (ATTN, MLP), h, on)
                return h

            def run(x: torch.Tensor) -> torch.Tensor:
                h = runner.embed(x) if embeds else x
                states = [h]
                for layer in layers:
                    if hook is not None and layer in hook.layers:
                        h = hook.inside(layer, h, stretch)
                    kinds = tuple(kind for kind in (ATTN, MLP) if skip is None or not skip.skips(layer, kind))
                    if not record:
                        h = self.units(blocks[layer], layer, kinds, h, inputs)
                        continue
                    for kind in (ATTN, MLP):
                        if kind in kinds:
                            h = self.units(blocks[layer], layer, (kind,), h, inputs)
                        states.append(h)
                if top:
                    return top_of(runner.logits(h), top).packed
                return torch.stack(states) if record else h

            hidden = (1, inputs.rows, runner.config.hidden_size)
            example = (self.tokens[:, : inputs.rows] if embeds
                       else torch.zeros(hidden, dtype=runner.dtype, device=runner.device))
            capturable = _capturable(blocks[layer] for layer in layers)
            verifies = embeds and top == VERIFY_TOP and skip is None and modules is None and not record
            self.programs[key] = Program(run, example, self, capturable, shared=embeds,
                                         output=self.verify_top(inputs.rows) if verifies else None)
        return self.programs[key]

    def verify_top(self, rows: int) -> torch.Tensor:
        """Where a verify forward's `Top` over a bucket of `rows` goes: the readout's rows just before the ring."""
        end = BUCKETS[-1] * _width(VERIFY_TOP)
        return self.readout[end - rows * _width(VERIFY_TOP) : end].view(rows, _width(VERIFY_TOP))

    def ring(self, top: int) -> torch.Tensor:
        """A draft chain's Tops of width `top`, a row per chain position [CHAIN, 3 top + 1], at the readout's `tail`
        (one chain is read at a time: a chain of any width starts there)."""
        if top > CHAIN_NODES:
            raise SpecGUIError(f"a chained draft keeps at most {CHAIN_NODES} ids a position, got {top}")
        return self.tail(CHAIN * _width(top)).view(CHAIN, _width(top))

    def tail(self, count: int) -> torch.Tensor | None:
        """The readout's first `count` floats after the verify Tops, where a program leaves what the step's verdict
        read brings along (a draft chain's Tops, Fractal's slot guesses; one user a step); None where they do not
        fit."""
        start = BUCKETS[-1] * _width(VERIFY_TOP)
        return self.readout[start : start + count] if start + count <= self.readout.numel() else None

    def chain(self, skip: SkipPlan, pending: int, start: int, limit: int, nodes: int = 1) -> torch.Tensor:
        """A layer-skip draft of `limit` tokens from `pending`, the host out of the loop: one load of the one-row
        inputs, then `limit` replays of the plan's chained program, each of which feeds its choice to the next and
        moves the inputs on by a row itself (`BucketInputs.advance`), so that a draft token costs the device one
        replay and the host nothing. Each position's `nodes` likeliest ids (its token, then runners-up) go straight
        to the token buffer's rows the verify forward reads them at: row 1 + i * nodes on (`place`). `start` is the
        committed length (the pending token's position). Returns the draft's `Top`s [limit, 3 k + 1], k = max(2,
        nodes), packed (valid until the program runs again). The draft's keys stay past `start`; the caller crops
        them."""
        inputs = self.inputs_for(1)
        program, ring = self.chained_program(inputs, skip, nodes)
        for i in range(limit):
            step = self.runner.new_pass(np.array([start + i]), self)  # each replay is a forward pass of its own
            if i == 0:
                step._load(np.array([pending]))
            step.call(program)
        inputs.owner = None  # moved on past what any pass loaded
        return ring[:limit]

    def chained_program(self, inputs: BucketInputs, skip: SkipPlan, nodes: int) -> tuple[Program, torch.Tensor]:
        """The one-row program of a draft chain with `skip`'s sub-layers left out (made when a method adopts the plan,
        `adopt`): the whole forward ending in the head's `Top`, which it keeps in its row of the chain's buffer (its
        position less the chain's origin), its top-1 id becoming its own next input and its `nodes` likeliest ids
        the verify's tokens at that row's place."""
        top = max(VERIFY_TOP, nodes)
        key = _key(None, CHAINED, 1, skip, nodes)
        ring = self.ring(top)
        if key not in self.programs:
            forward = self.forward_program(inputs, skip, top=top)
            device = self.runner.device
            attended = torch.tensor([layer for layer in range(self.runner.num_layers) if not skip.skips(layer, ATTN)],
                                    dtype=torch.long, device=device)
            spread = torch.arange(nodes, device=device)

            def run(x: torch.Tensor) -> torch.Tensor:
                packed = forward.fn(x)
                row = inputs.positions[0, :1] - inputs.origin
                ring.index_copy_(0, row, packed)
                self.tokens[0].index_copy_(0, 1 + row * nodes + spread, packed[0, :nodes].long())
                x.copy_(packed[:, :1].long())
                inputs.advance(attended)
                return packed

            self.programs[key] = Program(run, forward.input, self, _capturable(self.runner.layers), read=False,
                                         shared=True)
        return self.programs[key], ring

    def made(self, key: Any, rows: int) -> bool:
        """Whether the rows program of `key` at a bucket of `rows` is made (`rows_program`)."""
        return _key(None, ROWS, rows, key) in self.programs

    def rows_program(self, inputs: BucketInputs, key: Any,
                     make: Callable[[], Callable[[torch.Tensor, RunRows], torch.Tensor]], example: torch.Tensor
                     ) -> Program:
        """The program of `StaticPass.rows_program` at a bucket (made on first use)."""
        full = _key(None, ROWS, inputs.rows, key)
        if full not in self.programs:
            fn, runner = make(), self.runner

            def run_rows(h: torch.Tensor, layer: int, kinds: tuple[int, ...]) -> torch.Tensor:
                return self.units(runner.layers[layer], layer, kinds, h[None], inputs)[0]

            self.programs[full] = Program(lambda x: fn(x, run_rows), example, self, _capturable(runner.layers))
        return self.programs[full]

    def place(self, row: int, ids: torch.Tensor) -> None:
        """Device-held token ids into the token buffer from `row` on, where the next whole-model forward reads them
        (its upload names their rows as kept: `BucketInputs.load`)."""
        self.tokens[0, row : row + ids.numel()].copy_(ids.reshape(-1))

    def keep(self, start: int, offsets: list[int]) -> None:
        """`KVCache.keep` as one program (`keeper`): a tree's accepted keys move into place in every layer by one
        upload and one replay, not two device operations a layer for keys and two for values."""
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
            return
        n = len(offsets)
        program = self.keeper(bucket(n) or n)
        moves = np.full((2, program.input.shape[1]), self.capacity, dtype=np.int64)  # padding: scratch onto itself
        moves[0, :n] = np.add(offsets, start)
        moves[1, :n] = np.arange(start, start + n)
        upload(program.input, moves)
        program()
        self.lengths = [start + n] * len(self.lengths)

    def keeper(self, rows: int) -> Program:
        """The program moving up to `rows` keys and values of every layer: from the columns in its input's first row
        to those in its second (made at warm-up per bucket; its output is read by nobody)."""
        key = _key(None, KEEP, rows)
        if key not in self.programs:

            def run(moves: torch.Tensor) -> torch.Tensor:
                for buffer in (*self.keys, *self.values):
                    buffer.index_copy_(2, moves[1], buffer.index_select(2, moves[0]))
                return moves[0]

            example = torch.zeros(2, rows, dtype=torch.long, device=self.runner.device)
            self.programs[key] = Program(run, example, self, True, read=False)
        return self.programs[key]

    def units(self, block: nn.Module, layer: int, kinds: tuple[int, ...], h: torch.Tensor,
              inputs: BucketInputs) -> torch.Tensor:
        """Sub-layers `kinds` of layer `layer` (of `block`, the layer or a stand-in) on hidden states [1, Tb, H], in a
        program's function: the compiled functions with the layer's weights and cache buffers (`specgui.compiled`; a
        whole layer as one function) where this cache compiles and the block has their shape, else the modules."""
        if not kinds:
            return h
        if not self.compiled or not compiled.supported(block):
            for kind in kinds:
                h = sublayer(block, kind, h, (inputs.cos, inputs.sin), inputs.mask[layer], inputs.positions, inputs)
            return h
        weights = compiled.weights_of(block)
        if kinds == (MLP,):
            return compiled.compiled("mlp")(h, weights, self.shape)
        return compiled.compiled("layer" if len(kinds) == 2 else "attention")(
            h, weights, self.keys[layer], self.values[layer], inputs.cos, inputs.sin, inputs.mask[layer],
            inputs.index[layer], self.shape)


class StaticView:
    """A read-only window on the first `length` positions of a `StaticKVCache`: new keys go to the scratch region,
    or, where the caller declares the positions past the window dead (`scratch`), right after the window, as
    `FrozenView` puts them (Fractal's kept-slot redo reads a lower pass's keys there)."""

    def __init__(self, store: StaticKVCache, length: int, scratch: bool = False) -> None:
        self.store = store
        self.length = length
        self.scratch = scratch

    pass_type: type[Pass]  # set below

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.length, self.store.lengths[layer_idx])

    def layout(self, layer: int, rows: int) -> Layout:
        if rows > SCRATCH:
            raise SpecGUIError(f"a read-only pass of {rows} tokens exceeds the fast path's scratch of {SCRATCH}")
        n = self.get_seq_length(layer)
        in_place = self.scratch and n + rows <= self.store.capacity
        return Layout(n, n if in_place else self.store.capacity, self.store.columns)

    def view(self, length: int, scratch: bool = False) -> StaticView:
        return StaticView(self.store, min(length, self.length), scratch or self.scratch)

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
    live: torch.Tensor  # [L, 1, 1, C, 1] bool: the columns some row sees, per layer
    origin: torch.Tensor  # [1] the first row's position as loaded (a draft chain's rows count from it)
    owner: object = field(default=None, repr=False)
    builder: Program | None = field(default=None, repr=False)  # a bucket's: fills the tensors above from the upload

    @classmethod
    def empty(cls, store: StaticKVCache, rows: int) -> BucketInputs:
        runner, device = store.runner, store.runner.device
        positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        cos, sin = runner.rotary(torch.empty(0, dtype=runner.dtype, device=device), positions)
        made = cls(store, rows, positions, cos, sin,
                   torch.zeros(runner.num_layers, 1, 1, rows, store.columns, dtype=torch.bool, device=device),
                   torch.zeros(runner.num_layers, rows, dtype=torch.long, device=device),
                   torch.zeros(runner.num_layers, 1, 1, store.columns, 1, dtype=torch.bool, device=device),
                   torch.zeros(1, dtype=torch.long, device=device))
        if bucket(rows) == rows:  # a bucket's inputs live on; a larger forward's are made for its one pass
            packed = torch.zeros(rows + 2 * runner.num_layers + rows * rows + rows, dtype=torch.long, device=device)
            made.builder = Program(made._build, packed, store, True, read=False)
        return made

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.store.keys[layer_idx], self.store.values[layer_idx]
        k.index_copy_(2, self.index[layer_idx], keys)
        v.index_copy_(2, self.index[layer_idx], values)
        # attention reads every column under a mask, and a masked weight of 0 times a NaN or Inf left in a slot no row
        # sees (scratch, stale or padded keys) is NaN: such slots are read as zeros
        live = self.live[layer_idx]
        return k.masked_fill(~live, 0), v.masked_fill(~live, 0)

    def load(self, owner: object, positions: np.ndarray, layouts: list[Layout], visible: np.ndarray,
             tokens: np.ndarray | None = None) -> None:
        """Fill these inputs for a forward at `positions` [T] with `visible` [T, T] (bool; both on the host, numpy),
        unless `owner`'s are here: one upload of [positions, prefixes, offsets, visible block] packed on the host,
        then one program (`builder`, a CUDA graph on a GPU) builds the rotary tables, masks and write indices from
        it, so that a pass's inputs cost the device one copy and one replay, not a launch per operation. `tokens` [T]
        (a whole-model forward's ids) ride in the same upload into the cache's token buffer; a negative id, or none,
        keeps the id the buffer holds at that row (placed on the device: `StaticKVCache.chain`, `place`)."""
        if self.owner is owner:
            return
        t, rows, n = positions.shape[0], self.rows, len(layouts)
        packed = np.empty(rows + 2 * n + rows * rows + rows, dtype=np.int64)
        packed[:t] = positions
        packed[t:rows] = positions[-1]  # any real position: padded rows are never read
        packed[rows : rows + n] = [x.prefix for x in layouts]
        packed[rows + n : rows + 2 * n] = [x.offset for x in layouts]
        block = np.eye(rows, dtype=np.int64)  # a padded row sees only itself
        block[:t, :t] = visible
        packed[rows + 2 * n : -rows] = block.reshape(-1)
        packed[-rows:] = -1
        if tokens is not None:
            packed[-rows:][:t] = tokens
        builder = self.builder
        if builder is None:  # beyond the buckets: built as it comes, for this one pass
            self._build(to_device(torch.from_numpy(packed), self.positions.device))
        else:
            upload(builder.input, packed)
            builder()
        self.owner = owner

    def _build(self, data: torch.Tensor) -> torch.Tensor:
        """Positions, rotary tables, masks, seen columns and write indices from an upload `data` (`load`'s layout)."""
        rows, n = self.rows, self.index.shape[0]
        self.positions.copy_(data[:rows].view(1, rows))
        cos, sin = self.store.runner.rotary(self.cos, self.positions)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        prefix, offset = data[rows : rows + n, None], data[rows + n : rows + 2 * n, None]
        self.mask.copy_(masks(prefix, offset, data[rows + 2 * n : -rows].view(rows, rows).bool(), self.store.columns)
                        .unsqueeze(1).unsqueeze(1))
        self.live.copy_(self.mask.any(3).unsqueeze(-1))
        self.index.copy_(offset + torch.arange(rows, device=data.device))
        self.origin.copy_(data[:1])
        if rows <= self.store.tokens.shape[1]:  # beyond: a forward of hidden states, no ids
            held = self.store.tokens[0, :rows]
            ids = data[-rows:]
            held.copy_(torch.where(ids >= 0, ids, held))
        return self.positions

    def rows_of(self, start: int, count: int) -> BucketInputs:
        """These inputs for rows [start, start + count) alone, as views (inside a program: Fractal's lower pass runs
        the slot rows of its forward, seeing what they see there, writing their keys where the forward does)."""
        rows = slice(start, start + count)
        return BucketInputs(self.store, count, self.positions[:, rows], self.cos[:, rows], self.sin[:, rows],
                            self.mask[:, :, :, rows], self.index[:, rows], self.live, self.origin)

    def advance(self, attended: torch.Tensor) -> None:
        """Inside a chained draft program (`StaticKVCache.chain`), one row's inputs moved on by a position: the next
        row sees the key this one wrote in every layer whose attention ran (`attended`, layer indices), and writes
        its own one column further; the other layers' keys stay where they were. What the builder would make from the
        next pass's upload, made on the device."""
        layers, columns = self.index.shape[0], self.store.columns
        written = self.index.index_select(0, attended)[:, 0] + 1  # the next row's own column, per attended layer
        self.mask.view(layers, columns).index_put_((attended, written), torch.ones_like(written, dtype=torch.bool))
        self.live.view(layers, columns).index_put_((attended, written), torch.ones_like(written, dtype=torch.bool))
        self.index.index_copy_(0, attended, written[:, None])
        self.positions.add_(1)
        cos, sin = self.store.runner.rotary(self.cos, self.positions)
        self.cos.copy_(cos)
        self.sin.copy_(sin)


def _capturable(blocks: Iterable[nn.Module]) -> bool:
    """Whether a CUDA graph can hold a program running these layers (a stand-in says so by its `capturable`)."""
    return all(getattr(block, "capturable", True) for block in blocks)


def _width(top: int) -> int:
    """A packed `Top`'s floats a row (`runner.Top`)."""
    return 3 * top + 1


def _host(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """Host values as numpy: an array as it is; a tensor read (on a GPU, a host tensor's read waits for nothing)."""
    return values if isinstance(values, np.ndarray) else values.cpu().numpy()


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
    """A function of one static input buffer, run by CUDA graph replay on CUDA, by a plain call elsewhere. The buffer
    is the program's own, or (`shared`) the `example` itself: whole-model forwards read their ids from a view of the
    cache's token buffer, where the pass's upload or a chained draft puts them.

    `__call__` returns the output buffer, the same tensor every time. On CUDA `prepare` (at warm-up, or on
    first use) runs the function once on the cache's side stream (lazy initialisations, allocator), allocates
    the output buffer from that result outside the graphs' pool, then captures the function and a copy into that
    buffer, its intermediates in the cache's graph memory pool; a function that cannot be captured stays eager.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor, store: StaticKVCache,
                 capturable: bool, read: bool = True, shared: bool = False, output: torch.Tensor | None = None) -> None:
        self.fn = fn
        self.read = read  # whether callers read its output (a bucket's inputs builder writes its inputs instead)
        self.store = store
        self.input = example if shared else torch.zeros_like(example)  # shared: a view of the cache's token buffer
        self.given = output  # where its output goes, if not a buffer of its own (a verify Top: the cache's readout)
        self.output: torch.Tensor | None = output
        self.graphs = store.graphs and capturable
        self.graph: Any = None
        self.failed = False
        self.ready = False

    def prepare(self) -> None:
        """Capture now (CUDA), or, where the cache compiles, run once now so that its functions compile here rather
        than inside a timed step (elsewhere); called once, before the first call. The time goes to `capture_s`."""
        self.ready = True
        started = time.perf_counter()
        if self.graphs:
            self._capture()
        elif self.store.compiled:
            self.fn(self.input)
        self.store.capture_s += time.perf_counter() - started

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
        if _checking and self.read:  # an output nobody reads is neither poisoned nor poisons
            for other in _live:  # (outputs in one buffer, the verify Tops, are each other's to overwrite anyway)
                if other is not self and other.output is not None and not _same_buffer(other.output, self.output):
                    other.output.fill_(float("nan"))
            _live[:] = [self]
        return self.output

    def _capture(self) -> None:
        side = self.store.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = self.fn(self.input)
            if self.output is None:
                self.output = torch.empty_like(first)  # outside the shared pool: no replay reuses it
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.store.pool, stream=side):
                self.output.copy_(self.fn(self.input))
        except RuntimeError as exc:
            if not any(p.failed for p in self.store.programs.values()):
                LOG.warning("a program could not be captured as a CUDA graph and runs eagerly (others may "
                            "follow, logged once): %s", str(exc).splitlines()[0])
            self.graphs, self.output, self.failed = False, self.given, True
            return
        self.graph = graph


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class StaticPass(Pass):
    """A forward over a `StaticKVCache` (or a view of one): bucketed rows, programs, device-side inputs."""

    def __init__(self, runner: Runner, positions: torch.Tensor | np.ndarray, cache: StaticKVCache | StaticView,
                 visibility: torch.Tensor | np.ndarray | None) -> None:
        # positions and visibility stay on the host (callers build them there, in numpy where the step is timed): they
        # reach the device inside the one upload
        self.runner, self.cache, self.visibility = runner, cache, visibility
        self.host_positions = _host(positions).reshape(-1)
        t = self.length = self.host_positions.shape[0]
        self.store = cache.store
        self.writes = isinstance(cache, StaticKVCache)  # a view stores nothing
        self.layouts = [cache.layout(layer, t) for layer in range(runner.num_layers)]
        self.visible = np.tri(t, dtype=bool) if visibility is None else _host(visibility).astype(bool, copy=False)
        self.bucketed = bucket(t) is not None
        self.inputs = self.store.inputs_for(bucket(t) or t)

    def _load(self, tokens: np.ndarray | None = None) -> None:
        self.inputs.load(self, self.host_positions, self.layouts, self.visible, tokens)

    def call(self, program: Program) -> torch.Tensor:
        """Run one of this pass's programs (every program call goes through here: `dispatch` counts them per pass)."""
        return program()

    def whole_forward(self, tokens: torch.Tensor | np.ndarray, skip: SkipPlan | None = None,
                      observer: Observer | None = None, top: int = 0, hook: InProgram | None = None
                      ) -> torch.Tensor | None:
        """The whole forward as one program: token ids [T] (host values, numpy or a tensor, or device values) -> last
        layer's output [1, T, H], or with `top` the packed `Top` [T, 3 top + 1] of its rows (the head inside the
        program); a `hook` runs inside the program (`InProgram`). An observer hears every state once the program has
        run, from copies (the output buffer is reused)."""
        if not self.bucketed:
            return None
        if isinstance(tokens, np.ndarray):  # host ids ride in the upload (a negative one keeps what was placed)
            self._load(tokens.reshape(-1))
        else:  # a tensor's ids, copied into place as they are
            self.store.place(0, tokens)
            self._load()
        t = self.length
        program = self.store.forward_program(self.inputs, skip, record=observer is not None, top=top, hook=hook)
        out = self.call(program)
        self._wrote(range(self.runner.num_layers), skip)
        if top:
            return out[:t]
        if observer is None:
            return out[:, :t]
        if hasattr(observer, "stack") and not skip:  # the whole stack at once, used before any other program runs
            observer.stack(out[:, :, :t])
            return out[-1, :, :t]
        states = out[:, :, :t].clone()
        observer(0, states[0])
        for layer, kind in kept_units(skip, range(self.runner.num_layers)):
            observer(unit_index(layer, kind), states[unit_index(layer, kind)])
        return states[-1]

    def rows_program(self, key: Any, make: Callable[[], Callable[[torch.Tensor, RunRows], torch.Tensor]],
                     x: torch.Tensor) -> torch.Tensor:
        """`fn(x, run)` as one program over this pass's bucket of rows, `fn` = `make()` (called once a key and bucket,
        before any capture, so that its constants live outside the graph): `run(h [Tb, H], layer, kinds)` runs those
        sub-layers of a layer on the bucket's rows, inside, as a forward program runs them. Many sub-layer runs over
        the same rows become one replay and one upload (CLaSp's search: a unit's pass each, 60 a search). `x` is copied
        into the program's input; the output is valid until the next program runs."""
        self._load()
        program = self.store.rows_program(self.inputs, key, make, x)
        program.input.copy_(x)
        return self.call(program)

    def run_segment(self, h: torch.Tensor, layers: range, skip: SkipPlan | None = None) -> torch.Tensor:
        if not self.bucketed:
            return super().run_segment(h, layers, skip)
        return self._stretch(h, layers, skip, None)

    def run_layers(self, h: torch.Tensor, layers: range, modules: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """The stretch as one program (a spliced forward's pieces, Fractal's compressed passes)."""
        if not self.bucketed or not layers:
            return super().run_layers(h, layers, modules)
        return self._stretch(h, layers, None, modules)

    def _stretch(self, h: torch.Tensor, layers: range, skip: SkipPlan | None,
                 modules: Sequence[nn.Module] | None) -> torch.Tensor:
        self._load()
        program = self.store.forward_program(self.inputs, skip, layers, modules=modules)
        program.input[:, : self.length].copy_(h)
        out = self.call(program)[:, : self.length]
        self._wrote(layers, skip)
        return out

    def _wrote(self, layers: range, skip: SkipPlan | None) -> None:
        """The cache's lengths after this pass ran the attention of `layers` (those `skip` leaves in)."""
        if self.writes:
            for layer, kind in kept_units(skip, layers):
                if kind == ATTN:
                    self.store.lengths[layer] = self.layouts[layer].offset + self.length

    def run_unit(self, h: torch.Tensor, layer: int, kind: int, module: nn.Module | None = None) -> torch.Tensor:
        block = module if module is not None else self.runner.layers[layer]
        inputs = self.inputs
        self._load()
        if self.bucketed:
            program = self.store.program(block, layer, kind, inputs)
            program.input[:, : self.length].copy_(h)
            out = self.call(program)[:, : self.length]
        else:  # beyond the largest bucket and not causal (a huge tree): the same sub-layer, eagerly
            out = sublayer(block, kind, h, (inputs.cos, inputs.sin), inputs.mask[layer], inputs.positions, inputs)
        if kind == ATTN:
            self._wrote(range(layer, layer + 1), None)
        return out

    def one_call(self, h: torch.Tensor, layers: list[int],
                 modules: Sequence[nn.Module] | None = None) -> tuple[torch.Tensor, int]:
        """None run: a stretch of layers here is one program (`run_layers`), a layer beyond the buckets its
        sub-layers."""
        return h, 0

    def lasting(self, h: torch.Tensor) -> torch.Tensor:
        return h.clone()  # program outputs are overwritten when the program runs again


StaticKVCache.pass_type = StaticPass
StaticView.pass_type = StaticPass

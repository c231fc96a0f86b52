"""The programs a pass runs, made and kept in the cache's table (`Programs`): what each holds, and when it is made.

A pass runs as one program:
  - forward: a stretch of layers (the whole model from the embedding, for a forward; a piece of one, for what
    runs piecewise) with a skip plan's sub-layers left out and, where the pass is observed, every sub-layer's
    state recorded into the output, or a pre-layer hook's work inside it (Fractal's splice: `InProgram`)
    (`forward_program`); ending, for a verify, in the head's `Top`, written to the cache's `readout`; chained, for a
    layer-skip draft, into one row's program that feeds itself (`chained_program`, replayed by `passes.chain`);
  - rows: a function over a bucket of rows that runs many layers' sub-layers on them (CLaSp's whole search:
    `StaticPass.rows_program`, `rows_program`);
  - sub-layer: one attention or MLP sub-layer, for what still runs piecewise (the cost model's per-sub-layer
    prices, a pass whose observer or hook sits between sub-layers) (`unit_program`).
Inside each, a layer's sub-layers run as compiled kernels or as the modules (`units`).

The plain forward's programs are made at warm-up (`warm_up`); a skip plan's when a method adopts it (`adopt`), a
bounded number of plans kept (`program.PLANS`), a method's own at its setup, so that a capture is never taken inside
a step that is timed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from specgui.core.kvcache import Cache
from specgui.core.runner import ATTN, MLP, VERIFY_TOP, SkipPlan, sublayer, top_of
from specgui.fastpath import compiled
from specgui.fastpath.cache import StaticKVCache
from specgui.fastpath.cursor import row_program
from specgui.fastpath.inputs import BUCKETS, BucketInputs, bucket, fixed_block
from specgui.fastpath.program import Program, key

# a program's `kind` in its key, beside ATTN and MLP (a sub-layer's) and `cache.KEEP` (-2, the cache's keeper):
FORWARD = -1  # the `kind` of a forward program (a stretch of layers as one program)
CHAINED = -3  # the `kind` of a chained draft program (`chained_program`)
ROWS = -4  # the `kind` of a rows program (`rows_program`)
Piece = tuple[Sequence[nn.Module] | None, range]  # a stretch of layers run as one program (modules standing in)
RunRows = Callable[[torch.Tensor, int, tuple[int, ...]], torch.Tensor]  # (h [Tb, H], layer, kinds) -> h, in a program
# (h [1, T, H], layers, modules, rows) -> h: those layers of `modules` on h inside a forward's program, over the
# forward's own inputs or, given `rows` (start, count), over those rows of them
RunLayers = Callable[[torch.Tensor, range, Sequence[nn.Module], tuple[int, int] | None], torch.Tensor]


class InProgram(Protocol):
    """A pre-layer hook's work inside a whole forward's program (Fractal's splice), where the hook offers one
    (`Runner.forward` asks its `in_program()`): before each of `layers`, `inside(layer, h, run)` -> h. `key` names
    what the function does (a program is made per key and bucket: `rows` is the forward's rows); the tensors it
    writes for the host live at fixed addresses (the cache's `readout.tail`)."""

    key: Any
    layers: frozenset[int]
    rows: int

    def inside(self, layer: int, h: torch.Tensor, run: RunLayers) -> torch.Tensor: ...


_WARM_UP = object()  # the owner of inputs loaded for captures


def warm_up(cache: StaticKVCache, pieces: Sequence[Piece] | None = None, plans: Sequence[SkipPlan] = (),
            buckets: Sequence[int] = BUCKETS, nodes: int = 1, hooks: Sequence[InProgram] = ()) -> None:
    """Make (on CUDA: capture) programs now, outside any timed step: by default every bucket's plain forward, the
    same ending in a verify's head (`Runner.forward(top=)`), its recording variant and, at one row, plain decoding's
    chained step (`passes.PlainSteps`), a draft chain's start (`cursor.start_row`) and each sub-layer
    of every layer (what the cost model times: no pass runs a sub-layer alone at more rows but a forward past the
    buckets, and a capture costs a device synchronisation and an emptied allocator cache, so the 60 a bucket would
    be most of a cache's captures); given `pieces`, those stretches of layers, one program each (`Drafter.pieces`);
    given `plans`, those skip plans' forwards, plain, ending in a draft's head and chained with `nodes` ids a
    position (`passes.chain`); given `hooks`, the whole forward with each hook inside, ending in a verify's head, at
    its bucket. At `buckets`.
    Captures run on inputs that touch only the scratch region (loaded before each), so the cache's contents stay as
    they are, and no bucket's inputs are left marked as the warm-up's. Programs made before are skipped: a second call
    is free."""
    runner = cache.runner

    def wanted(inputs: BucketInputs) -> list[Program]:
        if hooks:
            return [forward_program(cache, inputs, top=VERIFY_TOP, hook=hook) for hook in hooks
                    if bucket(hook.rows) == inputs.rows]
        if plans:
            chained = [chained_program(cache, inputs, plan, nodes)[0] for plan in plans if inputs.rows == 1]
            top = max(VERIFY_TOP, nodes)
            return [forward_program(cache, inputs, plan, top=k) for plan in plans for k in (0, top)] + chained
        if pieces is not None:
            return [forward_program(cache, inputs, layers=layers, modules=modules) for modules, layers in pieces]
        return ([forward_program(cache, inputs, record=record) for record in (False, True)]
                + [forward_program(cache, inputs, top=VERIFY_TOP), cache.keeper(inputs.rows)]
                + ([chained_program(cache, inputs, None, 1)[0], row_program(cache)] if inputs.rows == 1 else [])
                + [unit_program(cache, runner.layers[layer], layer, kind, inputs)
                   for layer in range(runner.num_layers) for kind in (ATTN, MLP) if inputs.rows == 1])

    made = 0
    with torch.inference_mode():
        for rows in buckets:
            inputs = cache.inputs_for(rows)
            for program in wanted(inputs):
                if program.ready:
                    continue
                # each capture on inputs that touch only the scratch region: loaded afresh before each, as a program
                # may build or move them on the device (a chained step, a row's start), and left owned by nobody, so
                # that the next pass, a later warm-up's included, loads its own
                nowhere = np.zeros(runner.num_layers, dtype=np.int64)  # nothing seen, keys written to the scratch
                inputs.load(_WARM_UP, np.zeros(rows, dtype=np.int64), nowhere, nowhere + cache.capacity,
                            fixed_block(rows, causal=False))
                program.prepare()
                inputs.owner = None
                made += 1
    table = cache.programs
    if made and table.graphs:
        table.device.synchronize()
        table.graph_bytes = table.device.memory() - table.base_bytes


def adopt(cache: Cache, plan: SkipPlan, nodes: int = 1) -> None:
    """Make a skip plan's draft forwards (one row; plain, ending in a head, and chained with `nodes` ids a position:
    `passes.chain`) ready before they are used, where `cache` is the fast path's: a method calls it when it adopts a
    plan, so that the capture falls outside the steps it drafts in."""
    if isinstance(cache, StaticKVCache) and plan:
        warm_up(cache, plans=[plan], buckets=(1,), nodes=nodes)


def _capturable(blocks: Iterable[nn.Module]) -> bool:
    """Whether a CUDA graph can hold a program running these layers (a stand-in says so by its `capturable`)."""
    return all(getattr(block, "capturable", True) for block in blocks)


def units(cache: StaticKVCache, block: nn.Module, layer: int, kinds: tuple[int, ...], h: torch.Tensor,
          inputs: BucketInputs) -> torch.Tensor:
    """Sub-layers `kinds` of layer `layer` (of `block`, the layer or a stand-in) on hidden states [1, Tb, H], in a
    program's function: the compiled functions with the layer's weights and cache buffers (`compiled`; a whole
    layer as one function) where the cache's programs compile and the block has their shape, else the
    modules."""
    if not kinds:
        return h
    table = cache.programs
    if not table.compiled or not compiled.supported(block):
        for kind in kinds:
            h = sublayer(block, kind, h, (inputs.cos, inputs.sin), inputs.mask[layer], inputs.positions, inputs)
        return h
    weights = compiled.weights_of(block)
    if kinds == (MLP,):
        return table.kernel("mlp")(h, weights, table.shape)
    return table.kernel("layer" if len(kinds) == 2 else "attention")(
        h, weights, cache.keys[layer], cache.values[layer], inputs.cos, inputs.sin, inputs.mask[layer],
        inputs.index[layer], table.shape)


def unit_program(cache: StaticKVCache, block: nn.Module, layer: int, kind: int, inputs: BucketInputs) -> Program:
    """The program running `kind` of `block` (a decoder layer or a stand-in for layer `layer`) at a bucket."""
    runner = cache.runner

    def make() -> Program:
        def run(x: torch.Tensor) -> torch.Tensor:
            return units(cache, block, layer, (kind,), x, inputs)

        example = torch.zeros(1, inputs.rows, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
        return Program(run, example, cache.programs, _capturable([block]))

    return cache.programs.get(key(block, kind, inputs.rows), make)


def forward_program(cache: StaticKVCache, inputs: BucketInputs, skip: SkipPlan | None = None,
                    layers: range | None = None, record: bool = False, modules: Sequence[nn.Module] | None = None,
                    top: int = 0, hook: InProgram | None = None) -> Program:
    """The program running `layers` at a bucket as one piece, `skip`'s sub-layers left out, `modules[layer]`
    standing in for the runner's layers where given (Fractal's compressed copies). Without `layers`: the whole
    model from token ids [1, Tb]; with them, from hidden states [1, Tb, H]. Out: the last layer's output
    [1, Tb, H], or, `record`ing, the state before the first and after every sub-layer [2 * len(layers) + 1, 1,
    Tb, H] (a skipped one's: its input), the last being the output; or, with `top` (the whole model, not
    recording), the head's verdict on every row, the packed `runner.Top` [Tb, 3 top + 1]: the final norm, the
    head and its reductions inside the program (a verify's into the cache's `readout`). A `hook` (the whole model,
    not recording) runs inside it before its layers (`InProgram`)."""
    runner = cache.runner
    embeds = layers is None
    layers = range(runner.num_layers) if layers is None else layers
    blocks = runner.layers if modules is None else modules
    skip = skip or None
    if skip is not None:
        cache.programs.use(skip)

    def make() -> Program:
        def stretch(h: torch.Tensor, span: range, modules: Sequence[nn.Module], rows: tuple[int, int] | None
                    ) -> torch.Tensor:
            on = inputs if rows is None else inputs.rows_of(*rows)
            for layer in span:
                h = units(cache, modules[layer], layer, (ATTN, MLP), h, on)
            return h

        def run(x: torch.Tensor) -> torch.Tensor:
            h = runner.embed(x) if embeds else x
            states = [h]
            for layer in layers:
                if hook is not None and layer in hook.layers:
                    h = hook.inside(layer, h, stretch)
                kinds = tuple(kind for kind in (ATTN, MLP) if skip is None or not skip.skips(layer, kind))
                if not record:
                    h = units(cache, blocks[layer], layer, kinds, h, inputs)
                    continue
                for kind in (ATTN, MLP):
                    if kind in kinds:
                        h = units(cache, blocks[layer], layer, (kind,), h, inputs)
                    states.append(h)
            if top:
                return top_of(runner.logits(h), top).packed
            return torch.stack(states) if record else h

        hidden = (1, inputs.rows, runner.config.hidden_size)
        example = (cache.tokens[:, : inputs.rows] if embeds
                   else torch.zeros(hidden, dtype=runner.dtype, device=runner.device))
        capturable = _capturable(blocks[layer] for layer in layers)
        verifies = embeds and top == VERIFY_TOP and skip is None and modules is None and not record
        return Program(run, example, cache.programs, capturable, shared=embeds,
                       output=cache.readout.verify_top(inputs.rows) if verifies else None)

    return cache.programs.get(key(None, FORWARD, inputs.rows, skip, layers.start, layers.stop, embeds, record,
                                  0 if modules is None else id(modules), top, None if hook is None else hook.key),
                              make)


def chained_program(cache: StaticKVCache, inputs: BucketInputs, skip: SkipPlan | None, nodes: int
                    ) -> tuple[Program, torch.Tensor]:
    """The one-row program of a draft chain with `skip`'s sub-layers left out (made when a method adopts the plan,
    `adopt`), or of plain decoding's chained steps (`skip` None: `passes.PlainSteps`): the whole forward (the plain
    forward's own function, as a verify of one row runs it) ending in the head's `Top`, which it keeps in its row of
    the chain's buffer (the readout's `ring`; its position less the chain's origin), its top-1 id becoming its own next
    input and its `nodes` likeliest ids the verify's tokens at that row's place."""
    top = max(VERIFY_TOP, nodes)
    ring = cache.readout.ring(top)

    def make() -> Program:
        forward = forward_program(cache, inputs, skip, top=top)
        device = cache.runner.device
        attended = torch.tensor([layer for layer in range(cache.runner.num_layers)
                                 if skip is None or not skip.skips(layer, ATTN)],
                                dtype=torch.long, device=device)
        spread = torch.arange(nodes, device=device)

        def run(x: torch.Tensor) -> torch.Tensor:
            packed = forward.fn(x)
            row = inputs.positions[0, :1] - inputs.origin
            ring.index_copy_(0, row, packed)
            cache.tokens[0].index_copy_(0, 1 + row * nodes + spread, packed[0, :nodes].long())
            x.copy_(packed[:, :1].long())
            inputs.advance(attended)
            return packed

        return Program(run, forward.input, cache.programs, _capturable(cache.runner.layers), read=False, shared=True)

    return cache.programs.get(key(None, CHAINED, 1, skip, nodes), make), ring


def rows_made(cache: StaticKVCache, name: Any, rows: int) -> bool:
    """Whether the rows program of `name` at a bucket of `rows` is made (`rows_program`)."""
    return key(None, ROWS, rows, name) in cache.programs.by_key


def rows_program(cache: StaticKVCache, inputs: BucketInputs, name: Any,
                 make: Callable[[], Callable[[torch.Tensor, RunRows], torch.Tensor]], example: torch.Tensor
                 ) -> Program:
    """The program of `StaticPass.rows_program` at a bucket (made on first use): `make()`'s function, its `run`
    running sub-layers of the runner's layers on the bucket's rows."""

    def program() -> Program:
        fn, runner = make(), cache.runner

        def run_rows(h: torch.Tensor, layer: int, kinds: tuple[int, ...]) -> torch.Tensor:
            return units(cache, runner.layers[layer], layer, kinds, h[None], inputs)[0]

        return Program(lambda x: fn(x, run_rows), example, cache.programs, _capturable(runner.layers))

    return cache.programs.get(key(None, ROWS, inputs.rows, name), program)

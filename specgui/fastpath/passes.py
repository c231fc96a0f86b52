"""The pass: one forward over the static cache (or a view of it), as bucketed rows, device-side inputs and programs.

A `StaticPass` is what `Runner.new_pass` makes over a `StaticKVCache`: it loads its bucket's inputs (one upload, one
replay of their builder), finds its program (`forwards`) and runs it (`call`: every program call of a pass goes
through there, which `dispatch` counts). A draft chain (`chain`) is a run of one-row passes replaying one program,
the host out of the loop; plain decoding's steps chain the same way (`PlainSteps`), a step launched before the one
before it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from specgui.core.runner import (
    ATTN,
    VERIFY_TOP,
    Observer,
    Pass,
    Runner,
    SkipPlan,
    Top,
    kept_units,
    sublayer,
    unit_index,
)
from specgui.fastpath.cache import StaticKVCache, StaticView
from specgui.fastpath.cursor import start_row
from specgui.fastpath.device import Event
from specgui.fastpath.forwards import InProgram, RunRows, chained_program, forward_program, rows_program, unit_program
from specgui.fastpath.inputs import BucketInputs, bucket, fixed_block
from specgui.fastpath.program import Program
from specgui.fastpath.readout import HostRows

_NOTHING = np.zeros(0, dtype=np.int64)  # a pass's bounds and block before its first load (read-only: never written)
_NOTHING.flags.writeable = False


def _host(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """Host values as numpy: an array as it is; a tensor read (on a GPU, a host tensor's read waits for nothing)."""
    return values if isinstance(values, np.ndarray) else values.cpu().numpy()


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
        self.bucketed = bucket(t) is not None
        # where the pass reads and writes, and its inputs: found at its first load (`_load`), which every program but a
        # chained replay's follows (`chain`, `PlainSteps`: each replay a pass of its own, its inputs moved on by the
        # replay before, so that a chained token costs the host the call, not a pass's bookkeeping)
        self.inputs: BucketInputs | None = None
        self.prefix = self.offset = self.visible = _NOTHING

    def _load(self, tokens: np.ndarray | None = None) -> None:
        t = self.length
        if self.inputs is None:
            self.prefix, self.offset = self.cache.bounds(t)
            self.visible = (fixed_block(t, causal=True) if self.visibility is None
                            else _host(self.visibility).astype(bool, copy=False))
            self.inputs = self.store.inputs_for(bucket(t) or t)
        self.inputs.load(self, self.host_positions, self.prefix, self.offset, self.visible, tokens)

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
        program = forward_program(self.store, self.inputs, skip, record=observer is not None, top=top, hook=hook)
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
        program = rows_program(self.store, self.inputs, key, make, x)
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
        program = forward_program(self.store, self.inputs, skip, layers, modules=modules)
        program.input[:, : self.length].copy_(h)
        out = self.call(program)[:, : self.length]
        self._wrote(layers, skip)
        return out

    def _wrote(self, layers: range, skip: SkipPlan | None) -> None:
        """The cache's lengths after this pass ran the attention of `layers` (those `skip` leaves in)."""
        if not self.writes:
            return
        lengths = self.store.lengths
        if skip is None:  # every layer's attention ran: one slice, not a loop over the sub-layers
            lengths[layers.start : layers.stop] = (self.offset[layers.start : layers.stop] + self.length).tolist()
            return
        for layer in layers:
            if not skip.skips(layer, ATTN):
                lengths[layer] = int(self.offset[layer]) + self.length

    def run_unit(self, h: torch.Tensor, layer: int, kind: int, module: nn.Module | None = None) -> torch.Tensor:
        block = module if module is not None else self.runner.layers[layer]
        self._load()
        inputs = self.inputs
        if self.bucketed:
            program = unit_program(self.store, block, layer, kind, inputs)
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


def chain(cache: StaticKVCache, skip: SkipPlan, pending: int, start: int, limit: int, nodes: int = 1
          ) -> torch.Tensor:
    """A layer-skip draft of `limit` tokens from `pending` over `cache`, the host out of the loop: the one-row inputs
    built on the device (`cursor.start_row`), then `limit` replays of the plan's chained program
    (`forwards.chained_program`), each of which feeds its choice to the next and moves the inputs on by a row itself
    (`BucketInputs.advance`), so that a draft token costs the device one replay and the host nothing. Each position's
    `nodes` likeliest ids (its token, then runners-up) go straight to the token buffer's rows the verify forward reads
    them at: row 1 + i * nodes on (`StaticKVCache.place`). `start` is the committed length (the pending token's
    position). Returns the draft's `Top`s [limit, 3 k + 1], k = max(2, nodes), packed (valid until the program runs
    again), a view of the readout's `ring`. The draft's keys stay past `start`; the caller crops them."""
    inputs = cache.inputs_for(1)
    program, ring = chained_program(cache, inputs, skip, nodes)
    # each replay a forward pass of its own; none loads: they start from the inputs built at `start`, and the replays
    # move them on. The first is made before that build's launch, the others after it (before the first replay:
    # between two replays the host only calls), so that the device does not wait for their making
    at = np.array([start])
    passes = [cache.runner.new_pass(at, cache)]
    start_row(cache, start, pending)
    passes += [cache.runner.new_pass(at, cache) for _ in range(limit - 1)]
    for step in passes:
        step.call(program)
    return ring[:limit]


class PlainSteps:
    """Plain decoding's steps chained on the device (greedy): each step one replay of the one-row chained program
    without a skip plan (`forwards.chained_program`), which feeds its choice to the next replay and moves the one-row
    inputs on by a position itself, so that step t + 1 is launched before step t is read: between two launches the
    host reads nothing, and on a GPU the device never waits for the host's work on a step (its read, accepting, the
    drafter's `observe`, the event).

    Each step's verdict (its row of the chain's buffer, `readout.ring`) is copied to a pinned host row right after its
    replay, and an event recorded behind the copy: reading step t waits for that event, not for step t + 1's replay,
    which the device runs meanwhile (`readout.HostRows`). The inputs are loaded (one upload) where a chain starts or its
    buffer is full (`readout.CHAIN` rows), or where another pass loaded the one-row inputs since."""

    def __init__(self, cache: StaticKVCache) -> None:
        self.cache = cache
        self.inputs = cache.inputs_for(1)
        self.program, self.ring = chained_program(cache, self.inputs, None, 1)
        self.host = HostRows(self.ring.shape[1], cache.programs.device)
        self.loaded: StaticPass | None = None  # the pass whose load the inputs hold (moved on by the replays since)
        self.origin = self.at = -1  # the position of the buffer's first row, and the next replay's

    def launch(self, position: int, pending: int | None) -> tuple[Top, Event | None]:
        """Step at `position` (the pending token's): its id `pending` from the host, or (None) the id the replay before
        left on the device. Returns its verdict as a host `Top` [1, 3 k + 1] and the event to wait for before reading
        it (None off CUDA, where it is ready)."""
        cache = self.cache
        cache.lengths = [position] * len(cache.lengths)  # what a plain step's forward finds cached (the steps before
        # it, read or in flight: a read's crop lags the launches)
        step = cache.runner.new_pass(np.array([position]), cache)  # each replay is a forward pass of its own
        if (pending is not None or self.inputs.owner is not self.loaded or position != self.at
                or position - self.origin >= len(self.ring)):
            step._load(np.array([-1 if pending is None else pending]))  # -1: the id the replay before left in place
            self.loaded, self.origin = step, position
        step.call(self.program)
        self.at = position + 1
        cache.lengths = [position + 1] * len(cache.lengths)
        host, event = self.host.copy(self.ring[position - self.origin : position - self.origin + 1])
        return Top(host, VERIFY_TOP), event


StaticKVCache.pass_type = StaticPass
StaticView.pass_type = StaticPass

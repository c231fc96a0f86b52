"""The fast path: every forward in static shapes, so that on a GPU it is one or a few CUDA graph replays.

Why: on a GPU the eager runner is dispatch-bound: an eager forward of the embedded 135M model costs several times the
same forward captured as a CUDA graph, and 32 tokens in a graph little more than one (docs/gpu.md). That flat verify
cost is what speculative decoding lives on; eager dispatch
hides it, and every draft pass pays the dispatch again.

How, without giving up what methods need (skip plans that change every few steps, observers of hidden
states, Fractal's compressed passes spliced in mid-forward, ragged per-layer caches), one room per concern:
  * `cache`: `StaticKVCache`, buffers of a capacity fixed when the run starts, and its read-only views;
  * `inputs`: buckets (a forward of T tokens runs as the next size in `BUCKETS`) and `BucketInputs`, the device
    tensors every program of a bucket reads, loaded by one upload and one replay;
  * `device`: what the fast path asks of its device beyond arithmetic (capture and replay, copies between host and
    device, their events, staging buffers): CUDA's, a CPU's, and (`emulation`) CUDA's semantics computed on a CPU,
    which the tests and `python -m specgui smoke --emulate` run;
  * `program`: `Program`, a function of one static input buffer, captured as a CUDA graph on CUDA and called
    elsewhere, and the cache's table of them; the contract on held outputs (`overwrite_check`);
  * `forwards`: which programs a pass runs (a stretch of layers, a draft chain, a bucket of rows, a sub-layer),
    made at warm-up or when a method adopts a plan, never inside a timed step;
  * `readout`: the one buffer a greedy step reads, its verify Tops and what rides along with them;
  * `passes`: `StaticPass`, one forward: inputs loaded, program found, program run; plain steps chained (`PlainSteps`);
  * `cursor`: what steps chained on the device share: the run's tokens there, a block's inputs built at its cursor,
    the greedy acceptance written back;
  * `lookup`: prompt lookup's steps chained on the device, n-gram match, verify and acceptance in one program;
  * `skips`: layer-skip steps chained on the device, a draft chain from the cursor, its verify and acceptance;
  * `slots`: Fractal's carried steps chained on the device, the chain its slots predicted, its verify and acceptance.
A step's forward goes through them in turn: `decode` -> `Runner.forward` -> `passes.StaticPass.whole_forward` ->
`inputs.BucketInputs.load` (one upload, the bucket's builder program replayed) -> `forwards.forward_program` (looked
up in the cache's `program.Programs`) -> `program.Program.__call__` (a replay) -> a verify's `Top`, a view of the
`readout`. This module holds what chooses the path and its cache (`resolve`, `cache_for`) and names what the rest of
specgui uses.
"""

from __future__ import annotations

from typing import Any

from specgui.core.runner import Runner
from specgui.errors import SpecGUIError
from specgui.fastpath import device
from specgui.fastpath.cache import StaticKVCache
from specgui.fastpath.forwards import FORWARD, InProgram, Piece, RunLayers, RunRows, adopt, rows_made, units, warm_up
from specgui.fastpath.inputs import BUCKETS, bucket, masks
from specgui.fastpath.lookup import LookupSteps
from specgui.fastpath.passes import PlainSteps, StaticPass, chain
from specgui.fastpath.program import Program, compiles_for, overwrite_check
from specgui.fastpath.readout import CHAIN_NODES
from specgui.fastpath.skips import SkipSteps
from specgui.fastpath.slots import SlotSteps

__all__ = ["BUCKETS", "CHAIN_NODES", "MODES", "SLACK", "InProgram", "LookupSteps", "Piece", "PlainSteps", "Program",
           "RunLayers", "RunRows", "SkipSteps", "SlotSteps", "StaticKVCache", "StaticPass", "adopt", "bucket",
           "cache_for", "chain", "checked", "compiles_for", "masks", "overwrite_check", "resolve", "rows_made",
           "stats", "units", "warm_up"]

SLACK = 512  # room past a run's last position for its largest forward (tree, branches, slots)
MODES = ("auto", "on", "off")


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
    doubled past the need, so that growth is rare), and so does one whose programs would run otherwise (compiled or
    not, on another kind of device: `device.installed`). The runner holds it, so it lives exactly as long as
    the model (a module-level table would keep every model ever loaded alive, graphs and all).
    """
    cache = runner.static_cache
    compiles = compiles_for(runner)
    if (cache is None or cache.capacity < needed + SLACK or cache.programs.compiled != compiles
            or type(cache.programs.device) is not device.kind_for(runner.device)):
        capacity = 256
        while capacity < needed + SLACK:
            capacity *= 2
        runner.static_cache = None  # the old cache's buffers and graphs go before the new ones are made
        runner.static_cache = cache = StaticKVCache(runner, capacity)
        warm_up(cache)
    cache.crop(0)
    return cache


def stats(runner: Runner) -> dict[str, Any]:
    """What the runner's fast path holds: programs, captured graphs, failed captures, time and memory."""
    cache = runner.static_cache
    if cache is None:
        return {"programs": 0, "graphs": 0, "whole_graphs": 0, "failed": 0, "capture_s": 0.0, "graph_bytes": 0,
                "compiled": False}
    table = cache.programs
    programs = table.by_key.values()
    return {"programs": len(table.by_key), "compiled": table.compiled,
            "graphs": sum(p.graph is not None for p in programs),
            "whole_graphs": sum(p.graph is not None for k, p in table.by_key.items() if k[1] == FORWARD),
            "failed": sum(p.failed for p in programs), "capture_s": table.capture_s,
            "graph_bytes": table.graph_bytes}

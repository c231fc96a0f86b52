"""A step's target forward, launched: where it runs, what reading its verdict needs, and how it commits.

A step's forward runs one of three ways (`launch`):
  * `Launched`: a verify forward over the pending token, the host's draft tree and any extras (`verify_forward`);
    committing keeps the pending token's and the accepted nodes' keys (`KVCache.keep`).
  * `ChainedPlain`: pipelined, on the fast path under greedy decoding, a plain step chained on the device
    (`fastpath.PlainSteps`); its one key stays as its launch left the cache (a crop would cut the key of the step
    launched after it).
  * `DeviceDrafted`: a draft the device makes at the launch (a prompt lookup, a layer-skip chain, Fractal's carried
    chain: `Draft.device_draft`), verified and accepted there; the host reads what the device drafted with the verdict
    and checks it against its own, and the cache holds the accepted keys where the chain wrote them.
A chained step may be launched before the step before is read (`ahead`), when its drafter promised it
(`Drafter.ahead`): its token is what the step before leaves on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import NoneType
from typing import Any, ClassVar

import numpy as np
import torch

from specgui import fastpath
from specgui.core.draft import Draft, Lookup, Rider, SkipChain, SlotChain
from specgui.core.runner import VERIFY_TOP, Top
from specgui.core.verify import Verdict
from specgui.errors import SpecGUIError
from specgui.methods.base import DecodeState


@dataclass
class Launched:
    """A verify forward of the host's draft, launched: what reading its verdict needs."""

    logits: torch.Tensor | Top
    extra_logits: torch.Tensor | None = None
    extra_rows: list[int] | None = None
    ready: Any = None  # a chained step's event: its verdict is on the host behind it
    end: Any = None  # pipelined: the clock's mark right behind its forward
    ahead: bool = False  # launched before the step before it was read
    promise: Draft | None = None  # launched ahead: the draft the drafter promised (`Drafter.ahead`)
    kind: type = NoneType  # a step chained on the device: its draft's `device_draft` kind (a plain step's: NoneType)
    chained: ClassVar[bool] = False  # chained on the device (`ChainedPlain`, `DeviceDrafted`)

    def wait(self, clock: Any = None) -> None:
        """Before the verdict's read: a chained step's copy to the host has landed (not the forwards launched since).
        Serially the `clock`'s mark comes first (the step's phases end just before its read): on a GPU waiting for it
        waits for the copy too, but the wait is the event's own, whatever the clock's device (a CPU's clock waits for
        nothing)."""
        if clock is not None:
            clock.mark(wait=self.ready is not None)
        if self.ready is not None:
            self.ready.synchronize()

    def riders(self, draft: Draft) -> list[Rider]:
        """What the device drafted at the launch, to be read with the verdict (nothing: the host drafted); a chain
        that made the draft's nodes also hands their values to `draft.unread`, read with them."""
        return []

    def check(self, draft: Draft, verdict: Verdict, riders: list[Rider]) -> None:
        """After the read: what the device drafted and accepted is what the host did (nothing to check here)."""

    def commit(self, state: DecodeState, draft: Draft, verdict: Verdict, emitted: list[int]) -> None:
        """The cache keeps the pending token's and the emitted nodes' keys (the accepted path, cut where the run
        stops), the rest dropped."""
        kept = verdict.path[: len(emitted) - 1]
        state.cache.keep(state.committed, [0] + [draft.block_row(i) for i in kept])


@dataclass
class ChainedPlain(Launched):
    """A plain step chained on the device (`fastpath.PlainSteps`): its key stays as its launch left the cache."""

    chained: ClassVar[bool] = True

    def commit(self, state: DecodeState, draft: Draft, verdict: Verdict, emitted: list[int]) -> None:
        """Nothing: a crop now would cut the key of the step launched after it."""


@dataclass
class DeviceDrafted(Launched):
    """A step whose draft the device made at the launch (`Draft.device_draft`)."""

    drafted: torch.Tensor | None = None  # what the read checks: a prompt lookup's ids (`fastpath.lookup.check`), how
    # many tokens a skip or slot chain's acceptance took (`fastpath.cursor.check`)
    nodes: torch.Tensor | None = None  # a skip chain's Tops, a slot chain's tokens: its nodes' values (`Unread`)
    chained: ClassVar[bool] = True

    def riders(self, draft: Draft) -> list[Rider]:
        if self.nodes is not None:
            draft.unread.values = self.nodes
        return [Rider(self.drafted)]

    def check(self, draft: Draft, verdict: Verdict, riders: list[Rider]) -> None:
        if self.kind is Lookup:
            fastpath.lookup.check(riders[0].values, draft.tokens)
        else:
            fastpath.cursor.check(riders[0].values, verdict.path)

    def commit(self, state: DecodeState, draft: Draft, verdict: Verdict, emitted: list[int]) -> None:
        """The chain wrote its rows in order: the cache holds the accepted keys where they are."""
        state.cache.lengths = [state.committed + len(emitted)] * len(state.cache.lengths)


class Chains:
    """A run's steps chained on the device, made as its steps first want them: plain ones, pipelined
    (`fastpath.PlainSteps`), prompt lookup's (`fastpath.LookupSteps`), layer-skip ones (`fastpath.SkipSteps`) and
    carried ones (`fastpath.SlotSteps`)."""

    def __init__(self, cache: fastpath.StaticKVCache, pipeline: bool) -> None:
        self.cache, self.pipeline = cache, pipeline
        self.plain: fastpath.PlainSteps | None = None
        self.lookups: dict[tuple[int, int], fastpath.LookupSteps] = {}
        self.skips: fastpath.SkipSteps | None = None
        self.slots: fastpath.SlotSteps | None = None

    def plain_steps(self) -> fastpath.PlainSteps:
        if self.plain is None:
            self.plain = fastpath.PlainSteps(self.cache)
        return self.plain

    def lookup_steps(self, ngrams: tuple[int, int]) -> fastpath.LookupSteps:
        if ngrams not in self.lookups:
            self.lookups[ngrams] = fastpath.LookupSteps(self.cache, ngrams)
        return self.lookups[ngrams]

    def skip_steps(self) -> fastpath.SkipSteps:
        if self.skips is None:
            self.skips = fastpath.SkipSteps(self.cache)
        return self.skips

    def slot_steps(self) -> fastpath.SlotSteps:
        if self.slots is None:
            self.slots = fastpath.SlotSteps(self.cache)
        return self.slots


def plain(state: DecodeState, draft: Draft) -> bool:
    """Whether a step is plain decoding's: nothing drafted, nothing observed or brought along by its forward."""
    return (not len(draft) and draft.extras is None and draft.observer is None and draft.device_draft is None
            and not state.riders)


def kept(state: DecodeState, promise: Draft, draft: Draft) -> bool:
    """Whether a step launched ahead was drafted as promised: a plain step, or the same draft made on the device."""
    return draft.device_draft == promise.device_draft if promise.device_draft is not None else plain(state, draft)


def launch(state: DecodeState, draft: Draft, chains: Chains | None, ahead: bool = False) -> Launched:
    """The step's target forward, chained on the device where it can be: a draft made there (`Draft.device_draft`),
    or, pipelined, a plain step (at the pending token's position, its id the host's, or, for a step launched `ahead`,
    the one the step before leaves there, as a lookup finds its n-gram in what that step left)."""
    made, tokens = draft.device_draft, None if ahead else state.tokens
    if made is not None and chains is None:
        raise SpecGUIError("a draft made on the device needs the fast path under greedy decoding")
    if isinstance(made, SkipChain):
        top, ready, accepted, nodes = chains.skip_steps().launch(made, tokens)
        return DeviceDrafted(top, kind=SkipChain, ready=ready, drafted=accepted, nodes=nodes)
    if isinstance(made, SlotChain):  # the slots' predictions come back as the extras' choices
        top, ready, accepted, nodes = chains.slot_steps().launch(made, tokens)
        return DeviceDrafted(top, extra_rows=list(range(made.window)), kind=SlotChain, ready=ready, drafted=accepted,
                             nodes=nodes)
    if made is not None and (made.size or chains.pipeline):  # (serially a lookup of nothing is a plain step)
        top, ready, drafted = chains.lookup_steps(made.ngrams).launch(made.size, tokens)
        return DeviceDrafted(top, kind=Lookup, ready=ready, drafted=drafted)
    if chains is None or not chains.pipeline or not plain(state, draft):
        return Launched(*verify_forward(state, draft))
    position = state.committed + 1 if ahead else state.committed
    top, ready = chains.plain_steps().launch(position, None if ahead else state.pending)
    return ChainedPlain(top, ready=ready)


def verify_forward(state: DecodeState, draft: Draft
                   ) -> tuple[torch.Tensor | Top, torch.Tensor | None, list[int] | None]:
    """Logits [1 + N, V] for the pending token and the tree nodes, and [E, V] for the extras if wanted. Under greedy
    decoding instead the `Top` of the whole block (`Runner.forward(top=)`, computed in the program), and the rows past
    the tree's whose choices the extras want (read with the rest in one piece, picked on the host)."""
    c = state.committed
    tokens = [state.pending, *draft.tokens]
    positions = [c] + [c + d for d in draft.depths()]
    extras = draft.extras
    visibility = None if draft.is_chain else draft.visibility()
    if extras is not None:
        visibility = extras.block(draft)
        tokens += extras.tokens
        positions += extras.positions
    n = 1 + len(draft)
    want = extras is not None and extras.want_logits
    greedy = state.sampling.greedy
    rows: torch.Tensor | slice = slice(None) if want else slice(0, n)
    if want and extras.logit_rows is not None and not greedy:
        rows = torch.from_numpy(np.concatenate([np.arange(n), n + np.asarray(extras.logit_rows, dtype=np.int64)]))
    ids = np.asarray(tokens, dtype=np.int64)  # host values stay numpy: they ride in the pass's one upload
    unread = draft.unread
    if unread is not None:  # the nodes stay on the device, after the pending token, before any extras
        ids = np.concatenate([ids[:1], np.full(unread.nodes, -1), ids[1:]])  # -1: the id already in place
        if unread.tokens is not None:
            state.cache.place(1, unread.tokens)
    logits = state.runner.forward(
        ids, np.asarray(positions, dtype=np.int64), state.cache, visibility=visibility, logits_rows=rows,
        observer=draft.observer, pre_layer=extras.pre_layer if extras else None,
        top=VERIFY_TOP if greedy else 0,  # greedy reads the head's verdict, computed in the program
    )
    if greedy:
        if not want:
            return logits, None, None
        return logits, None, extras.logit_rows if extras.logit_rows is not None else list(range(len(extras.tokens)))
    return logits[:n], (logits[n:] if want else None), None

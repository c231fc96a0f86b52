"""What a drafter hands to the verifier: a token tree, optional ride-along tokens, and why.

Every method's proposal is a tree rooted at the pending token (the last committed token, whose keys are
not cached yet). A chain (layer-skip drafts, prompt lookup) is the tree whose node i has parent i - 1;
Self-Draft's n-gram candidates are a trie. The verify forward feeds `[pending] + tree nodes + extras`,
so one forward checks the whole tree and also carries work the drafter wants done for the *next* draft
(Self-Draft's branches, Fractal's draft slots).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specgui.core.runner import Observer, PreLayer, SkipPlan


@dataclass
class Extras:
    """Tokens that ride along in the verify forward without being verified.

    `visibility` [E, 1 + N + E] says what each extra token attends to among the block
    `[pending, nodes..., extras...]` (besides the cached prefix, which every token sees). Their keys and
    values are dropped after the forward; the target's argmax at them comes back in `Outcome.extra_tokens`, for every
    extra or, with `logit_rows`, for those extras only (in that order): the LM head is a large share of a
    small model's forward, so rows nobody reads are not computed.
    """

    tokens: list[int]
    positions: list[int]
    visibility: np.ndarray  # bool, built on the host
    pre_layer: PreLayer | None = None
    want_logits: bool = True
    logit_rows: list[int] | None = None

    @staticmethod
    def beside(block: np.ndarray, nodes: int) -> np.ndarray:
        """`visibility` for extras that see the pending token and, among themselves, `block` [E, E]: no draft node
        (host work, in numpy: uploaded with the pass's inputs). Made once a pair (read-only) where `block` is made once
        a shape (read-only)."""
        return _beside(block, nodes) if block.flags.writeable else _shared(_beside, block, nodes)

    def block(self, draft: Draft) -> np.ndarray:
        """The verify block's visibility [T, T], T = 1 + N + E: `draft`'s tree, then these extras' rows. Made once a
        pair (read-only) where both are made once a shape (read-only, as `Draft.visibility`'s and the drafters'
        extras'): it is host work between a verdict's read and the next launch, where a GPU waits for the host."""
        tree = draft.visibility()
        return (_block(tree, self.visibility) if self.visibility.flags.writeable
                else _shared(_block, tree, self.visibility))


def _beside(block: np.ndarray, nodes: int) -> np.ndarray:
    visible = np.zeros((len(block), 1 + nodes + len(block)), dtype=bool)
    visible[:, 0] = True
    visible[:, 1 + nodes :] = block
    return visible


def _block(tree: np.ndarray, extras: np.ndarray) -> np.ndarray:
    n, t = len(tree), len(tree) + len(extras)
    full = np.zeros((t, t), dtype=bool)
    full[:n, :n] = tree
    full[n:] = extras
    return full


class _Same:
    """A read-only array as a cache key, by identity: a cache entry holds it, so that no other array takes its
    identity while the entry lives."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __hash__(self) -> int:
        return id(self.array)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.array is self.array


def _shared(make: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
    """`make(*args)`, made once for the same arguments (arrays by identity: read-only ones made once a shape), and
    read-only."""
    return _made(make, *(_Same(a) if isinstance(a, np.ndarray) else a for a in args))


@functools.lru_cache(maxsize=512)
def _made(make: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
    made = make(*(a.array if isinstance(a, _Same) else a for a in args))
    made.flags.writeable = False
    return made


@dataclass
class Unread:
    """Draft nodes still on the device: their ids as the verify forward reads them, and the values the step's one
    read brings back for them.

    Why: on a GPU every read of a device value stalls the host, and a model-drafted token is known only on the
    device. A drafter on the fast path drafts a fixed shape without reading (a chain of the size the policy chose,
    SWIFT's widest tree) and leaves the cut to the values: once the read is in, `decide` (host work over the read
    `values`, between the read and the next launch: it visits only what stands) says which nodes stand (a chain's
    first token under the draft-exit threshold ends it; a sibling beyond its position's width does not), their tokens
    and their draft probabilities. The verify forward carries every node;
    `Draft.settle` then keeps the valid ones, so the draft the step shows and the tokens it emits are those a
    drafter reading every token would have made. `spine` lists the nodes of the drafted chain (the others are its
    siblings)."""

    nodes: int
    tokens: torch.Tensor | None  # [N] ids (any dtype that holds them exactly) for the verify forward to place; None:
    # already where it reads them (a chained draft put them there: `fastpath.chain`)
    values: torch.Tensor | None  # float32, read with the verdict (None until the launch, for a `SkipChain`'s)
    decide: Callable[[list[float]], tuple[list[int], list[int], list[float]]]  # read values -> the standing nodes
    # (ascending), their tokens, their draft probabilities
    spine: list[int]

    def packed(self) -> torch.Tensor:
        return self.values.reshape(-1)


@dataclass(frozen=True)
class Lookup:
    """A prompt-lookup draft the device makes at the step's launch (`fastpath.LookupSteps`): up to `size` tokens after
    the first earlier occurrence of the longest suffix n-gram, n in `ngrams` (shortest, longest). The drafter drafts
    the same from the host's tokens (`Draft.tokens`), which is what the step shows; the launch makes it from what the
    device holds, so that it needs no read of the step before (size 0: a plain step that chains with them)."""

    size: int
    ngrams: tuple[int, int]

    @property
    def rows(self) -> int:
        """The verify's rows: the pending token's and the draft's, found or not."""
        return 1 + self.size


@dataclass(frozen=True)
class SkipChain:
    """A layer-skip draft the device makes at the step's launch (`fastpath.SkipSteps`): `size` tokens drafted with
    `plan`'s sub-layers skipped from the token the step before left on the device, each standing while every token
    before it reached `threshold` (the draft-exit on the draft's top-1 probability). Its tokens are known on the host
    only with the step's read (`Unread`, its values the launch's), so that it needs no read of the step before."""

    plan: SkipPlan
    size: int
    threshold: float

    @property
    def rows(self) -> int:
        return 1 + self.size


@dataclass(frozen=True)
class SlotChain:
    """A carried draft the device makes at the step's launch (`fastpath.SlotSteps`, Fractal's with `carry`): up to
    `size` tokens of the chain the step before's `window` draft slots predicted, cut where a slot held another token
    than the chain before it predicts (`methods.fractal.consistent_chain`), and none where that step's draft was not
    accepted whole or the chain is `restart`ed (the step after one that carried no slots); then `window` slots riding
    after it, started from a prompt lookup over the text and the chain (`ngrams`), refined inside the forward by
    `splice` (the drafter's hook inside a forward of 1 + `size` rows before its slots, `fastpath.InProgram`;
    `splice.anchored(anchor)` is that hook continuing the row the device tensor `anchor` names). Its tokens are known
    on the host only with the step's read (`Unread`), so that it needs no read of the step before."""

    size: int
    window: int
    ngrams: tuple[int, int]
    restart: bool
    splice: Any  # `methods.fractal.SpliceProgram` (draft imports no method)

    @property
    def rows(self) -> int:
        """The verify's rows: the pending token's, the chain's whole size (valid or not) and the slots'."""
        return 1 + self.size + self.window


DeviceDraft = Lookup | SkipChain | SlotChain  # a draft the device makes at the launch, from what the step before left


@dataclass
class Rider:
    """Device values a drafter needs on the host, read with the step's verdict instead of on their own (ADMG's prompt
    ACS, Fractal's slot guesses): `values` is filled by the read (`DecodeState.ride`). On a GPU a read of its own
    would stall the host once more in the step."""

    device: torch.Tensor
    values: list[float] | None = None


@dataclass
class Draft:
    """A proposal: tree nodes in topological order (parent index < node index, -1 = the pending token).

    `probs` [N, V] holds the draft distribution of each node when it was sampled from a model; without
    it a node is treated as one-hot, which keeps speculative sampling lossless for n-gram drafts.
    Children of a node are tried in node order, so put the drafter's favourite first. `cost_ms` is the
    cost model's price of the drafter's own work this step (draft forwards, compressed passes, lookups),
    besides the verify forward; the decode loop adds the verify's price to predict the step.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None
    probs: torch.Tensor | None = None
    extras: Extras | None = None
    observer: Observer | None = None
    info: dict[str, Any] = field(default_factory=dict)  # for the step's event (its plans as their accounts there)
    cost_ms: float = 0.0
    unread: Unread | None = None  # nodes not read yet (`tokens` stays empty until `settle`)
    node_rows: list[int] | None = None  # after `settle`: each node's index among the nodes the verify carried
    confidences: list[float] | None = None  # after `settle`: each node's draft probability
    spine: list[int] | None = None  # after `settle`: the kept nodes of the drafted chain
    device_draft: DeviceDraft | None = None  # made on the device at the launch, which verifies `size` + 1 rows

    def __post_init__(self) -> None:
        n = len(self.tokens) if self.unread is None else self.unread.nodes
        if self.parents is None:
            self.parents = list(range(-1, n - 1))
        if len(self.parents) != n or any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError("draft parents must point to an earlier node or -1")

    def __len__(self) -> int:
        return len(self.parents)

    def verify_rows(self) -> int:
        """The rows its verify forward runs: the pending token, the tree and any extras; a draft the device makes at
        the launch, its size's rows, found or not."""
        if self.device_draft is not None:
            return self.device_draft.rows
        return 1 + len(self) + (len(self.extras.tokens) if self.extras else 0)

    def block_row(self, node: int) -> int:
        """The verify block's row of `node` (-1: the pending token's, row 0)."""
        return 0 if node < 0 else 1 + (node if self.node_rows is None else self.node_rows[node])

    def settle(self, values: list[float]) -> None:
        """Keep the valid nodes of an `unread` draft, from the step's read of `Unread.packed` (`Unread.decide`
        reads it): tokens, parents renumbered among the kept nodes (a kept node's parent is kept), `node_rows` and
        `confidences`."""
        kept, tokens, confidences = self.unread.decide(values)
        index = {old: new for new, old in enumerate(kept)}
        self.spine = [index[i] for i in self.unread.spine if i in index]  # (both ascending)
        self.tokens = tokens
        self.parents = [index.get(self.parents[i], -1) for i in kept]
        self.node_rows, self.confidences, self.unread = kept, confidences, None

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def depths(self) -> list[int]:
        """Depth of each node below the pending token (a root child has depth 1)."""
        return list(_tree(tuple(self.parents))[1])

    def children(self) -> Mapping[int, tuple[int, ...]]:
        """Node -> children in preference order; key -1 is the pending token. Read-only, made once a shape (the
        verifier walks it right after the verdict's read, where a GPU waits for the host)."""
        return _children(tuple(self.parents))

    def visibility(self) -> np.ndarray:
        """[1 + N, 1 + N] tree attention: each token sees the pending token, its ancestors and itself (host work, in
        numpy: the fast path uploads it with the pass's inputs, `Runner.forward`). Read-only: made once a shape."""
        return _tree(tuple(self.parents))[0]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root down to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@functools.lru_cache(maxsize=256)
def _children(parents: tuple[int, ...]) -> Mapping[int, tuple[int, ...]]:
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
        kids.setdefault(i, [])
    return types.MappingProxyType({node: tuple(nodes) for node, nodes in kids.items()})


@functools.lru_cache(maxsize=256)
def _tree(parents: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """A tree's visibility (read-only) and its nodes' depths, made once a shape: a tree drafter's trie keeps its shape
    from one step to the next more often than not (Self-Draft on a held-out prompt: 11 shapes in 27 steps), and built
    node by node they are host work before the step's launch, which a GPU waits for."""
    n = len(parents)
    visible = np.zeros((n + 1, n + 1), dtype=bool)
    visible[:, 0] = True
    depths: list[int] = []
    for i, p in enumerate(parents):
        row = i + 1
        if p >= 0:
            visible[row] = visible[p + 1]
        visible[row, row] = True
        depths.append(1 if p < 0 else depths[p] + 1)
    visible.flags.writeable = False
    return visible, tuple(depths)


@dataclass
class Outcome:
    """What the verifier decided, as the drafter sees it in `observe`.

    `observe` is also called once after the prompt forward (`prefill` true: no draft, `path` empty, `token`
    the first new token), so a drafter learns from the prompt with the same call. A step's times are not here: the
    loop reads them with the step's event, behind the next launch (a drafter weighs its cost by the cost model's
    prices, `priced`).
    """

    path: list[int]  # accepted draft nodes, root to leaf
    token: int  # the verifier's own token (bonus after a full path, else the correction)
    emitted: list[int]  # tokens committed this step (accepted path + own token, cut at a stop)
    extra_tokens: list[int] | None  # the target's argmax at the extras (or at `Extras.logit_rows`), when asked for
    prefill: bool = False
    priced: float = 0.0  # the step's price in plain steps (the cost model's, predicted over plain ms; 0: none)

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def last_row(self) -> int:
        """Row in the verify block of the last accepted token (node i is row i + 1, the pending token 0)."""
        return self.path[-1] + 1 if self.path else 0

"""`selfdraft`: Self-Draft (Gao et al., AAAI 2025), multi-branch drafting with context and corpus n-gram caches.

One target forward does three jobs (the paper's Fig. 3):
  * it decodes the pending token, as plain decoding would;
  * it verifies n-gram candidates retrieved for the text so far, merged into a trie (the `Draft` tree),
    so that candidates sharing a prefix share nodes;
  * it advances N draft branches: each branch is a short token sequence placed right after the pending
    token (positions c+1, c+2, ...) that sees the committed text, the pending token and its own earlier
    tokens, never a candidate or another branch (block-diagonal mask). The target's next-token choice at
    every branch position yields n-grams [window; prediction] for the context cache, and the branch grows
    by its last prediction, dropping its oldest token past L. Branches ride as `Extras`, so their keys and
    values leave the cache with the forward: only accepted tokens stay.

The context cache also indexes the prompt and the generated text (prompt lookup's strength on summaries and
edits), most recent first; the corpus cache holds frequent n-grams of the model's own outputs on a broad
prompt set (`specgui/tools/corpus.py`). Retrieval takes context candidates first, then corpus ones, each backing
off from the longest key to a one-token key, until the trie holds `budget` tokens.

Branches start as one prompt token each and grow one token per forward: these are Algorithm 1's warm-up
steps, which harvest nothing until a branch holds a full n-gram window. Unlike Algorithm 1, candidates are
verified from the first step, since the prompt-indexed context cache is never empty.

Sizing: how many trie nodes to verify is the cost model's call (`specgui.methods.policy`), from what the
verdicts show each additional node is worth and what the forward's extra rows cost; branch tokens then ride
in the rows the profile prices as free beside them (on a GPU all of the paper's N = L = 6; on this CPU the
few that a forward of about five tokens leaves), taking turns, so every branch keeps advancing.
`max_forward` caps the forward's tokens whatever the profile says.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specgui.core.draft import Draft, Extras, Outcome
from specgui.costs import time_ms
from specgui.methods.base import DecodeState, Drafter, register
from specgui.methods.ngram.ngram_cache import Candidates, CandidateTrie, NgramCache, corpus_for, hit
from specgui.methods.params import param
from specgui.methods.policy import SizedParams

FREE = 0.03  # extra rows whose forward costs at most this much more than without them ride "for free"


@functools.lru_cache(maxsize=256)
def branch_block(lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Branches of `lengths` side by side: the [E, E] mask among their tokens (each sees its own branch up to
    itself: block-diagonal, lower-triangular) and each token's offset in its branch. Read-only and cached: after
    the warm-up the branches fed keep the same lengths step after step, and per-branch numpy calls cost more
    than the rest of the extras together at N = L = 6."""
    sizes = np.asarray(lengths, dtype=np.int64)
    branch = np.repeat(np.arange(len(sizes)), sizes)
    index = np.arange(len(branch))
    offsets = index - np.repeat(np.cumsum(sizes) - sizes, sizes)
    block = (branch[:, None] == branch[None, :]) & (index[:, None] >= index[None, :])
    block.flags.writeable = offsets.flags.writeable = False
    return block, offsets


@dataclass(frozen=True)
class _Rooms:
    """`SelfDraft._room`'s answer: the branch tokens that may ride beside n candidate nodes, for branches of `total`
    tokens in all (for which it holds)."""

    total: int
    room: Callable[[int], int]

    def __call__(self, nodes: int) -> int:
        return self.room(nodes)


@dataclass(frozen=True)
class SelfDraftParams(SizedParams):
    branches: int = param(low=0, high=16, help="draft branches N (0: none)")
    branch_len: int = param(low=1, high=16, help="longest draft branch L: the oldest token drops past it")
    gram: int = param(low=1, high=8, help="n-gram length G: tokens a candidate proposes after its key")
    max_key: int = param(low=1, high=4, help="longest key (tokens) that retrieval backs off from")
    budget: int = param(low=0, high=64, help="most candidate tokens (trie nodes) verified per forward (the cost "
                        "model may verify fewer)")
    max_forward: int = param(low=0, high=512, help="most tokens per forward whatever the cost model says (0: no "
                             "cap)")
    lru: int = param(low=1, high=64, help="continuations the context cache keeps per key")
    use_context: bool = param(help="verify context-cache candidates (off also stops the branches feeding it)")
    use_corpus: bool = param(help="verify corpus-cache candidates")
    corpus: str = param(help="corpus cache under assets/corpus/ built with the model's tokenizer ('' = none)")


@register
class SelfDraft(Drafter):
    name = "selfdraft"
    title = "Self-Draft"
    summary = "Verifies context and corpus n-grams while draft branches in the same forward feed the context cache."
    Params = SelfDraftParams

    def setup(self, state: DecodeState) -> None:
        p = self.params
        self.corpus = (corpus_for(p.corpus, int(self.runner.config.vocab_size), self.name)
                       if p.use_corpus and p.corpus else None)
        self.retrieve_ms = state.profile.mechanism("selfdraft.retrieve", self._retrieve_ms) if state.profile else 0.0

    def begin(self, state: DecodeState) -> None:
        p = self.params
        self.context = NgramCache(p.max_key, p.lru)
        self.indexed = 0  # text positions before this one are indexed with a full continuation
        # Branches start from prompt tokens spread over the prompt's second half (the user's text, after any
        # chat-template preamble); deterministic, so that runs and benchmarks repeat exactly.
        count = p.branches if p.use_context else 0
        pool = state.tokens[len(state.tokens) // 2 :]
        pool = pool if len(pool) >= count else state.tokens
        self.branches = [[pool[(i * len(pool)) // count]] for i in range(count)]
        self.fed: dict[int, list[int]] = {}  # branch index -> its tokens as fed to the last forward
        self.harvest: list[list[int]] = []  # the branches' n-grams of the last verdict, for `after_launch`
        self.turn = 0  # the branch first in line for the next forward
        self.candidates: list[dict[str, Any]] = []  # the launched draft's, as records (`Candidates.within`)
        self.policy = self.sizing(state, range(1, p.budget + 1))
        self.verified, self.exhausted = 0, False
        self.rooms: _Rooms | None = None  # the next draft's, made ahead (`after_launch`)

    def _retrieve_ms(self) -> float:
        """One retrieval into a full trie from a context cache indexed over 1024 tokens (for the cost model; in
        `setup`, so the cache it fills is its own: `begin` starts the run's)."""
        text = torch.randint(0, 1000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
        self.context = NgramCache(self.params.max_key, self.params.lru)
        self.context.add_text(text, self.params.gram, range(len(text) - 1))
        return time_ms(lambda: self._retrieve(text, self.params.gram), torch.device("cpu"))

    # -- 1. draft -------------------------------------------------------------------------------------------

    def draft(self, state: DecodeState) -> Draft:
        depth = state.max_depth
        trie, candidates = self._retrieve(state.tokens, min(depth, self.params.gram))
        found = len(trie.tokens)
        total = sum(len(b) for b in self.branches)
        room = self.rooms if self.rooms is not None and self.rooms.total == total else self._room(state)
        self.rooms = None
        # (on the device's path the plan was chosen ahead, `after_launch`, and is cut to what retrieval found; else
        # chosen now, where something was found)
        sizing = (self.policy.sized(state.unread, functools.partial(self._pricing, state, room), found)
                  if found or state.unread else None)
        n = sizing.size if sizing else 0
        self.verified, self.exhausted = n, n == found
        self.fed = self._choose_branches(room(n)) if depth > 0 else {}
        info: dict[str, Any] = {"branches": list(self.fed.values())}
        if sizing is not None and found:
            info["plan"] = sizing
        self.shown = candidates, info  # the candidates' records join the step's info after the launch, and warm-up's
        extras = self._extras(state.committed, n) if self.fed else None
        return Draft(tokens=trie.tokens[:n], parents=trie.parents[:n], extras=extras, info=info,
                     cost_ms=self.retrieve_ms)

    def _pricing(self, state: DecodeState, room: _Rooms) -> tuple[Callable[[int], float], float]:
        """The policy's prices (`policy.Pricing`): a step verifying n candidate nodes with the branch tokens that ride
        beside them, and plain decoding's step."""
        return (lambda n: state.step_ms(self.retrieve_ms, 1 + n + room(n))), state.plain_ms()

    def _room(self, state: DecodeState) -> _Rooms:
        """This step's branch tokens that may ride beside n candidate nodes, as a function of n: all of them under
        the fixed policy, else the most the profile prices as free (within `FREE` of the forward without them);
        `max_forward` caps.

        The policy prices every size up to the trie's, so each size's room is computed once a step
        (`functools.cache`) and each verify price once a context (`DecodeState.verify_ms`): unshared, each size's
        scan down from all branch tokens re-priced the forwards the scans of its neighbours had priced, ~190 profile
        lookups a step at GPU sizes (N = L = 6, 24 nodes) where prices grow slowly with rows, most of
        selfdraft's host time there."""
        total = sum(len(b) for b in self.branches)
        verify_ms = state.verify_ms

        def room(nodes: int) -> int:
            free = total
            if self.params.policy != "fixed":
                limit = verify_ms(1 + nodes) * (1 + FREE)
                while free > 0 and verify_ms(1 + nodes + free) > limit:
                    free -= 1
            if self.params.max_forward:
                free = min(free, max(0, self.params.max_forward - 1 - nodes))
            return free

        return _Rooms(total, functools.cache(room))

    def _choose_branches(self, room: int) -> dict[int, list[int]]:
        """The branches that fit in `room` tokens, taking turns so that every branch keeps advancing."""
        count = len(self.branches)
        fed: dict[int, list[int]] = {}
        for i in [(self.turn + j) % count for j in range(count)]:
            if len(self.branches[i]) <= room:
                fed[i] = list(self.branches[i])
                room -= len(self.branches[i])
                self.turn = (i + 1) % count
        return dict(sorted(fed.items()))

    def _retrieve(self, text: list[int], depth: int) -> tuple[CandidateTrie, Candidates]:
        """Context candidates first, then corpus ones, longest key first, until the trie is full."""
        trie, candidates = CandidateTrie(self._budget(depth)), Candidates()
        sources = [("context", self.context if self.params.use_context else None), ("corpus", self.corpus)]
        for source, cache in sources:
            if cache is None:
                continue
            for key, gram in cache.lookup(text, self.params.max_key):
                if trie.full:
                    return trie, candidates
                nodes = trie.add(gram[:depth])
                if nodes is not None:
                    candidates.add(nodes, source, key)
        return trie, candidates

    def _budget(self, depth: int) -> int:
        """The most candidate nodes a draft verifies at `depth` tokens of room."""
        budget = self.params.budget if depth > 0 else 0
        return max(0, min(budget, self.params.max_forward - 1)) if self.params.max_forward else budget

    def _extras(self, committed: int, nodes: int) -> Extras:
        """The branches as ride-along tokens: branch j's i-th token sits at position committed + 1 + i and
        sees the pending token (column 0) and its own branch up to itself (block-diagonal, lower-triangular)."""
        lengths = tuple(len(b) for b in self.fed.values())
        block, offsets = branch_block(lengths)
        tokens = [t for b in self.fed.values() for t in b]
        return Extras(tokens=tokens, positions=(offsets + (committed + 1)).tolist(),
                      visibility=Extras.beside(block, nodes))

    # -- 5. observe -----------------------------------------------------------------------------------------

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        if not outcome.prefill:
            # (on the device's path folded in when the next plan is chosen, beside the next forward)
            self.policy.learn(outcome.path, self.verified, self.exhausted, later=state.unread)
        if outcome.extra_tokens is not None:
            self._advance_branches(outcome.extra_tokens)
        if outcome.prefill and self.params.use_context:  # the prompt, before the first draft; the output a step late
            self._index_text(state.tokens)
        payload: dict[str, Any] = {"cache_sizes": {"context": len(self.context),
                                                   "corpus": len(self.corpus) if self.corpus else 0}}
        if outcome.path:
            payload["hit"] = hit(self.candidates, outcome.path)
        return payload

    def _advance_branches(self, predicted: list[int]) -> None:
        """Append every branch's last prediction (what the next draft feeds), and keep its [window; prediction]
        n-grams for the context cache (`after_launch`).

        `predicted[r]` is the target's argmax after extra row r: the token that follows the committed text,
        the pending token and the branch up to that row. Windows hold min(G, L) branch tokens, so a branch
        harvests nothing while it is shorter (the warm-up).
        """
        window = min(self.params.gram, self.params.branch_len)
        row = 0
        for i, fed in self.fed.items():
            branch = self.branches[i]
            after = predicted[row : row + len(fed)]
            row += len(fed)
            self.harvest += [[*fed[k - window + 1 : k + 1], after[k]] for k in range(window - 1, len(fed))]
            branch.append(after[-1])
            del branch[: max(0, len(branch) - self.params.branch_len)]

    def after_launch(self, state: DecodeState) -> None:
        """Beside the next forward: the launched draft's candidates as records (its event shows them,
        `observe` finds the accepted one among them); the context cache learns the last verdict's n-grams (the
        branches' and the text's: the next draft retrieves without them, the one after with them); and the next
        draft's sizes are chosen on the device's path (`DraftPolicy.plan_ahead`, from the verdicts before this
        step's, up to the trie's budget: the draft cuts it to what its retrieval finds), priced with the branch
        tokens that may ride beside each size (`_room`), which stay as they are once the branches are grown."""
        candidates, info = self.shown
        self.candidates = info["candidates"] = candidates.within(self.verified)
        info["warmup"] = any(len(b) < self.params.branch_len for b in self.branches)  # (as drafted: grown at observe)
        self.rooms = room = self._room(state)
        if state.unread:  # (the next step has the depth this one leaves after its own token, at most)
            self.policy.plan_ahead(*self._pricing(state, room), self._budget(state.max_depth - 1))
        for gram in self.harvest:
            self.context.add_gram(gram)
        self.harvest = []
        if self.params.use_context:
            self._index_text(state.tokens)

    def _index_text(self, tokens: list[int]) -> None:
        """Index prompt and output as they grow; the last G positions are re-indexed as their continuations
        lengthen (the cache keeps only the longest version of each)."""
        gram = self.params.gram
        self.context.add_text(tokens, gram, range(self.indexed, len(tokens) - 1))
        self.indexed = max(self.indexed, len(tokens) - gram)

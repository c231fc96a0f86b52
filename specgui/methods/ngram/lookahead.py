"""`lookahead`: Lookahead decoding (Fu et al. 2024), Jacobi iteration harvesting n-grams, verified in the same forward.

One target forward does three jobs (the paper's Fig. 2-3; hao-ai-lab/LookaheadDecoding, `lade/decoding.py`):
  * it decodes the pending token, as plain decoding would;
  * the lookahead branch: a 2-D window of N - 1 levels by W columns of guessed future tokens. Level 0 is
    the pending token followed by W - 1 guesses at the next positions; level l column j sits at position
    pending + l + j and sees level 0 up to column j and column j of every level between (the mask of the
    paper's Fig. 3): each column is one Jacobi trajectory, a chain of consecutive positions whose newest
    token is one iteration fresher than the one below it. The target's next-token guess at the top level
    completes, per column, an n-gram [level 0 .. level N-2, guess] for the pool; then every level moves
    down one (dropping its first column to stay aligned after one committed token) and the guesses become
    the new top level. The window starts as random prompt tokens and takes N - 2 forwards to fill (the
    levels grow one per forward, each a column shorter, so that all are W wide once filled).
  * the verification branch: up to G n-grams of the pool whose first token is the pending token (the most
    recent first) are verified. The pool keeps at most G n-grams per first token (least recently seen out).

The window rides in the forward as `Extras` (its keys leave the cache with the forward, and only the top
level's logits are computed); the guesses are the `Draft` tree, merged into a trie so guesses that share a
prefix share slots (the code verifies every guess separately; the result is the same longest match).
The verifier is the shared one, so greedy output equals plain decoding and sampling keeps the target's
distribution (a guess is a one-hot draft). As in the code, the window advances by one position per step
whatever was accepted, its guesses are greedy (argmax) also when sampling, the window starts from prompt
tokens drawn at random (a fixed seed here, so runs repeat), and `pool_from_prompt` (the code's
POOL_FROM_PROMPT, off there by default) also feeds the prompt's and the output's own n-grams to the pool.

The cost model sizes the verification branch: how many of the candidate trie's nodes ride in the forward
(`policy: cost`; all of them with `fixed`, the paper's G guesses). The window always runs, pausing or not:
it is what feeds the pool, and its rows are priced into every step's cost.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from specgui.core.draft import Draft, Extras, Outcome
from specgui.methods.base import DecodeState, Drafter, register
from specgui.methods.ngram.ngram_cache import Candidates, CandidateTrie, NgramCache, hit
from specgui.methods.params import param
from specgui.methods.policy import SizedParams


@dataclass(frozen=True)
class LookaheadParams(SizedParams):
    window: int = param(low=1, high=64, help="Jacobi window W: future positions the lookahead branch guesses at once")
    ngram: int = param(low=2, high=8, help="n-gram size N: the window keeps N - 1 levels; pool n-grams have N tokens")
    guesses: int = param(low=0, high=64, help="guess set G: n-grams kept per first token in the pool and verified "
                                              "per step")
    pool_from_prompt: bool = param(help="also put the prompt's and the output's own n-grams in the pool")


def window_visibility(width: int, levels: int, nodes: int) -> np.ndarray:
    """[E, 1 + nodes + E] mask of the window rows, E = (width - 1) + (levels - 1) x width.

    Block 0 is [pending, level-0 guesses...] (the pending token is row 0 of the verify block, the guesses the
    first extras); block l > 0 is level l. Row (l, j) sees block 0 columns 0..j and column j of blocks 1..l.
    The guess nodes sit between the pending token and the window and are seen by no window row, so the mask is
    the pending token's column, `nodes` empty ones, then the window's own block (`_window_block`).
    """
    return Extras.beside(_window_block(width, levels), nodes)  # column 0: in block 0, which every row sees


@functools.lru_cache(maxsize=64)
def _window_block(width: int, levels: int) -> np.ndarray:
    """[E, E] what each window row sees among the window rows (`window_visibility`), built once per shape: the
    window keeps its shape step after step, and per-cell Python loops cost ~0.07 ms a step at the code's W = 15,
    N = 5 (a 2-core Intel Xeon)."""
    level = np.concatenate([np.zeros(width - 1, dtype=np.int64), np.repeat(np.arange(1, levels), width)])
    column = np.concatenate([np.arange(1, width), np.tile(np.arange(width), levels - 1)])
    row_level, row_column = level[:, None], column[:, None]
    block = ((level == 0) & (column <= row_column)) | ((level >= 1) & (level <= row_level) & (column == row_column))
    block.flags.writeable = False
    return block


@register
class Lookahead(Drafter):
    name = "lookahead"
    title = "Lookahead decoding"
    summary = "Jacobi iterations in a 2-D window harvest n-grams; n-grams that start at the last token are verified."
    Params = LookaheadParams
    pauses_plainly = True  # a paused step sends neither candidates nor the window

    def begin(self, state: DecodeState) -> None:
        p = self.params
        rng = random.Random(0)
        self.levels: list[list[int]] = [[rng.choice(state.tokens) for _ in range(p.window + p.ngram - 3)]]
        self.pool = NgramCache(max_key=1, capacity=max(1, p.guesses))
        self.indexed = 0
        self.paused = False  # whether the latest priced decision paused drafting (and with it the window)
        self.fed: list[list[int]] | None = None  # the window blocks as fed to the last forward
        self.candidates: list[dict[str, Any]] = []
        self.policy = self.sizing(state, range(1, max(1, p.guesses * (p.ngram - 1)) + 1))
        self.drafted, self.exhausted, self.found = 0, False, 0
        if p.pool_from_prompt:
            self._index_text(state.tokens)

    @property
    def filled(self) -> bool:
        return len(self.levels) == self.params.ngram - 1

    # -- 1. draft -------------------------------------------------------------------------------------------

    def draft(self, state: DecodeState) -> Draft:
        depth = state.max_depth
        trie = CandidateTrie(self.params.guesses * (self.params.ngram - 1) if depth > 0 else 0)
        candidates = Candidates()
        if self.params.guesses:
            for key, gram in self.pool.lookup([state.pending], 1):
                nodes = trie.add(gram[:depth])
                if nodes is not None:
                    candidates.add(nodes, "pool", key)
                if len(candidates) == self.params.guesses or trie.full:
                    break
        fed = [[state.pending, *self.levels[0]], *self.levels[1:]] if depth > 0 else None
        window = sum(len(level) for level in fed) - 1 if fed else 0
        sizing = self.policy.choose(lambda n: state.verify_ms(1 + window + n), state.plain_ms(), len(trie.tokens),
                                    shape=window)
        if sizing.mode != "paused" or sizing.prior is not None:  # priced (the pool offered something): it rules
            self.paused = sizing.mode == "paused"                 # the window too
        # the window serves only drafting: where the cost model paused the drafts it stays home too, and the step is a
        # plain one (the levels wait, unchanged, for the next step that drafts or probes)
        self.fed = None if self.paused else fed
        size = sizing.size  # 0 when the pool offered nothing
        self.found = len(trie.tokens)
        self.drafted, self.exhausted = size, size == len(trie.tokens)  # a larger size would verify the same
        extras = self._extras(state.committed, size) if self.fed else None
        info = {"window": self.fed or [], "warmup": not self.filled, "plan": sizing}
        self.shown = candidates, info  # the candidates' records join the step's info after the launch
        return Draft(tokens=trie.tokens[:size], parents=trie.parents[:size], extras=extras, info=info)

    def _extras(self, committed: int, nodes: int) -> Extras:
        width, levels = len(self.fed[0]), len(self.fed)
        tokens = self.fed[0][1:] + [t for level in self.fed[1:] for t in level]
        positions = [committed + j for j in range(1, width)]
        positions += [committed + level + j for level in range(1, levels) for j in range(width)]
        top = range(width - 1) if levels == 1 else range(len(tokens) - width, len(tokens))
        return Extras(tokens=tokens, positions=positions, visibility=window_visibility(width, levels, nodes),
                      logit_rows=list(top))

    # -- 5. observe -----------------------------------------------------------------------------------------

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        harvested = 0
        if not outcome.prefill:
            self.policy.learn(outcome.path, self.drafted, self.exhausted, len(outcome.emitted), outcome.priced)
        if self.fed is not None and outcome.extra_tokens is not None:
            guesses = outcome.extra_tokens
            if len(self.fed) == 1:  # the top level is block 0, whose first row is the pending token's own
                guesses = [outcome.emitted[0], *guesses]
            harvested = self._advance(guesses)
        if outcome.prefill and self.params.pool_from_prompt:  # the prompt, before the first draft; the output a step
            self._index_text(state.tokens)                   # late (`after_launch`)
        payload: dict[str, Any] = {"cache_sizes": {"pool": len(self.pool)}, "harvested": harvested}
        if outcome.path:
            payload["hit"] = hit(self.candidates, outcome.path)
        return payload

    def _advance(self, guesses: list[int]) -> int:
        """One Jacobi iteration: harvest the columns' n-grams once the window is full, then move every level down."""
        if not self.filled:  # warm-up: every level drops its first column, the guesses become a new level
            self.levels = [level[1:] for level in self.levels] + [guesses[1:]]
            return 0
        for j in range(len(guesses)):
            gram = [block[j] for block in self.fed] + [guesses[j]]
            self.pool.insert((gram[0],), tuple(gram[1:]))
        moved = [*self.levels[1:], guesses]
        self.levels = [moved[0][1:], *moved[1:]]
        return len(guesses)

    def after_launch(self, state: DecodeState) -> None:
        """Beside the next forward: the pool learns the output's n-grams (the next draft retrieves without the last
        verdict's, the one after with them; the window's columns it learns at once: a step late, they cost its
        drafts 2.5% of their accepted tokens, held-out prompts, fixed sizes, CPU); and the next draft's sizes are
        priced (`DraftPolicy.price_ahead`), as many as this one's pool offered, at the window's rows, which stay as
        they are once it is filled. And the launched draft's candidates as records (its event shows them,
        `observe` finds the accepted one among them)."""
        candidates, info = self.shown
        self.candidates = info["candidates"] = candidates.within(self.drafted)
        if self.params.pool_from_prompt:
            self._index_text(state.tokens)
        window = sum(len(level) for level in self.levels)
        self.policy.price_ahead(window, lambda n: state.verify_ms(1 + window + n), self.found)

    def _index_text(self, tokens: list[int]) -> None:
        """The prompt's and output's n-grams (first token -> the N - 1 after it), each indexed once complete."""
        n = self.params.ngram
        for start in range(self.indexed, len(tokens) - n + 1):
            self.pool.insert((tokens[start],), tuple(tokens[start + 1 : start + n]))
        self.indexed = max(self.indexed, len(tokens) - n + 1)

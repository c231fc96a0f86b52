"""A draft vocabulary: the token ids a draft forward computes logits for (FR-Spec, ACL 2025; VocabTrim).

Why: on a small model the LM head is a large share of a forward's weights (SmolLM2-135M: 576 x 49152, 28.3M of
135M), and a layer-skip draft skips layers, never the head, so the head is a larger share still of what a draft
token costs; on a CPU a forward of a few rows is bound by reading weights, so it is that share of the draft's
time. A draft that scores only the ids it is likely to propose reads a fraction of the head.

Which ids: the `size` lowest ids, plus every id of the prompt and of the output so far. A byte-pair tokenizer
numbers its tokens in merge order, most frequent merges first, so low ids are the common ones (for SmolLM2's
tokenizer a row-prefix covers most of what the model writes, and the prompt's own ids most of the rest: names,
code identifiers, numbers it will copy). The prefix of the head's weight is a view, not a copy; the few extra ids'
rows are gathered once each, as they first appear.

Only drafts use it: the verify forward keeps the full head, so greedy output is unchanged, and with sampling a
draft samples from the subset's softmax and keeps exactly that distribution (zero outside the subset) as its
`Draft.probs`, which is all speculative sampling asks of a draft distribution. Logits come back over the whole
vocabulary with -inf outside the subset: argmax, softmax, top-k and the sampling filters then need no other
change, and their values inside the subset are the subset's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from specgui import fastpath
from specgui.core.kvcache import KVCache, to_device
from specgui.core.runner import Runner, SkipPlan
from specgui.costs import beside_ms
from specgui.cpu import kernels

if TYPE_CHECKING:
    from specgui.costs import CostProfile

Product = Callable[[torch.Tensor], torch.Tensor]  # rows [R, H] -> some of a head's outputs [R, n]
EXTRA_IDS = 64  # ids beyond the low ones a draft vocabulary is priced with: about what a prompt brings
SKIP_SHARES = (0.2, 0.3, 0.5)  # shares of the layers a draft token is shown skipping (`draft_token_costs`)


class DraftVocab:
    """The draft vocabulary of one run: `size` low ids plus the ids seen (`add`)."""

    def __init__(self, head: torch.nn.Linear, size: int, seen: Iterable[int] = ()) -> None:
        self.head = head
        self.vocab_size = head.weight.shape[0]
        self.size = min(size, self.vocab_size)
        self.extra: list[int] = []
        self._known: set[int] = set()
        self._ids: torch.Tensor | None = None  # the extra ids on the head's device
        self._parts: dict[int, tuple[Product, Product | None]] = {}  # per head: its low rows' and extra rows' product
        self.add(seen)

    @classmethod
    def of(cls, runner: Runner, size: int, seen: Iterable[int]) -> DraftVocab | None:
        """The draft vocabulary of a method's `draft_vocab` parameter: None (the full head) for 0, a size that covers
        the whole vocabulary, or a head whose weight is not a plain tensor at hand (quantized, or offloaded by
        accelerate, which brings it to the device only inside the module's own call)."""
        head = runner.lm_head
        plain = type(head) is torch.nn.Linear and head.weight.device.type != "meta" and not hasattr(head, "_hf_hook")
        if size <= 0 or not plain or size >= head.weight.shape[0]:
            return None
        return cls(head, size, seen)

    @classmethod
    def typical(cls, runner: Runner, size: int) -> DraftVocab | None:
        """A draft vocabulary as a run holds one, to price it by: `size` low ids and a prompt's worth of others."""
        vocab_size = runner.lm_head.weight.shape[0]
        return cls.of(runner, size, range(size, min(size + EXTRA_IDS, vocab_size)))

    def __len__(self) -> int:
        return self.size + len(self.extra)

    def __contains__(self, token: int) -> bool:
        return token < self.size or token in self._known

    def add(self, tokens: Iterable[int]) -> None:
        """Take the ids of new text (the prompt, emitted tokens) into the vocabulary."""
        new = [t for t in dict.fromkeys(int(t) for t in tokens) if t >= self.size and t not in self._known]
        if new:
            self.extra += new
            self._known.update(new)
            self._ids = None
            self._parts.clear()

    def logits(self, normed: torch.Tensor, head: torch.nn.Module | None = None) -> torch.Tensor:
        """Float logits [..., V] of normed hidden states [..., H] through `head` (default: the model's; Fractal's
        compressed head shares its rows' ids): the subset's as the full head computes them (see
        `kernels.linear_as`), -inf elsewhere."""
        head = self.head if head is None else head
        lead = normed.shape[:-1]
        normed = normed.reshape(-1, normed.shape[-1])
        out = normed.new_full((normed.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32)
        if id(head) not in self._parts:
            if self.extra and self._ids is None:
                self._ids = to_device(torch.tensor(self.extra), normed.device)
            self._parts[id(head)] = (rows_of(head, slice(0, self.size)),
                                     rows_of(head, self._ids) if self.extra else None)
        low, extra = self._parts[id(head)]
        out[:, : self.size] = low(normed).float()
        if extra is not None:
            out[:, self._ids] = extra(normed).float()
        return out.view(*lead, self.vocab_size)


def rows_of(head: torch.nn.Module, rows: slice | torch.Tensor) -> Product:
    """The product of `head`'s outputs `rows` (a slice: views of its weights; ids: their rows gathered once) over
    rows [R, H]. A head that can cut its own rows says how (`part`: the compressed int8 head); a plain linear goes
    through `kernels.linear_as`; any other computes every output and keeps those (exact, nothing saved)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return t[rows] if isinstance(rows, slice) else t.index_select(0, rows.to(t.device))

    if hasattr(head, "part"):
        return head.part(take)
    if isinstance(head, torch.nn.Linear):
        weight, bias = take(head.weight), None if head.bias is None else take(head.bias)
        return lambda x: kernels.linear_as(head, weight, bias, x)
    return lambda x: head(x)[:, rows]


def head_ms(profile: CostProfile, runner: Runner, size: int) -> float:
    """What the final norm and the head over a draft vocabulary of `size` low ids (and a prompt's worth of others)
    cost on one row, the counterpart of the profile's `head`: measured once per profile and size and saved with it
    (`CostProfile.mechanism`), so that the cost model prices the cheaper draft the policy sizes by. Timed beside the
    full head and priced as its share of the profile's `head` (`costs.beside_ms`): timed alone, in a faster moment
    of the machine than the profile's head, it priced a draft token's head well below what the two heads timed in
    turns show."""
    def measure() -> float:
        vocab = DraftVocab.typical(runner, size)
        h = torch.randn(1, 1, runner.config.hidden_size, dtype=runner.dtype, device=runner.device,
                        generator=torch.Generator(runner.device).manual_seed(0))
        with torch.inference_mode():
            return beside_ms([lambda: runner.logits(h, vocab=vocab)], lambda: runner.logits(h), profile.head,
                             runner.device)[0]

    return profile.mechanism(f"draft-head-{size}", measure)


def draft_token_costs(profile: CostProfile, runner: Runner, size: int, shares: Iterable[float] = SKIP_SHARES,
                      repeats: int = 15) -> list[dict[str, float]]:
    """What a layer-skip draft token costs at a few skip sets with the full head and with a draft vocabulary of `size`
    low ids (and a prompt's worth of others), measured and priced (`python -m specgui profile` prints it): the
    question a draft vocabulary answers is how much cheaper a draft token gets at the same skip set. Measured: one-row
    forwards after the profile's short context with the skip set's layers left out, the two heads' timed in turns
    with a plain forward, each priced as its share of it (`costs.beside_ms`: the machine's speed drifts between
    phases), on the profile's path (the fast path's static cache and
    programs where it was measured on them); priced: `CostProfile.skip_forward_ms` with the profile's head and with
    `head_ms`. A skip set of n layers is the n layers below the last (every layer of a Llama costs about the same),
    n the shares of the layers rounded, at least 1, each once. Empty where the model's head takes no draft vocabulary
    (`DraftVocab.typical`)."""
    vocab = DraftVocab.typical(runner, size)
    if vocab is None:
        return []
    context, layers = profile.contexts[0], runner.num_layers
    ids = torch.randint(0, vocab.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(0))
    cache = fastpath.cache_for(runner, context + 1) if profile.key.get("fast_path") else KVCache()  # the profile's path
    head = head_ms(profile, runner, size)
    rows = []
    with torch.inference_mode():
        runner.forward(ids[:context], torch.arange(context), cache)

        def token(plan: SkipPlan | None, heads: DraftVocab | None) -> torch.Tensor:
            return runner.forward(ids[context:], torch.tensor([context]), cache.view(context), skip=plan, vocab=heads)

        counts = dict.fromkeys(min(layers - 1, max(1, round(share * layers))) for share in shares)  # distinct, >= 1
        for n in counts:
            skipped = frozenset(range(layers - 1 - n, layers - 1))
            plan = SkipPlan(attn=skipped, mlp=skipped)
            fastpath.adopt(cache, plan)  # on the fast path its program is made before the clock, as a method does
            full, part = beside_ms([lambda p=plan: token(p, None), lambda p=plan: token(p, vocab)],
                                   lambda: token(None, None), profile.forward_ms(1, context), runner.device, repeats)
            whole, cut = profile.skip_forward_ms(plan, context), profile.skip_forward_ms(plan, context, head)
            rows.append({"layers": n, "full_ms": full, "vocab_ms": part, "full_priced_ms": whole,
                         "vocab_priced_ms": cut, "change": part / full - 1, "priced_change": cut / whole - 1})
    return rows

"""N-gram caches: continuations keyed by the tokens before them, best first per key.

Both of Self-Draft's caches answer one question: "after these last few tokens, which short continuations
are worth verifying?" so they share one structure. A key is a tuple of 1..`max_key` tokens; each key holds
an ordered list of continuations (tuples of up to `gram` tokens), best first. A lookup backs off from the
longest key the text allows to a single token, so a continuation that matches more context is tried
before one that matches only the last token (the paper's priority to longer prefixes).

  * context cache (`NgramCache`, mutable): filled while decoding from the prompt, the generated text and
    the draft branches' predictions. Its order is least-recently-used: an inserted continuation moves to
    the front, the last one falls out past `capacity` (the paper's LRU list per first token).
  * corpus cache (`CorpusCache`, read-only): frequent n-grams of general text for one tokenizer, in
    frequency order per key, built by `python -m specgui.tools.corpus` and stored under `assets/corpus/`.

`CandidateTrie` merges the continuations a drafter retrieves into one token tree rooted at the pending
token, so candidates that share a prefix share verify slots (Self-Draft's candidates, Lookahead's guesses).

The stored file is a compressed numpy archive of two padded int32 tables (keys, continuations; -1 pads)
plus a JSON header: a few hundred kilobytes where a pickle of dicts would be megabytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from specgui import ASSETS_DIR
from specgui.errors import SpecGUIError
from specgui.model import hosting

Key = tuple[int, ...]
Gram = tuple[int, ...]

CORPUS_DIR = ASSETS_DIR / "corpus"
CORPUS_FORMAT = "specgui-ngram-cache"


class NgramCache:
    """Continuations per key of 1..`max_key` tokens, most recently inserted first, at most `capacity` per key."""

    def __init__(self, max_key: int, capacity: int) -> None:
        self.max_key = max_key
        self.capacity = capacity
        self.table: dict[Key, list[Gram]] = {}
        self.size = 0  # continuations stored, over all keys

    def __len__(self) -> int:
        return self.size

    def insert(self, key: Key, gram: Gram) -> None:
        """Put `gram` first under `key`, dropping an entry it extends and the oldest past capacity.

        An entry that is a prefix of `gram` carries nothing `gram` lacks (text indexed before its
        continuation was complete), and one that `gram` is a prefix of already holds it: either way
        only the longer of the two stays, now at the front.
        """
        entries = self.table.get(key)
        if entries is None:  # get, not setdefault: that builds a list on every call (~50 a step at GPU sizes)
            entries = self.table[key] = []
        size = len(gram)
        for i, old in enumerate(entries):
            if old[:size] == gram[: len(old)]:
                if len(old) > size:
                    gram = old
                del entries[i]
                self.size -= 1
                break
        entries.insert(0, gram)
        self.size += 1
        if len(entries) > self.capacity:
            entries.pop()
            self.size -= 1

    def add_text(self, tokens: Sequence[int], gram: int, ends: Iterable[int]) -> None:
        """Index running text: for each position e in `ends`, every key of 1..max_key tokens ending at e
        maps to the (up to `gram`) tokens after e."""
        for e in ends:
            follow = tuple(tokens[e + 1 : e + 1 + gram])
            if not follow:
                continue
            for k in range(1, min(self.max_key, e + 1) + 1):
                self.insert(tuple(tokens[e - k + 1 : e + 1]), follow)

    def add_gram(self, tokens: Sequence[int]) -> None:
        """Index one n-gram: its first 1..max_key tokens each map to the rest."""
        tokens = tuple(tokens)  # once: its slices are the keys and continuations
        for k in range(1, min(self.max_key, len(tokens) - 1) + 1):
            self.insert(tokens[:k], tokens[k:])

    def lookup(self, tokens: Sequence[int], max_key: int | None = None) -> Iterator[tuple[Key, Gram]]:
        """(key, continuation) pairs for the text `tokens`, longest matching key first, best first per key."""
        longest = self.max_key if max_key is None else min(max_key, self.max_key)
        for k in range(min(longest, len(tokens)), 0, -1):
            key = tuple(tokens[-k:])
            for gram in self.table.get(key, ()):
                yield key, gram


class CorpusCache(NgramCache):
    """A frozen `NgramCache` in frequency order, loaded from (or saved to) a corpus file."""

    def __init__(self, meta: dict[str, Any], rows: Iterable[tuple[Key, Gram]]) -> None:
        super().__init__(max_key=int(meta["max_key"]), capacity=int(meta["per_key"]))
        self.meta = meta
        for key, gram in rows:  # rows come best first per key: append keeps that order
            self.table.setdefault(key, []).append(gram)
            self.size += 1

    def insert(self, key: Key, gram: Gram) -> None:
        raise TypeError("the corpus cache is read-only")

    def save(self, path: str | Path) -> None:
        rows = [(key, gram) for key, grams in self.table.items() for gram in grams]
        keys = np.full((len(rows), self.max_key), -1, dtype=np.int32)
        grams = np.full((len(rows), int(self.meta["gram"])), -1, dtype=np.int32)
        for i, (key, gram) in enumerate(rows):
            keys[i, : len(key)] = key
            grams[i, : len(gram)] = gram
        header = json.dumps({"format": CORPUS_FORMAT, **self.meta})
        np.savez_compressed(path, keys=keys, grams=grams, header=np.array(header))


def corpus_for(name: str, vocab_size: int, method: str) -> CorpusCache:
    """The corpus cache `name` (`load_corpus`) for a model of `vocab_size` tokens; a one-line error naming `method`'s
    parameter where it was built for another vocabulary. On a public deployment (`hosting.is_public`) only the
    shipped caches, by name: a visitor's path would have the server read any .npz file it can reach."""
    if hosting.is_public() and name not in (shipped := sorted(p.stem for p in CORPUS_DIR.glob("*.npz"))):
        raise SpecGUIError(f"{method}.corpus must name a shipped corpus cache on this server ({', '.join(shipped)} "
                           f"or '' for none), got {name!r}")
    corpus = load_corpus(name)
    if int(corpus.meta["vocab_size"]) != vocab_size:
        raise SpecGUIError(f"corpus cache {name!r} was built for a vocabulary of {corpus.meta['vocab_size']} tokens, "
                           f"this model has {vocab_size}: set {method}.corpus to a matching cache, or '' for none")
    return corpus


@cache
def load_corpus(name: str) -> CorpusCache:
    """The corpus cache `assets/corpus/<name>.npz` (or a path to one), read once per process."""
    path = Path(name) if name.endswith(".npz") else CORPUS_DIR / f"{name}.npz"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CORPUS_DIR.glob("*.npz"))) or "none"
        raise SpecGUIError(f"no corpus cache {str(path)!r} (shipped: {known}); build one with "
                           "python -m specgui.tools.corpus")
    with np.load(path) as data:
        meta = json.loads(str(data["header"]))
        if meta.pop("format", None) != CORPUS_FORMAT:
            raise SpecGUIError(f"{path} is not a SpecGUI n-gram cache")
        keys, grams = data["keys"].tolist(), data["grams"].tolist()
    rows = ((tuple(t for t in k if t >= 0), tuple(t for t in g if t >= 0)) for k, g in zip(keys, grams))
    return CorpusCache(meta, rows)


class CandidateTrie:
    """Candidates merged into a token tree rooted at the pending token, at most `budget` nodes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        self.full = budget <= 0  # (kept as nodes are added: retrieval asks after every candidate)

    def add(self, gram: tuple[int, ...]) -> list[int] | None:
        """Insert a candidate; return its nodes, or None when it adds no new node (a duplicate, or no room)."""
        nodes: list[int] = []
        node, grew = -1, False
        for token in gram:
            child = self.children.get((node, token))
            if child is None:
                if self.full:
                    break
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.children[(node, token)] = child
                self.full, grew = child + 1 >= self.budget, True
            nodes.append(child)
            node = child
        return nodes if grew else None


class Candidates:
    """The candidates a draft's trie took, as retrieval found them: (trie nodes, source, key), recorded as tuples
    while the draft is made (the launch, and on a GPU the device, waits for it) and shown as records after the launch
    (`within`)."""

    def __init__(self) -> None:
        self.found: list[tuple[list[int], str, tuple[int, ...]]] = []

    def __len__(self) -> int:
        return len(self.found)

    def add(self, nodes: list[int], source: str, key: tuple[int, ...]) -> None:
        self.found.append((nodes, source, key))

    def within(self, n: int) -> list[dict[str, Any]]:
        """The candidates as far as their nodes are among the trie's first `n` (a verify of only those), as records
        {nodes, source, key}: a parent comes before its child, so what stays of each is a prefix; candidates with
        nothing left drop out."""
        cut = [([node for node in nodes if node < n], source, key) for nodes, source, key in self.found]
        return [{"nodes": nodes, "source": source, "key": list(key)} for nodes, source, key in cut if nodes]


def hit(candidates: list[dict[str, Any]], path: list[int]) -> dict[str, int]:
    """Which candidate a non-empty accepted `path` (trie nodes) followed, and how many of its tokens were accepted."""
    index = next(i for i, c in enumerate(candidates) if c["nodes"][: len(path)] == list(path))
    return {"candidate": index, "tokens": len(path)}

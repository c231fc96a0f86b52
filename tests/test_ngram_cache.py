"""The n-gram caches behind Self-Draft: LRU order, back-off lookups, the corpus file, the corpus builder."""

import pytest

from specgui.errors import SpecGUIError
from specgui.methods.ngram.ngram_cache import CORPUS_DIR, CorpusCache, NgramCache, corpus_for, load_corpus
from specgui.tools import corpus


def test_insert_is_most_recent_first_and_evicts_the_oldest():
    cache = NgramCache(max_key=1, capacity=2)
    cache.insert((1,), (2, 3))
    cache.insert((1,), (4, 5))
    assert [g for _, g in cache.lookup([1])] == [(4, 5), (2, 3)]
    cache.insert((1,), (2, 3))  # re-inserting refreshes it
    assert [g for _, g in cache.lookup([1])] == [(2, 3), (4, 5)]
    cache.insert((1,), (6, 7))
    assert [g for _, g in cache.lookup([1])] == [(6, 7), (2, 3)] and len(cache) == 2


def test_a_longer_continuation_replaces_its_prefix_and_never_shrinks():
    cache = NgramCache(max_key=1, capacity=4)
    cache.insert((1,), (2,))
    cache.insert((1,), (2, 3, 4))
    assert [g for _, g in cache.lookup([1])] == [(2, 3, 4)]
    cache.insert((1,), (2, 3))  # adds nothing the stored entry lacks
    assert [g for _, g in cache.lookup([1])] == [(2, 3, 4)] and len(cache) == 1


def test_lookup_backs_off_from_the_longest_key():
    cache = NgramCache(max_key=3, capacity=4)
    cache.add_text([5, 6, 7, 8, 9, 6, 7, 1], gram=2, ends=range(7))
    found = list(cache.lookup([0, 6, 7]))
    assert found[0] == ((6, 7), (1,))  # the latest occurrence of the longest matching key comes first
    assert ((6, 7), (8, 9)) in found and found[-1][0] == (7,)
    assert next(cache.lookup([0, 6, 7], max_key=1))[0] == (7,)
    assert list(cache.lookup([42])) == []


def test_add_gram_keys_every_prefix_up_to_max_key():
    cache = NgramCache(max_key=2, capacity=4)
    cache.add_gram([1, 2, 3, 4])
    assert cache.table == {(1,): [(2, 3, 4)], (1, 2): [(3, 4)]}


def test_corpus_file_round_trip_and_read_only(tmp_path):
    meta = {"max_key": 2, "gram": 3, "per_key": 2, "vocab_size": 10}
    original = CorpusCache(meta, [((1,), (2, 3, 4)), ((1,), (5,)), ((1, 2), (3, 4, 6))])
    path = tmp_path / "tiny.npz"
    original.save(path)
    loaded = load_corpus(str(path))
    assert loaded.table == original.table and loaded.meta["vocab_size"] == 10
    with pytest.raises(TypeError):
        loaded.insert((1,), (2,))
    with pytest.raises(SpecGUIError, match="no corpus cache"):
        load_corpus("no-such-corpus")


def test_a_method_gets_a_corpus_for_its_vocabulary_and_on_a_public_server_only_a_shipped_one(tmp_path, monkeypatch):
    path = tmp_path / "own.npz"
    CorpusCache({"max_key": 1, "gram": 2, "per_key": 1, "vocab_size": 10}, [((1,), (2, 3))]).save(path)
    monkeypatch.setenv("SPECGUI_PUBLIC", "0")  # a local server: its user's own files too
    assert corpus_for(str(path), 10, "selfdraft").table == {(1,): [(2, 3)]}
    with pytest.raises(SpecGUIError, match=r"vocabulary of 10 tokens, this model has 48: set selfdraft\.corpus"):
        corpus_for(str(path), 48, "selfdraft")
    monkeypatch.setenv("SPECGUI_PUBLIC", "1")  # visitors are strangers: no path of theirs is read
    for name in (str(path), "../../etc/anything.npz", "no-such-corpus"):
        with pytest.raises(SpecGUIError, match=r"selfdraft\.corpus must name a shipped corpus cache on this server "
                                               r"\(smollm2 or '' for none\)"):
            corpus_for(name, 10, "selfdraft")
    assert corpus_for("smollm2", 49152, "selfdraft").meta["vocab_size"] == 49152


def test_build_keeps_the_most_frequent_continuations_seen_often_enough():
    texts = [[1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 9], [1, 2, 4, 7]]
    cache = corpus.build(texts, {"max_key": 2, "gram": 2, "vocab_size": 10}, per_key=1, min_count=2)
    assert cache.table[(1,)] == [(2, 3)]  # (2, 3) follows 1 three times, (2, 4) twice: only the best stays
    assert cache.table[(1, 2)] == [(3, 1)]
    assert (9,) not in cache.table and cache.meta["tokens"] == 17


def test_the_shipped_smollm2_cache_is_compact_and_well_formed():
    path = CORPUS_DIR / "smollm2.npz"
    assert path.stat().st_size < 2 * 2**20
    cache = load_corpus("smollm2")
    assert cache.meta["vocab_size"] == 49152 and len(cache) > 1000
    assert all(len(k) <= cache.max_key and 0 < len(g) <= cache.meta["gram"] for k, gs in cache.table.items()
               for g in gs)

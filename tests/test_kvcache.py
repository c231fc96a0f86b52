"""Per-layer KV cache operations: absolute crop on ragged caches, compaction, read-only views, growth."""

import torch

from specgui.core.kvcache import MIN_CAPACITY, FrozenView, KVCache


def _fill(cache: KVCache, layer: int, values: list[float]) -> None:
    t = torch.tensor(values).view(1, 1, -1, 1)
    cache.update(t, -t, layer)


def _keys(cache: KVCache, layer: int) -> list[float]:
    return cache.keys[layer][0, 0, : cache.get_seq_length(layer), 0].tolist()


def test_crop_is_absolute_per_layer_on_a_ragged_cache():
    cache = KVCache()
    _fill(cache, 0, [0, 1, 2, 3, 4, 5])
    _fill(cache, 1, [0, 1, 2, 3])  # this layer skipped two draft tokens
    cache.crop(4)
    assert _keys(cache, 0) == [0, 1, 2, 3]
    assert _keys(cache, 1) == [0, 1, 2, 3]  # DynamicCache.crop(-2) would have cut this one to 2


def test_keep_compacts_accepted_positions_in_every_layer():
    cache = KVCache()
    for layer in range(2):
        _fill(cache, layer, [10, 11, 12, 13, 14, 15, 16])
    cache.keep(3, [0, 2, 3])  # kept block offsets relative to position 3
    for layer in range(2):
        assert _keys(cache, layer) == [10, 11, 12, 13, 15, 16]
        assert cache.values[layer][0, 0, :6, 0].tolist() == [-10, -11, -12, -13, -15, -16]


def test_keep_of_a_prefix_is_a_crop():
    cache = KVCache()
    _fill(cache, 0, [1, 2, 3, 4, 5])
    cache.keep(2, [0, 1])
    assert _keys(cache, 0) == [1, 2, 3, 4]


def test_frozen_view_reads_without_writing():
    cache = KVCache()
    _fill(cache, 0, [1, 2, 3, 4])
    view = FrozenView(cache, 2)
    keys, values = view.update(torch.tensor([9.0]).view(1, 1, 1, 1), torch.tensor([-9.0]).view(1, 1, 1, 1), 0)
    assert keys[0, 0, :, 0].tolist() == [1, 2, 9]
    assert values[0, 0, :, 0].tolist() == [-1, -2, -9]
    assert view.get_seq_length(0) == 2 and cache.get_seq_length(0) == 4
    assert view.get_seq_length(5) == 0
    assert _keys(cache, 0) == [1, 2, 3, 4]  # live positions past the window: joined in a copy, never overwritten


def test_frozen_view_writes_its_keys_past_the_cache_instead_of_copying_the_prefix():
    cache = KVCache()
    _fill(cache, 0, [1, 2, 3, 4])
    new = torch.tensor([8.0, 9.0]).view(1, 1, 2, 1)
    keys, _ = FrozenView(cache, 4).update(new, -new, 0)  # nothing lives past the window: written in place
    assert keys[0, 0, :, 0].tolist() == [1, 2, 3, 4, 8, 9]
    assert keys.data_ptr() == cache.keys[0].data_ptr()  # a view of the cache's buffer, not a copy
    assert cache.get_seq_length(0) == 4 and _keys(cache, 0) == [1, 2, 3, 4]
    keys, _ = FrozenView(cache, 2, scratch=True).update(new, -new, 0)  # the caller declared 3, 4 dead
    assert keys[0, 0, :, 0].tolist() == [1, 2, 8, 9] and keys.data_ptr() == cache.keys[0].data_ptr()
    assert cache.get_seq_length(0) == 4
    big = torch.arange(MIN_CAPACITY, dtype=torch.float32).view(1, 1, -1, 1)
    keys, _ = FrozenView(cache, 4).update(big, -big, 0)  # past the buffer's capacity: it grows, lengths stay
    assert keys.shape[-2] == 4 + MIN_CAPACITY and cache.get_seq_length(0) == 4


def test_update_grows_past_capacity_and_keeps_contents():
    cache = KVCache()
    first = list(range(MIN_CAPACITY - 1))
    _fill(cache, 0, first)
    _fill(cache, 0, [1000, 1001, 1002])
    assert cache.keys[0].shape[-2] >= MIN_CAPACITY + 2
    assert _keys(cache, 0) == [*first, 1000, 1001, 1002]

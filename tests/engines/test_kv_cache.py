"""PagedKVCache alone: allocation is all-or-nothing, resize keeps every live token's K/V."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.node.engines.base import KVCacheFull
from services.node.engines.kv_cache import PagedKVCache

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 3


def new_cache(blocks: int) -> PagedKVCache:
    return PagedKVCache(LAYERS, blocks, BLOCK, HEADS, DIM, torch.float32, "cpu")


def fill(cache: PagedKVCache, rid: str, start: int, end: int, values: dict) -> None:
    """Write a distinct value per (request, layer, position) and remember it."""
    slots = cache.slots(rid, start, end)
    for layer in range(LAYERS):
        k = torch.randn(end - start, HEADS, DIM)
        cache.write(layer, slots, k, -k)
        for i, pos in enumerate(range(start, end)):
            values[(rid, layer, pos)] = k[i]
    cache.set_length(rid, end)


def check(cache: PagedKVCache, values: dict) -> None:
    for (rid, layer, pos), k in values.items():
        slot = cache.slots(rid, pos, pos + 1)
        flat_k = cache.k[layer].view(-1, HEADS, DIM)
        flat_v = cache.v[layer].view(-1, HEADS, DIM)
        assert torch.equal(flat_k[slot][0], k) and torch.equal(flat_v[slot][0], -k)


def test_reserve_is_all_or_nothing():
    cache = new_cache(3)
    cache.reserve({"a": 5})  # 2 blocks
    with pytest.raises(KVCacheFull):
        cache.reserve({"a": 9, "b": 1})  # a needs 1 more, b needs 1: only 1 free
    assert cache.block_tables == {"a": cache.block_tables["a"]} and cache.used_blocks == 2
    cache.reserve({"a": 8})  # no new block needed
    assert cache.used_blocks == 2


def test_gather_pads_with_block_zero():
    cache = new_cache(4)
    values: dict = {}
    cache.reserve({"a": 6, "b": 2})
    fill(cache, "a", 0, 6, values)
    fill(cache, "b", 0, 2, values)
    keys, _ = cache.gather(1, cache.table_tensor(["a", "b"]))
    assert keys.shape == (2, 2 * BLOCK, HEADS, DIM)
    assert torch.equal(keys[0, 5], values[("a", 1, 5)])
    assert torch.equal(keys[1, 1], values[("b", 1, 1)])


def test_resize_compacts_and_refuses_to_drop_live_blocks():
    cache = new_cache(10)
    values: dict = {}
    for rid, n in (("a", 7), ("hole", 9), ("b", 5)):
        cache.reserve({rid: n})
        fill(cache, rid, 0, n, values)
    cache.free("hole")
    values = {key: v for key, v in values.items() if key[0] != "hole"}
    with pytest.raises(ValueError):
        cache.resize(3)  # 4 blocks live
    check(cache, values)
    cache.resize(4)
    assert sorted(b for t in cache.block_tables.values() for b in t) == [0, 1, 2, 3]
    assert cache.free_blocks == [] and cache.k[0].shape[0] == 4
    check(cache, values)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "free", "resize"]), st.integers(0, 3),
                          st.integers(1, 9)), max_size=25))
def test_random_operations_keep_contents(ops):
    cache = new_cache(6)
    values: dict = {}
    for op, who, amount in ops:
        rid = f"r{who}"
        if op == "grow":
            start = cache.lengths.get(rid, 0)
            try:
                cache.reserve({rid: start + amount})
            except KVCacheFull:
                continue
            fill(cache, rid, start, start + amount, values)
        elif op == "free":
            cache.free(rid)
            values = {key: v for key, v in values.items() if key[0] != rid}
        else:
            target = cache.used_blocks + amount - 3
            if target < cache.used_blocks:
                with pytest.raises(ValueError):
                    cache.resize(target)
            else:
                cache.resize(target)
        used = sum(len(t) for t in cache.block_tables.values())
        assert used == cache.used_blocks and len(set(cache.free_blocks)) == len(cache.free_blocks)
    check(cache, values)

"""LRUBytes: eviction by bytes, in recency order."""

from __future__ import annotations

import pytest

from services.node.loader.lru import LRUBytes


def test_evicts_least_recently_used_until_the_new_entry_fits():
    evicted = []
    lru = LRUBytes(100, on_evict=lambda k, v: evicted.append((k, v)))
    lru.admit("a", "A", 40)
    lru.admit("b", "B", 30)
    lru.admit("c", "C", 20)
    assert lru.get("a") == "A"  # a is now the most recent; b the least
    assert lru.admit("d", "D", 45) == ["b", "c"]  # 90 + 45: b (30) is not enough, c too
    assert evicted == [("b", "B"), ("c", "C")]
    assert [k for k, _, _ in lru.entries()] == ["a", "d"] and lru.used_bytes == 85


def test_an_entry_larger_than_the_budget_is_refused_and_evicts_nothing():
    lru = LRUBytes(100)
    lru.admit("a", 1, 60)
    with pytest.raises(ValueError):
        lru.admit("huge", 2, 101)
    assert "a" in lru and lru.used_bytes == 60


def test_replacing_a_key_counts_its_bytes_once():
    lru = LRUBytes(100)
    lru.admit("a", 1, 60)
    assert lru.admit("a", 2, 70) == []
    assert lru.get("a") == 2 and lru.used_bytes == 70
    assert lru.remove("a") == 2 and lru.used_bytes == 0 and lru.get("a") is None


def test_zero_budget_holds_nothing_but_empty_entries():
    lru = LRUBytes(0)
    with pytest.raises(ValueError):
        lru.admit("a", 1, 1)
    lru.admit("empty", 1, 0)
    assert "empty" in lru

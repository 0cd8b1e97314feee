"""The records requests resolved to, kept a moment (services/gateway/record_cache.py): pure
rules with a hand clock and a property of clear(), then two real gateways on real NATS and
Valkey, where a model deleted through one is gone from the other at once, however long that one
would keep it."""

from __future__ import annotations

import time
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.record_cache import MAX_ENTRIES, RecordCache
from shared.schemas import ModelRecord
from tests.gateway.conftest import OPERATOR_KEY, start_gateway


def record(name: str = "m") -> ModelRecord:
    return ModelRecord(name=name, path=f"/models/{name}", weight_bytes=1, kv_bytes_per_token=1,
                       max_context=64)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_record_is_kept_for_its_ttl_and_no_longer():
    clock = Clock()
    cache = RecordCache(1.0, clock)
    cache.put("m", "t", record(), cache.generation)
    clock.now += 0.9
    assert cache.get("m", "t") == record()
    assert cache.get("m", "other-tenant") is None  # per tenant: names resolve per tenant
    clock.now += 0.1
    assert cache.get("m", "t") is None and len(cache) == 0


def test_ttl_zero_keeps_nothing():
    cache = RecordCache(0.0)
    cache.put("m", "t", record(), cache.generation)
    assert cache.get("m", "t") is None


def test_a_read_begun_before_a_change_is_not_kept():
    """A request read the record, an admin change cleared the cache meanwhile: what the request
    read may be the model as it was, and must not outlive the change."""
    cache = RecordCache(60.0)
    started = cache.generation
    cache.clear()  # the change, while the read was in flight
    cache.put("m", "t", record(), started)
    assert cache.get("m", "t") is None
    cache.put("m", "t", record(), cache.generation)
    assert cache.get("m", "t") == record()


def test_it_stays_bounded():
    clock = Clock()
    cache = RecordCache(1.0, clock)
    for i in range(MAX_ENTRIES + 10):
        clock.now += 1e-4
        cache.put(f"m{i}", "t", record(), cache.generation)
        assert len(cache) <= MAX_ENTRIES
    assert cache.get(f"m{MAX_ENTRIES + 9}", "t") is not None


Op = st.tuples(st.sampled_from(["begin", "end", "clear", "get"]), st.sampled_from("abc"))


@settings(max_examples=200, deadline=None)
@given(st.lists(Op, max_size=40))
def test_nothing_read_before_a_clear_is_ever_answered_after_it(ops):
    """Reads begin (their generation taken) and end (put) interleaved with clears: get() never
    answers a record whose read began before the last clear."""
    cache = RecordCache(60.0)
    begun: dict[str, int] = {}  # name -> the generation its read began in
    cleared_at = 0  # generation after the last clear
    kept_from: dict[str, int] = {}  # name -> generation of the read whose record is kept
    for op, name in ops:
        if op == "begin":
            begun[name] = cache.generation
        elif op == "end" and name in begun:
            generation = begun.pop(name)
            cache.put(name, "t", record(name), generation)
            if generation == cache.generation:
                kept_from[name] = generation
        elif op == "clear":
            cache.clear()
            cleared_at = cache.generation
            kept_from.clear()
        elif op == "get" and cache.get(name, "t") is not None:
            assert kept_from.get(name, -1) >= cleared_at


@pytest.mark.integration
def test_a_model_deleted_through_one_gateway_is_gone_from_another_at_once(
        make_settings, seeded_models, tenant_models):
    """B would keep records a minute: only A's notice over NATS can make it forget one."""
    a = start_gateway(make_settings())
    b = start_gateway(make_settings(registry_cache_s=60.0))
    name = "cache/deleted-elsewhere"
    body = {"name": name, "path": str(tenant_models / "tenant-a" / "tiny"), "engine": "torch"}
    try:
        with httpx.Client(headers={"Authorization": "Bearer key-a"}, trust_env=False,
                          timeout=20) as http:
            assert http.post(f"{a.url}/admin/models", json=body).status_code == 201
            tokenize = {"model": name, "prompt": "hello"}
            assert http.post(f"{b.url}/tokenize", json=tokenize).status_code == 200  # kept now
            assert http.delete(f"{a.url}/admin/models/{quote(name, safe='')}").status_code == 200
            deadline = time.monotonic() + 5  # a NATS message, not B's minute
            while (status := http.post(f"{b.url}/tokenize", json=tokenize).status_code) == 200 \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert status == 404
    finally:
        with httpx.Client(headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
                          trust_env=False, timeout=20) as op:
            op.delete(f"{a.url}/admin/models/{quote('tenant-a~' + name, safe='')}")
        a.stop()
        b.stop()

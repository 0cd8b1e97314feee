"""The registry records requests resolved to, kept for a moment: a request for a model served a
second ago skips the Valkey round trip (~0.4 ms of its time to first token on the 2-core box,
bench/results/e2e_overhead_*.json).

Only found models are kept: a model registered a moment ago is never missed. A change is seen
at once by the gateway that made it (its admin route clears the cache) and by the other gateways
within a NATS message (`REGISTRY_CHANGED_SUBJECT`: each clears its cache on it). A change made
behind the admin API's back (a hand edit in Redis), or whose notice was lost (NATS down), is seen
within `ttl_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS

from shared.schemas import ModelRecord
from shared.subjects import REGISTRY_CHANGED_SUBJECT

log = logging.getLogger("slinfer.gateway")

MAX_ENTRIES = 4096  # (name, tenant) pairs; beyond this the expired ones go, then all of them


class RecordCache:
    """(name as the caller wrote it, tenant) -> the record it resolved to, for `ttl_s` seconds.
    A `ttl_s` of 0 keeps nothing."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[tuple[str, str], tuple[ModelRecord, float]] = {}
        # Bumped by every clear: a read that started before a change must not keep what it
        # read (`put` with the generation the read started in).
        self.generation = 0

    def get(self, name: str, tenant: str) -> ModelRecord | None:
        entry = self._entries.get((name, tenant))
        if entry is None:
            return None
        record, until = entry
        if self._clock() >= until:
            del self._entries[(name, tenant)]
            return None
        return record

    def put(self, name: str, tenant: str, record: ModelRecord, generation: int) -> None:
        """Keep what a read begun in `generation` found (not if the registry changed since)."""
        if self.ttl_s <= 0 or generation != self.generation:
            return
        now = self._clock()
        if len(self._entries) >= MAX_ENTRIES:
            self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
        self._entries[(name, tenant)] = (record, now + self.ttl_s)

    def clear(self) -> None:
        self._entries.clear()
        self.generation += 1

    def __len__(self) -> int:
        return len(self._entries)


async def announce_change(nc: NATS) -> None:
    """Tell every gateway the registry changed (best effort: their caches expire anyway)."""
    try:
        await nc.publish(REGISTRY_CHANGED_SUBJECT, b"")
    except Exception as exc:
        log.warning("could not announce a registry change: %r", exc)


async def follow_changes(nc: NATS, cache: RecordCache) -> None:
    """Clear `cache` whenever a gateway announces a registry change."""
    async def on_change(_msg) -> None:
        cache.clear()

    await nc.subscribe(REGISTRY_CHANGED_SUBJECT, cb=on_change)

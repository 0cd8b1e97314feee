"""Re-creating the registry (models and their aliases) and the profiles after Redis lost its data.

What is durable where (README, "Crashes, restarts and what survives them"): valkey keeps the
model registry and the measured profiles in its append-only file, so a restart on its data
directory brings them back by itself. A restart *without* it (a new container without the volume,
a deleted data directory) comes back empty. Then:

- the cluster view comes back by itself: every node re-publishes its snapshot at its next
  heartbeat;
- the registry and the profiles are written back by a placer: each placer keeps a copy of both,
  refreshed every `check()`, and notices the loss by the state epoch (`STATE_EPOCH_KEY`, a
  random value nothing ever deletes): missing or different means "not the Redis I copied from".
  It writes back with HSETNX, so it never overwrites what someone stored meanwhile, and a model
  deleted through the admin API stays deleted (a deletion does not touch the epoch).

The same write-back follows a failover behind Sentinels: a replica promoted after the primary
died lacks whatever the primary took but had not yet sent it (writes the registry confirms with
WAIT are on the replica; others may not be). The keeper notices a new primary by its replication
id (`master_replid`, new whenever a server becomes a primary or restarts) and writes back with
HSETNX what its copy holds and the new primary lacks. (A model deleted in the second before the
failover may come back; delete it again.)

If every placer restarted too while Redis was empty, nobody holds a copy: register the models and
store the profiles again (`slinfer up` does both at start).
"""

from __future__ import annotations

import logging
import uuid

from redis.asyncio import Redis

from shared.subjects import ALIASES_HASH, MODELS_HASH, PROFILES_HASH, STATE_EPOCH_KEY

log = logging.getLogger("slinfer.placer")

KEPT = (MODELS_HASH, PROFILES_HASH, ALIASES_HASH)  # the registry (models, their aliases), the profiles


class StateKeeper:
    """Collaborator: an open `redis.asyncio.Redis`. Call `check()` every second or so."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self.epoch: bytes | None = None  # the epoch the copy below was read under
        self.primary: str | None = None  # the replication id of the primary it was read from
        self.copy: dict[str, dict[bytes, bytes]] = {key: {} for key in KEPT}
        self.restored = 0  # hash fields written back, in total (tests, logs)
        self.checks = 0

    async def check(self) -> int:
        """Refresh the copy, or write it back if Redis lost its data. Returns the fields
        written back now. Raises Redis errors (the caller backs off)."""
        self.checks += 1
        primary = await self._primary_id()
        epoch, *hashes = await self._read()
        if epoch is not None and epoch == self.epoch:
            if self.primary is not None and primary != self.primary:
                return await self._after_failover(primary)
            self.copy, self.primary = dict(zip(KEPT, hashes)), primary
            return 0
        self.primary = primary
        written = 0
        if self.epoch is not None:  # we knew this Redis, and its state is gone
            written = await self._write_back()
            log.warning("Redis lost its data (state epoch %s -> %s): wrote back %d registry and "
                        "profile entries", self.epoch.decode(), epoch.decode() if epoch else "none",
                        written)
        await self._redis.set(STATE_EPOCH_KEY, uuid.uuid4().hex, nx=True)
        self.epoch, *hashes = await self._read()
        for key, current in zip(KEPT, hashes):
            self.copy[key] = {**self.copy[key], **current}
        return written

    async def _after_failover(self, primary: str) -> int:
        """A new primary holds the same state (epoch): write back what it lost, keep the rest."""
        written = await self._write_back()
        if written:
            log.warning("Redis has a new primary (a failover): wrote back %d registry and profile "
                        "entries it lacked", written)
        _, *hashes = await self._read()
        self.copy = {key: {**self.copy[key], **current} for key, current in zip(KEPT, hashes)}
        self.primary = primary
        return written

    async def _primary_id(self) -> str:
        return str((await self._redis.info("replication")).get("master_replid", ""))

    async def _read(self) -> list:
        # One transaction: a Redis that restarts between the reads cannot give us an empty copy
        # under the old epoch.
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(STATE_EPOCH_KEY)
            for key in KEPT:
                pipe.hgetall(key)
            return await pipe.execute()

    async def _write_back(self) -> int:
        written = 0
        for key, fields in self.copy.items():
            for field, value in fields.items():
                written += int(await self._redis.hsetnx(key, field, value))
        self.restored += written
        return written

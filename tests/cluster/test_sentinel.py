"""Redis through Sentinels, on real valkey processes (a primary, a replica, one Sentinel):
`open_redis` with a redis+sentinel:// URL finds the primary, a registry write is confirmed by the
replica (WAIT) before it returns, and after the primary is SIGKILLed the Sentinel promotes the
replica and the same client writes again, with the confirmed write still there."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from contextlib import ExitStack

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from services.placer.keeper import StateKeeper
from shared.redis_client import has_replicas, open_redis, write_confirmed
from shared.registry import ModelRegistry
from shared.schemas import ModelRecord
from shared.servers import ServerProcess, start_redis, start_sentinel

pytestmark = pytest.mark.integration  # real valkey processes

PASSWORD = "s3cret"


def _record(name: str) -> ModelRecord:
    return ModelRecord(name=name, path=f"/models/{name}", weight_bytes=1000)


async def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = await check()
            if result:
                return result
        except Exception:  # noqa: BLE001 - a server between roles: ask again
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.05)


def _servers(stack: ExitStack, tmp_path) -> tuple[ServerProcess, ServerProcess, ServerProcess]:
    primary = start_redis(tmp_path / "primary", password=PASSWORD)
    stack.callback(primary.stop)
    replica = start_redis(tmp_path / "replica", password=PASSWORD, replica_of=primary)
    stack.callback(replica.stop)
    sentinel = start_sentinel(tmp_path / "sentinel", primary, "main", password=PASSWORD,
                              down_after_ms=500)
    stack.callback(sentinel.stop)
    return primary, replica, sentinel


async def test_sentinel_failover_keeps_confirmed_writes_and_writes_again(tmp_path, caplog):
    with ExitStack() as stack:
        primary, replica, sentinel = _servers(stack, tmp_path)
        assert sentinel.url == f"redis+sentinel://:{PASSWORD}@127.0.0.1:{sentinel.port}/main"
        redis = open_redis(sentinel.url, 2.0)
        replica_client = open_redis(replica.url, 2.0)
        try:
            # The replica's first sync done: from then on it holds what WAIT confirmed.
            await _until(lambda: _linked(replica_client), 10, "replica in sync")
            await _until(lambda: has_replicas(redis), 10, "primary sees its replica")
            caplog.set_level(logging.WARNING, logger="slinfer.redis")
            registry = ModelRegistry(redis)
            await registry.register(_record("before"))
            assert not [r for r in caplog.records if "no replica confirmed" in r.message]
            # Confirmed means on the replica now, before anything else happens.
            assert await ModelRegistry(replica_client).get("before") is not None

            primary.proc.kill()  # SIGKILL: no goodbye to the replica
            primary.proc.wait()
            killed = time.monotonic()
            # The same client: its next connection asks the Sentinel for the primary again.
            await _until(lambda: _write(redis, "after"), 20, "a write after the failover")
            stalled = time.monotonic() - killed
            role = (await replica_client.info("replication"))["role"]
            assert role == "master", role
            assert await registry.get("before") is not None  # confirmed before the kill: kept
            assert await redis.get("after") == b"1"
            print(f"\nSentinel failover: writes stalled {stalled:.1f}s")
            assert stalled < 15
        finally:
            await redis.aclose()
            await replica_client.aclose()


async def test_a_call_made_during_a_failover_waits_it_out(tmp_path):
    """One registry read issued right after the primary died answers (from the promoted
    replica) instead of raising: a Sentinel client retries for as long as a failover takes, so
    the gateway does not answer 503 for a ~2 s failover."""
    with ExitStack() as stack:
        primary, replica, sentinel = _servers(stack, tmp_path)
        redis = open_redis(sentinel.url, 2.0)
        replica_client = open_redis(replica.url, 2.0)
        try:
            await _until(lambda: _linked(replica_client), 10, "replica in sync")
            await ModelRegistry(redis).register(_record("kept"))
            await _until(lambda: ModelRegistry(replica_client).get("kept"), 10, "the copy")
            # The Sentinel learns replicas from the primary's INFO (every 10 s): until it knows
            # one, it has nobody to promote.
            await _until(lambda: _sentinel_knows_replica(sentinel), 30, "the Sentinel's replica")
            primary.proc.kill()
            primary.proc.wait()
            assert (await ModelRegistry(redis).get("kept")) is not None  # no retry loop here
            assert (await replica_client.info("replication"))["role"] == "master"
        finally:
            await redis.aclose()
            await replica_client.aclose()


async def test_what_a_failover_lost_a_placer_writes_back(tmp_path):
    """A registration the primary took while its replica was stalled is not on the replica the
    Sentinel promotes when the primary dies: the placer's keeper sees the new primary and writes
    its copy back."""
    with ExitStack() as stack:
        primary, replica, sentinel = _servers(stack, tmp_path)
        redis = open_redis(sentinel.url, 2.0)
        replica_client = open_redis(replica.url, 2.0)
        keeper = StateKeeper(redis)
        try:
            await _until(lambda: _linked(replica_client), 10, "replica in sync")
            await _until(lambda: _sentinel_knows_replica(sentinel), 30, "the Sentinel's replica")
            await keeper.check()
            # A replica cut off from its primary (stalled, its link dropped) misses what follows.
            replica.proc.send_signal(signal.SIGSTOP)
            try:
                direct = open_redis(primary.url, 2.0)
                await direct.execute_command("CLIENT", "KILL", "TYPE", "replica")
                await direct.aclose()
                await ModelRegistry(redis).register(_record("late"))  # unconfirmed (logged)
                await keeper.check()  # the placer's copy has it
                primary.proc.kill()
                primary.proc.wait()
            finally:
                replica.proc.send_signal(signal.SIGCONT)
            await _until(lambda: _is_primary(replica_client), 30, "the replica's promotion")
            assert await ModelRegistry(replica_client).get("late") is None  # lost in the failover
            assert await keeper.check() >= 1
            assert await ModelRegistry(redis).get("late") is not None
        finally:
            await redis.aclose()
            await replica_client.aclose()


async def test_a_primary_cut_off_from_its_replicas_sends_writes_to_the_sentinels_choice(tmp_path):
    """A primary set to refuse writes without a replica in reach (min-replicas-to-write) answers
    NOREPLICAS once its replica is gone; a client still connected to it asks the Sentinels again
    and writes to the server they name now, instead of failing (or, without the setting, writing
    to a primary whose writes the failover discards). The cut is staged from the client's side:
    the replica leaves (REPLICAOF NO ONE) and the Sentinel is told to watch it as the primary,
    which is what a client sees after a failover on the far side of a network cut."""
    with ExitStack() as stack:
        primary = start_redis(tmp_path / "primary", password=PASSWORD, min_replicas_to_write=1)
        stack.callback(primary.stop)
        replica = start_redis(tmp_path / "replica", password=PASSWORD, replica_of=primary)
        stack.callback(replica.stop)
        sentinel = start_sentinel(tmp_path / "sentinel", primary, "main", password=PASSWORD,
                                  down_after_ms=60_000)  # no failover of its own
        stack.callback(sentinel.stop)
        redis = open_redis(sentinel.url, 2.0)
        primary_client, replica_client = open_redis(primary.url, 2.0), open_redis(replica.url, 2.0)
        ask = Redis(host=sentinel.host, port=sentinel.port)
        try:
            await _until(lambda: _linked(replica_client), 10, "replica in sync")
            await _until(lambda: _write(redis, "before"), 10, "a write with the replica in reach")
            assert await primary_client.get("before") == b"1"

            await replica_client.execute_command("REPLICAOF", "NO", "ONE")
            await ask.execute_command("SENTINEL", "REMOVE", "main")
            await ask.execute_command("SENTINEL", "MONITOR", "main", replica.host, replica.port, 1)
            await ask.execute_command("SENTINEL", "SET", "main", "auth-pass", PASSWORD)
            await _until(lambda: _refuses(primary_client), 10, "the old primary's refusal")

            assert await _write(redis, "after")  # the same client: now on the Sentinel's choice
            assert await replica_client.get("after") == b"1"
            assert await primary_client.get("after") is None
        finally:
            for client in (redis, primary_client, replica_client, ask):
                await client.aclose()


async def _refuses(client) -> bool:
    try:
        await client.set("probe", "1")
    except ResponseError as exc:
        return str(exc).startswith("NOREPLICAS")
    return False


async def _is_primary(client) -> bool:
    return (await client.info("replication"))["role"] == "master"


async def test_a_write_without_replicas_does_not_wait(tmp_path):
    server = start_redis(tmp_path / "alone")
    redis = open_redis(server.url, 2.0)
    try:
        assert not await has_replicas(redis)
        started = time.monotonic()
        assert await write_confirmed(redis, "alone", lambda p: p.set("k", "v")) == [True]
        assert time.monotonic() - started < 0.5  # no WAIT for a replica that is not there
    finally:
        await redis.aclose()
        server.stop()


async def _sentinel_knows_replica(sentinel: ServerProcess) -> bool:
    client = Redis(host=sentinel.host, port=sentinel.port)
    try:
        return bool(await client.execute_command("SENTINEL", "REPLICAS", "main"))
    finally:
        await client.aclose()


async def _linked(replica) -> bool:
    info = await replica.info("replication")
    return info.get("master_link_status") == "up"


async def _write(redis, key: str) -> bool:
    return bool(await redis.set(key, "1"))

"""`open_redis` on a real valkey: a client whose pooled connections all died with a Redis restart
answers the next command instead of failing it (what made a request after a Redis restart get a
503 from the gateway), and a Redis that is down still fails with a connection error (refused,
not a timeout: the gateway turns it into a 503 at once)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis_client import NewestSentinel, newest_primary, open_redis
from shared.servers import start_redis

pytestmark = pytest.mark.integration  # real valkey processes


async def _fill_pool(redis: Redis, n: int) -> None:
    """Open `n` pooled connections (concurrent commands each take one)."""
    await asyncio.gather(*(redis.blpop(["nothing"], timeout=0.05) for _ in range(n)))


def test_commands_survive_a_redis_restart(tmp_path):
    server = start_redis(tmp_path)

    async def run() -> tuple[bool, bool]:
        plain, ours = Redis.from_url(server.url), open_redis(server.url, 2.0)
        try:
            for client in (plain, ours):
                await client.set("k", "v")
                await _fill_pool(client, 4)
            restarted = await asyncio.to_thread(server.again)
            try:
                plain_ok = True
                try:
                    await plain.get("k")
                except RedisConnectionError:
                    plain_ok = False  # the stale connection, handed out as if alive
                results = [await ours.get("k") for _ in range(6)]  # every stale connection
                return plain_ok, all(r == b"v" for r in results)
            finally:
                restarted.stop()
        finally:
            await plain.aclose()
            await ours.aclose()

    plain_ok, ours_ok = asyncio.run(run())
    assert not plain_ok, "redis-py now retries by itself: this helper may no longer be needed"
    assert ours_ok


def test_a_redis_that_is_down_fails_at_once(tmp_path):
    server = start_redis(tmp_path)
    url = server.url
    server.stop()

    async def run() -> None:
        redis = open_redis(url, 2.0)
        try:
            with pytest.raises(RedisConnectionError):
                await redis.get("k")
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_a_connect_whose_syn_is_lost_gives_up_at_its_own_timeout():
    """A listener whose accept queue is full drops SYNs, as a cut network does: a connect left
    to the kernel waits for its SYN retries (1, 3, 7... s, still waiting here after 3 s), one
    with `connect_timeout_s` fails at that bound so the next command can connect afresh."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # the queue's one place: now full
    url = f"redis://127.0.0.1:{port}"

    async def run() -> tuple[bool, type]:
        kernel = open_redis(url)  # as the placer and nodes opened it: the kernel decides
        bounded = open_redis(url, 5.0, connect_timeout_s=0.3)
        try:
            try:
                await asyncio.wait_for(kernel.ping(), 3.0)
                kernel_waited = False
            except asyncio.TimeoutError:
                kernel_waited = True
            try:
                await asyncio.wait_for(bounded.ping(), 3.0)
                raised = type(None)
            except Exception as exc:  # noqa: BLE001 - which one is the point
                raised = type(exc)
            return kernel_waited, raised
        finally:
            await kernel.aclose()
            await bounded.aclose()

    try:
        kernel_waited, raised = asyncio.run(run())
    finally:
        filler.close()
        listener.close()
    assert kernel_waited, "the kernel completed a connect to a full listener: the test is moot"
    assert raised is RedisTimeoutError, raised


def _state(ip: str, epoch: int) -> dict:
    return {"ip": ip, "port": 6379, "config-epoch": epoch}


def test_the_newest_sentinel_configuration_names_the_primary():
    # A Sentinel that was cut off with the old primary (epoch 3) answers first; the others
    # promoted a replica meanwhile (epoch 4): theirs is the primary.
    assert newest_primary([_state("10.0.0.3", 3), _state("10.0.0.2", 4),
                           _state("10.0.0.2", 4)]) == ("10.0.0.2", 6379)


def test_sentinels_that_agree_give_the_first_answer_and_none_gives_none():
    assert newest_primary([_state("a", 2), _state("b", 2)]) == ("a", 6379)
    assert newest_primary([]) is None


class _FakeSentinel:
    """A Sentinel's answer to SENTINEL MASTERS (a dict), or the error it fails with."""

    def __init__(self, answer):
        self.answer = answer

    async def sentinel_masters(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _master(ip: str, epoch: int, **flags) -> dict:
    return {"main": {"ip": ip, "port": 6379, "config-epoch": epoch, "is_master": True,
                     "is_sdown": False, "is_odown": False, "num-other-sentinels": 2, **flags}}


async def test_discovery_asks_every_sentinel_and_skips_the_unreachable_and_the_down():
    sentinel = NewestSentinel([("127.0.0.1", 1)])
    sentinel.sentinels = [_FakeSentinel(RedisConnectionError("cut off")),
                          _FakeSentinel(_master("10.0.0.3", 3)),  # the cut host's, first
                          _FakeSentinel(_master("10.0.0.9", 9, is_sdown=True)),
                          _FakeSentinel(_master("10.0.0.2", 4))]
    assert await sentinel.discover_master("main") == ("10.0.0.2", 6379)


async def test_no_usable_answer_is_a_connection_error_that_names_the_failures():
    sentinel = NewestSentinel([("127.0.0.1", 1)])
    sentinel.sentinels = [_FakeSentinel(RedisTimeoutError("slow")), _FakeSentinel({})]
    with pytest.raises(RedisConnectionError, match="slow"):  # MasterNotFoundError: retried
        await sentinel.discover_master("main")

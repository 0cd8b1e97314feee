"""The one way services open Redis: a pooled async client that retries a command on a broken
connection before giving up; for a `redis+sentinel://` URL, a client of whichever server the
Sentinels name primary now.

Why retry: after Redis restarts, every connection the pool held is dead, and redis-py (8.x) does
not retry by default, so the first command on each of them failed with ConnectionError and a
request that arrived after Redis was back got a 503. A refused or reset connection fails fast, so
a few quick retries cost milliseconds; a timeout is not retried (a hung Redis must answer 503
within its timeout, not three of them).

Why Sentinel (not Valkey Cluster): the placer's transactions touch several keys at once, which a
Cluster refuses across hash slots. After a failover, a connection to the old primary is dropped
(refused, READONLY once it is a replica, or NOREPLICAS while it is cut off from its replicas and
set to refuse writes then: `min-replicas-to-write`) and the next one asks the Sentinels again,
all of them, trusting the one that knows the latest failover.

    redis+sentinel://[:password@]host1:26379,host2:26379/<master-name>[/<db>]

The password is the data servers' (the Sentinels themselves take none here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

RETRIES = 3  # enough for every stale pooled connection to be replaced by a fresh one
BACKOFF_CAP_S, BACKOFF_BASE_S = 0.2, 0.02
# Behind Sentinels a dead primary is replaced within a few seconds (down-after-milliseconds,
# then the election and the promotion: ~2 s measured with a 1 s down-after): a command retries
# that long, each try asking the Sentinels for the primary again, instead of failing the caller.
FAILOVER_RETRIES, FAILOVER_BACKOFF_CAP_S = 14, 0.5  # ~5.5 s in all
SENTINEL_SCHEME = "redis+sentinel://"
SENTINEL_PORT = 26379
SENTINEL_TIMEOUT_S = 2.0  # asking a Sentinel must not hang a command on a dead one


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    password: str | None = None


def parse_sentinel_url(url: str, name: str = "SLINFER_REDIS_URL") -> SentinelTarget:
    """`redis+sentinel://[:pw@]h1:26379,h2/<master>[/<db>]`; ValueError naming `name` if not."""
    if not url.startswith(SENTINEL_SCHEME):
        raise ValueError(f"{name} must start with {SENTINEL_SCHEME}")
    netloc, _, path = url[len(SENTINEL_SCHEME):].partition("/")
    password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        password = unquote(userinfo.partition(":")[2] if ":" in userinfo else userinfo) or None
    sentinels = tuple(_host_port(part.strip(), name) for part in netloc.split(","))
    master, _, db = path.partition("/")
    if not master:
        raise ValueError(f"{name}: a redis+sentinel:// URL names the master after the hosts "
                         f"(.../<master-name>[/<db>])")
    db = db.rstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"{name}: the database after the master name must be a number, got "
                         f"{db!r}")
    return SentinelTarget(sentinels, master, int(db or 0), password)


def _host_port(part: str, name: str) -> tuple[str, int]:
    if not part:
        raise ValueError(f"{name}: an empty Sentinel address")
    if part.startswith("["):  # [v6]:port
        host, _, rest = part[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host or (port and not port.isdigit()) or not 0 < int(port or SENTINEL_PORT) < 65536:
        raise ValueError(f"{name}: bad Sentinel address {part!r} (host[:port])")
    return host, int(port or SENTINEL_PORT)


def _retry(failover: bool = False) -> dict:
    cap, tries = (FAILOVER_BACKOFF_CAP_S, FAILOVER_RETRIES) if failover else (BACKOFF_CAP_S, RETRIES)
    return {"retry": Retry(ExponentialBackoff(cap=cap, base=BACKOFF_BASE_S), tries,
                           supported_errors=(RedisConnectionError,)),
            "retry_on_error": [RedisConnectionError]}


def open_redis(url: str, timeout_s: float | None = None,
               connect_timeout_s: float | None = None) -> Redis:
    """An async client for `url`; `timeout_s` bounds each socket read/write, and connecting
    too unless `connect_timeout_s` says otherwise."""
    connect_s = timeout_s if connect_timeout_s is None else connect_timeout_s
    if url.startswith(SENTINEL_SCHEME):
        return _open_sentinel(parse_sentinel_url(url), timeout_s, connect_s)
    return Redis.from_url(url, socket_connect_timeout=connect_s, socket_timeout=timeout_s,
                          **_retry())


NOREPLICAS = "NOREPLICAS"  # a primary with min-replicas-to-write refusing a write


class _AskingConnection(SentinelManagedConnection):
    """A connection to the primary that asks the Sentinels where it is on every reconnect.
    redis-py's own (redis-py issue 3874) asks only on a pool's first connect: a command retried
    after the primary died reconnects through `connect_check_health` to the dead address until
    its retries run out, though the Sentinels promoted a replica a second in."""

    async def read_response(self, *args, **kwargs):
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not str(exc).startswith(NOREPLICAS):
                raise
            # The primary is cut off from its replicas (the Sentinels may have promoted one on
            # the other side). The write was refused, not done, so it is safe to retry it: drop
            # the connection so that the retry asks the Sentinels where the primary is now.
            await self.disconnect()
            raise RedisConnectionError(
                f"the primary at {self.host}:{self.port} refuses writes: {exc}") from exc

    async def connect_check_health(self, check_health: bool = True,
                                   retry_socket_connect: bool = True) -> None:
        if not retry_socket_connect:  # from connect_to(): the address was just asked for
            await super().connect_check_health(check_health=check_health,
                                               retry_socket_connect=False)
            return
        await self.connect()  # asks the Sentinels, then connect_to() the primary they name


def newest_primary(states: list[dict]) -> tuple[str, int] | None:
    """The primary named by the Sentinel whose configuration is newest (highest config-epoch:
    each failover raises it), among Sentinels' `SENTINEL MASTERS` entries that see it up; the
    first of them on a tie (the caller's order), None if there are none."""
    if not states:
        return None
    best = max(states, key=lambda s: s.get("config-epoch", 0))  # max keeps the first on a tie
    return best["ip"], int(best["port"])


class NewestSentinel(Sentinel):
    """Asks every Sentinel at once and believes the newest configuration. redis-py's asks them
    in turn, takes the first that answers and moves it to the front; a host cut off the network
    with its Sentinel then keeps hearing, after the heal, from that Sentinel, which may still
    name the cut-off primary until the others' news reaches it, while the others already name
    the one they promoted."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        replies = await asyncio.gather(*(s.sentinel_masters() for s in self.sentinels),
                                       return_exceptions=True)
        states, errors = [], []
        for sentinel, reply in zip(self.sentinels, replies):
            if isinstance(reply, BaseException):
                if not isinstance(reply, (RedisConnectionError, RedisTimeoutError)):
                    raise reply
                errors.append(f"{sentinel}: {type(reply).__name__}: {reply}")
            elif (state := reply.get(service_name)) and self.check_master_state(state,
                                                                                  service_name):
                states.append(state)
        address = newest_primary(states)
        if address is None:
            raise MasterNotFoundError(f"No master found for {service_name!r}"
                                      + (f" : {', '.join(errors)}" if errors else ""))
        return address


def _open_sentinel(target: SentinelTarget, timeout_s: float | None,
                   connect_s: float | None) -> Redis:
    asking = timeout_s or SENTINEL_TIMEOUT_S
    sentinel = NewestSentinel(list(target.sentinels), sentinel_kwargs={
        "socket_connect_timeout": connect_s or asking, "socket_timeout": asking})
    return sentinel.master_for(target.master, db=target.db, password=target.password,
                               socket_connect_timeout=connect_s, socket_timeout=timeout_s,
                               connection_class=_AskingConnection, **_retry(failover=True))


# ---------------------------------------------------------------- writes a replica confirms

REPLICA_WAIT_MS = 1000  # a replica in sync confirms in about a round trip
log = logging.getLogger("slinfer.redis")


async def has_replicas(redis: Redis) -> bool:
    """Whether the server (the primary) has a replica connected now."""
    info = await redis.info("replication")
    return int(info.get("connected_slaves", 0)) > 0


async def write_confirmed(redis: Redis, what: str,
                          write: Callable[[Pipeline], object]) -> list:
    """Run `write(pipeline)` (commands queued on one pipeline) and return their results; when
    the server has replicas, then wait (`WAIT 1`) until one holds them. Why: a primary that dies
    before its replicas copied a registry or profile write loses it at failover (issue 23:
    198 of 198 writes lost by a primary killed before its replica's first sync). A wait that
    times out is logged, not raised: the write stands on the primary, and failing the caller
    would make it retry a write that is already there."""
    replicated = await has_replicas(redis)
    # One pipeline, one connection: WAIT counts the writes of the connection it runs on.
    async with redis.pipeline(transaction=False) as pipe:
        write(pipe)
        if replicated:
            pipe.wait(1, REPLICA_WAIT_MS)
        results = await pipe.execute()
    if not replicated:
        return results
    if results[-1] < 1:
        log.warning("%s: no replica confirmed it within %d ms (a failover now would lose it)",
                    what, REPLICA_WAIT_MS)
    return results[:-1]

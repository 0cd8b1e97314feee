"""The one way services open Redis: a pooled async client that retries a command on a broken
connection before giving up.

Why: after Redis restarts, every connection the pool held is dead, and redis-py (8.x) does not
retry by default, so the first command on each of them failed with ConnectionError and a request
that arrived after Redis was back got a 503. A refused or reset connection fails fast, so a few
quick retries cost milliseconds; a timeout is not retried (a hung Redis must answer 503 within
its timeout, not three of them).
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

RETRIES = 3  # enough for every stale pooled connection to be replaced by a fresh one
BACKOFF_CAP_S, BACKOFF_BASE_S = 0.2, 0.02


def open_redis(url: str, timeout_s: float | None = None) -> Redis:
    """An async client for `url`; `timeout_s` bounds connecting and each socket read/write."""
    return Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                          retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
                                      RETRIES, supported_errors=(RedisConnectionError,)),
                          retry_on_error=[RedisConnectionError])

"""The common shape of a NATS + Redis service process: set up telemetry and read settings once,
connect, run until SIGINT/SIGTERM, close (flushing buffered spans). Used by `slinfer placer` and
`slinfer node`."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from shared import telemetry
from shared.bus import connect_nats
from shared.redis_client import open_redis

S = TypeVar("S")

# A placer's or a node's Redis commands are short (none blocks on the server): one unanswered
# for REDIS_TIMEOUT_S is stuck on a connection the network lost, and fails so that the next
# command opens a new one. A connect gets less: one started while the network is cut loses its
# SYN, and the kernel would resend it only after 1, 3, 7... s; a bounded one is tried again,
# fresh. (A guard: the multi-host test's slow returns after a cut turned out to have another
# cause, the valkey primary cut off with the node; see bench/BENCHMARKS.md, "Several hosts".)
REDIS_TIMEOUT_S = 5.0
REDIS_CONNECT_TIMEOUT_S = 1.0


Body = Callable[[S, NATS, Redis, asyncio.Event, telemetry.Telemetry], Awaitable[None]]


async def _serve(settings, client_name: str, body: Body, tel: telemetry.Telemetry) -> None:
    nc = await connect_nats(settings.nats_url, client_name)
    redis = open_redis(settings.redis_url, REDIS_TIMEOUT_S, REDIS_CONNECT_TIMEOUT_S)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await body(settings, nc, redis, stop, tel)
    finally:
        await nc.flush(timeout=2)
        await nc.close()  # not drain(): a pull subscription can hold drain() for its full timeout
        await redis.aclose()


def run_service(name: str, load_settings: Callable[[], S], client_name: Callable[[S], str],
                body: Body) -> int:
    try:
        tel = telemetry.setup(name)  # logs, traces, metrics from OTEL_* and SLINFER_LOG_FORMAT
        settings = load_settings()
    except ValueError as exc:
        print(f"slinfer {name}: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(settings, client_name(settings), body, tel))
    finally:
        tel.shutdown()
    return 0

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


Body = Callable[[S, NATS, Redis, asyncio.Event, telemetry.Telemetry], Awaitable[None]]


async def _serve(settings, client_name: str, body: Body, tel: telemetry.Telemetry) -> None:
    nc = await connect_nats(settings.nats_url, client_name)
    redis = open_redis(settings.redis_url)
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

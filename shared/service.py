"""The common shape of a NATS + Redis service process: read settings once, connect, run until
SIGINT/SIGTERM, close. Used by `slinfer placer` and `slinfer node`."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from shared.bus import connect

S = TypeVar("S")


async def _serve(settings, client_name: str,
                 body: Callable[[S, NATS, Redis, asyncio.Event], Awaitable[None]]) -> None:
    nc = await connect(settings.nats_url, client_name)
    redis = Redis.from_url(settings.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await body(settings, nc, redis, stop)
    finally:
        await nc.flush(timeout=2)
        await nc.close()  # not drain(): a pull subscription can hold drain() for its full timeout
        await redis.aclose()


def run_service(name: str, load_settings: Callable[[], S], client_name: Callable[[S], str],
                body: Callable[[S, NATS, Redis, asyncio.Event], Awaitable[None]]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = load_settings()
    except ValueError as exc:
        print(f"slinfer {name}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(settings, client_name(settings), body))
    return 0

"""`slinfer placer`: consume the request stream and place requests on nodes."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from redis.asyncio import Redis

from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared.bus import connect


async def serve(settings: PlacerSettings) -> None:
    nc = await connect(settings.nats_url, settings.name)
    redis = Redis.from_url(settings.redis_url)
    placer = Placer(settings, nc, redis)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await placer.start()
    logging.getLogger("slinfer.placer").info("placer ready")
    await placer.run(stop)
    await nc.flush(timeout=2)
    await nc.close()
    await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = PlacerSettings.from_env()
    except ValueError as exc:
        print(f"slinfer placer: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())

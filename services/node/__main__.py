"""`slinfer node`: one node worker (a CPU socket or a GPU)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from redis.asyncio import Redis

from services.node.settings import NodeSettings
from services.node.worker import NodeWorker
from shared.bus import connect


async def serve(settings: NodeSettings) -> None:
    nc = await connect(settings.nats_url, f"node-{settings.node_id}")
    redis = Redis.from_url(settings.redis_url)
    worker = NodeWorker(settings, nc, redis)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    await stop.wait()
    await worker.stop()
    await nc.flush(timeout=2)
    await nc.close()
    await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = NodeSettings.from_env()
    except ValueError as exc:
        print(f"slinfer node: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())

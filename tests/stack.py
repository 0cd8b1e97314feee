"""Tearing down a stack a test built in its own process (placer loop, node workers, connections)."""

from __future__ import annotations

import asyncio


async def shut_down(stop: asyncio.Event, runner: asyncio.Task | None, workers, nc, redis,
                    placer=None) -> None:
    """Stop the placer's run loop (and its module scaler's moves), every node worker still
    running, then the NATS and Redis connections."""
    stop.set()
    if runner is not None:
        await runner
    if placer is not None:
        await placer.modules.stop()
    for worker in workers:
        if not worker.stopped:
            await worker.stop()
    await nc.close()
    await redis.aclose()

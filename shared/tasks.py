"""Stopping asyncio tasks for sure.

Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives just as its inner
call completes (bpo-42130; 3.12 rewrote `wait_for` on `asyncio.timeout`). nats-py's `fetch` and
`next_msg`, and redis-py's timeouts, run on `wait_for`, so a task cancelled once while it pulls
messages or writes a heartbeat can go on running, and whoever awaits it waits for ever: a
placer's run loop in a test once did, until pytest's timeout. Cancel again until it ends.
"""

from __future__ import annotations

import asyncio
import time


async def cancel_and_wait(*tasks: asyncio.Future, retry_s: float = 0.5,
                          give_up_s: float | None = None) -> set[asyncio.Future]:
    """Cancel `tasks`, again every `retry_s` while any still runs, until all have ended or
    `give_up_s` passed; returns those still running (none unless it gave up). Their results
    and exceptions are consumed: a task stopped here is not reported as never retrieved."""
    deadline = None if give_up_s is None else time.monotonic() + give_up_s
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=retry_s)
        for task in done:
            if not task.cancelled():
                task.exception()
        if deadline is not None and time.monotonic() >= deadline:
            break
    return pending

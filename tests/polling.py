"""Waiting in async tests for an event, not for a guessed time."""

from __future__ import annotations

import asyncio
import inspect
import time


async def until(condition, timeout_s: float = 60.0, what: str = "") -> None:
    """Poll `condition()` until it holds; a generous deadline, not a measurement of this box.
    `condition` may be a plain or an async function."""
    deadline = time.monotonic() + timeout_s
    while not await _holds(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _holds(condition) -> bool:
    result = condition()
    return bool(await result) if inspect.isawaitable(result) else bool(result)

"""`cancel_and_wait` ends a task that swallowed a cancellation (as Python 3.11's wait_for can)."""

from __future__ import annotations

import asyncio

from shared.tasks import cancel_and_wait


async def _swallows_once(state: dict) -> None:
    """A loop whose first cancellation is lost, as one inside a racing wait_for would be."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
            asyncio.current_task().uncancel()
        state["turns"] = state.get("turns", 0) + 1


async def test_one_cancel_is_not_enough_for_a_task_that_swallows_it() -> None:
    task = asyncio.create_task(_swallows_once({}))
    await asyncio.sleep(0.02)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done  # what a single cancel-then-await would have hung on
    assert not await cancel_and_wait(task, retry_s=0.05)
    assert task.cancelled()


async def test_tasks_that_end_are_consumed_whatever_they_ended_with() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def sleeps() -> None:
        await asyncio.sleep(60)

    failing, sleeping = asyncio.create_task(fails()), asyncio.create_task(sleeps())
    await asyncio.sleep(0)
    assert not await cancel_and_wait(failing, sleeping)
    assert sleeping.cancelled() and isinstance(failing.exception(), ValueError)


async def test_it_gives_up_on_a_task_that_will_not_end() -> None:
    stubborn = True

    async def holds_on() -> None:
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                if not stubborn:
                    raise
                asyncio.current_task().uncancel()

    task = asyncio.create_task(holds_on())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, retry_s=0.05, give_up_s=0.2) == {task}
    stubborn = False
    assert not await cancel_and_wait(task)

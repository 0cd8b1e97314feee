"""`Periodic`: the rhythm of the placer's plug-ins (pinning, module scaling, pre-loading)."""

from __future__ import annotations

import logging
import time

from services.placer.periodic import Periodic

log = logging.getLogger("test.periodic")


class Work:
    def __init__(self) -> None:
        self.runs = 0
        self.fail = False

    async def __call__(self) -> None:
        self.runs += 1
        if self.fail:
            raise RuntimeError("boom")


async def test_the_first_turn_runs_however_long_the_box_has_been_up() -> None:
    """The monotonic clock counts from boot: an interval longer than the uptime must not hold
    the first run back (it did, with "never" kept as 0.0: make test on a box up for 42 minutes
    failed the hour-long interval's tests below)."""
    work = Work()
    await Periodic(work, time.monotonic() + 3600.0, log, "failed (%r)").turn()
    assert work.runs == 1


async def test_it_runs_at_most_once_per_interval() -> None:
    work = Work()
    p = Periodic(work, 3600.0, log, "failed (%r)")
    await p.turn()
    await p.turn()
    assert work.runs == 1
    p.last -= 3600.0  # the interval has passed
    await p.turn()
    assert work.runs == 2


async def test_disabled_or_without_an_interval_it_never_runs() -> None:
    work = Work()
    for p in (Periodic(work, 1.0, log, "failed (%r)", enabled=False), Periodic(work, 0.0, log, "x")):
        await p.turn()
    assert work.runs == 0


async def test_a_failure_is_logged_once_per_streak_and_never_raised(caplog) -> None:
    work = Work()
    work.fail = True
    p = Periodic(work, 3600.0, log, "plug-in failed (%r)")
    with caplog.at_level(logging.WARNING, logger="test.periodic"):
        for _ in range(3):
            await p.turn()
            p.last -= 3600.0
        work.fail = False
        await p.turn()
        p.last -= 3600.0
        work.fail = True
        await p.turn()
    assert work.runs == 5
    assert [r.getMessage() for r in caplog.records] == ["plug-in failed (RuntimeError('boom'))"] * 2

"""The placer's periodic plug-ins (pinning, module scaling, cluster pre-loading) share one rhythm:
each placer turn asks them to run, they run at most every `interval_s`, and their failure is
logged (once per run of failures) and never becomes the turn's: placement must go on."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable


class Periodic:
    """`await periodic.turn()` runs `work` if it is enabled and `interval_s` passed since it last
    ran. `failed` is the warning logged when a run fails after one that did not (`%r` gets the
    exception); later failures in a row stay quiet until a run succeeds."""

    def __init__(self, work: Callable[[], Awaitable[None]], interval_s: float,
                 log: logging.Logger, failed: str, enabled: bool = True) -> None:
        self.work = work
        self.interval_s = interval_s
        self.enabled = enabled and interval_s > 0
        self.log = log
        self.failed = failed
        # time.monotonic() of the last run; never yet: -inf, not 0.0, since the monotonic
        # clock counts from boot and a box up for less than `interval_s` would wait it out
        self.last = -math.inf
        self.failing = False

    async def turn(self) -> None:
        if not self.enabled or time.monotonic() - self.last < self.interval_s:
            return
        self.last = time.monotonic()
        try:
            await self.work()
        except Exception as exc:  # a plug-in's failure is never the placer's
            if not self.failing:
                self.log.warning(self.failed, exc)
            self.failing = True
        else:
            self.failing = False

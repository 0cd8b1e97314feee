"""A measured busy fraction: the share of recent wall time something spent working (an
instance's iterations on its node, a hosted layer stage's forwards on its host).

`BusyMeter` is an exponentially weighted average of the busy indicator (1 while working, 0 while
idle) with time constant `window_s`: work `window_s` ago weighs 1/e of work now, so a stage that
stops being used reads ~0 a few windows later. It averages only the time it has observed since
`since` (the weights are normalised by the observed part), so a fresh meter reads what it saw,
not a ramp from 0. Updates are O(1) and exact for any mix of intervals:

    m = BusyMeter.start(window_s=10.0, now=t0)
    m = m.observe(start, end)            # busy all of [start, end); idle since the last one
    m = m.observe(start, end, busy_s=x)  # busy x seconds of it (a sampled counter's delta)
    m.fraction(now)                      # in [0, 1]; idle from the last observation to now
    m.observed_s(now)                    # how long it has been measuring

Pure (time passed in, immutable: an update returns a new meter), so a scheduler's view can carry
it and a planner can read it at its own `now`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class BusyMeter:
    window_s: float  # the decay's time constant
    since: float  # when it started measuring
    at: float  # observed up to here
    busy: float = 0.0  # the decayed weight of the busy time observed
    seen: float = 0.0  # the decayed weight of all the time observed

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError("window_s must be > 0")

    @staticmethod
    def start(window_s: float, now: float) -> BusyMeter:
        return BusyMeter(window_s, now, now)

    def _advance(self, until: float, share: float) -> BusyMeter:
        """Observe [at, until) as busy for `share` of it."""
        if until <= self.at:
            return self
        keep = math.exp(-(until - self.at) / self.window_s)
        return replace(self, at=until, busy=self.busy * keep + share * (1 - keep),
                       seen=self.seen * keep + (1 - keep))

    def observe(self, start: float, end: float, busy_s: float | None = None) -> BusyMeter:
        """Busy for `busy_s` (None: all) of [start, end), idle from the last observation to
        `start`. The part before the last observation is already counted: clipped (its busy
        time in proportion)."""
        if end <= start:
            return self
        busy_s = end - start if busy_s is None else min(max(busy_s, 0.0), end - start)
        clipped = max(start, self.at)
        if end <= clipped:
            return self
        share = busy_s / (end - start)
        return self._advance(clipped, 0.0)._advance(end, share)

    def fraction(self, now: float) -> float:
        """The busy share of the observed time, recent time weighing most (idle up to `now`;
        work observed ahead of `now` counts as done)."""
        m = self._advance(now, 0.0)
        return min(1.0, m.busy / m.seen) if m.seen > 0 else 0.0

    def observed_s(self, now: float) -> float:
        return max(now, self.at) - self.since

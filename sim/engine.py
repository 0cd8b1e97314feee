"""The discrete-event loop: a virtual clock and a heap of timestamped events.

Nothing here knows about LLMs. Events with equal times fire in the order they were scheduled
(a sequence number breaks ties), so a run is a pure function of its inputs. Systems
(`sim.baselines`, `sim.slinfer_system`) schedule their own events (iteration completions,
memory-op completions, keep-alive checks, queue deadlines) and receive them back through
`System.handle`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.core.types import SLO, Hardware, first_token_due, token_deadline


# Usage (nodes used, KV bytes) is sampled just before handling the first event at least this
# long after the last sample; that state held since the previous event, and it is credited back
# to the last sample. Exact when events are sparse, within 50 ms when they are dense, and it
# keeps a run from paying O(cluster) on every event.
USAGE_SAMPLE_S = 0.05


class IterationNoise:
    """How far a real iteration strays from its profile: actual = predicted x exp(sigma * z),
    z standard normal (log-normal, median 1). Every system draws from its own seeded stream, so
    a plan that counted on the prediction shows its misses, and SLINFER's 10% margin is used."""

    def __init__(self, sigma: float, seed: int) -> None:
        if sigma < 0:
            raise ValueError("noise sigma must be >= 0")
        self.sigma = sigma
        self._rng = random.Random(seed)

    def __call__(self) -> float:
        return math.exp(self.sigma * self._rng.gauss(0.0, 1.0)) if self.sigma else 1.0


@dataclass(order=True, frozen=True)
class Event:
    time: float  # virtual seconds
    seq: int  # scheduling order; breaks ties so equal-time events are FIFO
    kind: str = field(compare=False)  # handler key, e.g. "arrival", "iter_done"
    data: Any = field(compare=False, default=None)


class EventLoop:
    """A virtual clock. `now` only moves forward, to the time of the event being handled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[Event] = []
        self._seq = 0

    def schedule(self, time: float, kind: str, data: Any = None) -> Event:
        if time < self.now:
            raise ValueError(f"cannot schedule {kind} at {time} before now={self.now}")
        ev = Event(time, self._seq, kind, data)
        self._seq += 1
        heapq.heappush(self._heap, ev)
        return ev

    def after(self, delay: float, kind: str, data: Any = None) -> Event:
        return self.schedule(self.now + max(0.0, delay), kind, data)

    def pop(self) -> Event | None:
        if not self._heap:
            return None
        ev = heapq.heappop(self._heap)
        self.now = ev.time
        return ev

    def peek_time(self) -> float | None:
        return self._heap[0].time if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class SimRequest:
    """One request's life in the simulator (ground truth the systems never peek at is
    `output_len`: a system sees a request finish only when its last token is produced)."""

    rid: str
    model: str
    input_len: int
    output_len: int
    arrival: float
    slo: SLO
    grace_s: float = 0.0  # TTFT grace for a cold start (§IX-A)
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    dropped: bool = False
    hardware: Hardware | None = None  # where its first token was produced
    evictions: int = 0  # times its KV was thrown away and it had to be recomputed
    late_tokens: int = 0  # tokens that came after their Eq. 1 deadline

    def token(self, now: float) -> None:
        """One more output token, produced at `now`: token k is due at ST + grace + TTFT_SLO +
        TPOT_SLO * k (Eq. 1; SLINFER §VI-B: a negative headroom is an SLO violation)."""
        base = first_token_due(self.arrival, self.grace_s, self.slo.ttft_s)
        if now > token_deadline(base, self.slo.tpot_s, self.generated) + 1e-9:
            self.late_tokens += 1
        self.generated += 1

    @property
    def done(self) -> bool:
        return self.finished_at is not None or self.dropped

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finished_at is None or self.first_token_at is None:
            return None
        if self.output_len <= 1:
            return 0.0
        return (self.finished_at - self.first_token_at) / (self.output_len - 1)

    @property
    def slo_met(self) -> bool:
        """Served, and every token by its Eq. 1 deadline (the paper's definition: the first by
        the TTFT SLO plus any cold-start grace, token k by TPOT_SLO * k after that)."""
        return self.finished_at is not None and not self.dropped and self.late_tokens == 0

    @property
    def slo_met_mean_tpot(self) -> bool:
        """The stricter reading: TTFT within SLO (+ grace) and the mean TPOT after the first
        token within the TPOT SLO (an early first token buys no slack)."""
        if self.finished_at is None or self.dropped:
            return False
        ttft, tpot = self.ttft, self.tpot
        assert ttft is not None and tpot is not None
        return ttft <= self.slo.ttft_s + self.grace_s + 1e-9 and tpot <= self.slo.tpot_s + 1e-9


@dataclass(frozen=True)
class Usage:
    """What the cluster holds at one instant (piecewise constant between events)."""

    cpu_nodes_used: int  # nodes hosting at least one instance (loading, serving or kept alive)
    gpu_nodes_used: int
    kv_alloc_bytes: int  # KV-cache bytes allocated to instances
    kv_used_bytes: int  # KV-cache bytes holding tokens of running requests


class Recorder(Protocol):
    """Where systems report what happened (implemented by `sim.metrics.Metrics`)."""

    done: int  # requests finished or dropped so far

    def iteration(self, now: float, hw: Hardware, prefill: bool, batch: int, seconds: float) -> None: ...
    def request_done(self, req: SimRequest) -> None: ...  # exactly once per request
    def count(self, name: str, n: int = 1) -> None: ...
    def observe(self, now: float, usage: Usage) -> None: ...
    def add_instance_lifetime(self, seconds: float) -> None: ...
    def add_scaling(self, seconds: float) -> None: ...  # seconds an instance spent resizing KV


class System(Protocol):
    """A serving system under simulation (slinfer or a baseline)."""

    name: str

    def bind(self, loop: EventLoop, rec: Recorder) -> None: ...
    def on_arrival(self, req: SimRequest) -> None: ...
    def handle(self, ev: Event) -> None: ...
    def usage(self) -> Usage: ...
    def shutdown(self) -> None: ...  # the run is over; release what is held


@dataclass
class RunResult:
    requests: list[SimRequest]
    end_time: float  # virtual time of the last handled event
    events: int  # events handled


def run(system: System, requests: list[SimRequest], rec: Recorder, horizon: float,
        on_progress: Callable[[float], None] | None = None) -> RunResult:
    """Feed `requests` (sorted by arrival) to the system and run until every one is finished or
    dropped, or the clock would pass `horizon` (the drain limit); leftovers count as dropped."""
    loop = EventLoop()
    system.bind(loop, rec)
    if requests:  # one arrival in the heap at a time keeps the heap small
        loop.schedule(requests[0].arrival, "arrival", 0)
    rec.observe(0.0, system.usage())
    next_sample = 0.0
    events = 0
    while rec.done < len(requests):
        t = loop.peek_time()
        if t is None or t > horizon:
            break
        ev = loop.pop()
        assert ev is not None
        events += 1
        if loop.now >= next_sample:  # the state before this event held since the last one
            rec.observe(loop.now, system.usage())
            next_sample = loop.now + USAGE_SAMPLE_S
        if ev.kind == "arrival":
            idx = ev.data
            if idx + 1 < len(requests):
                loop.schedule(requests[idx + 1].arrival, "arrival", idx + 1)
            system.on_arrival(requests[idx])
        else:
            system.handle(ev)
        if on_progress is not None:
            on_progress(loop.now)
    rec.observe(loop.now, system.usage())
    system.shutdown()
    for req in requests:  # still queued or running at the drain limit
        if not req.done:
            req.dropped = True
            rec.request_done(req)
    return RunResult(requests, loop.now, events)

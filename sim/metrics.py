"""What a run measured: per-request outcomes, per-iteration work, and time integrals of the
cluster's usage (piecewise constant between events)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shared.core.types import Hardware
from sim.engine import SimRequest, Usage


@dataclass
class Metrics:
    timeline_step_s: float = 1.0  # resolution of the nodes-used timeline kept for plots
    done: int = 0
    requests: list[SimRequest] = field(default_factory=list)  # finished or dropped, in order
    counters: Counter = field(default_factory=Counter)
    decode_tokens: dict[Hardware, int] = field(default_factory=lambda: {h: 0 for h in Hardware})
    busy_s: dict[Hardware, float] = field(default_factory=lambda: {h: 0.0 for h in Hardware})
    decode_iterations: int = 0
    decode_batch_sum: int = 0
    # time integrals
    node_seconds: dict[Hardware, float] = field(default_factory=lambda: {h: 0.0 for h in Hardware})
    kv_alloc_byte_s: float = 0.0
    kv_used_byte_s: float = 0.0
    scaling_s: float = 0.0  # seconds instances spent in KV resizes
    instance_s: float = 0.0  # seconds of instance lifetime (for scaling_time_fraction)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, cpu, gpu)
    _last_t: float = 0.0
    _last: Usage | None = None

    def iteration(self, now: float, hw: Hardware, prefill: bool, batch: int, seconds: float) -> None:
        del now
        self.busy_s[hw] += seconds
        if prefill:
            self.counters["prefill_iterations"] += 1
            return
        self.decode_iterations += 1
        self.decode_batch_sum += batch
        self.decode_tokens[hw] += batch

    def request_done(self, req: SimRequest) -> None:
        self.done += 1
        self.requests.append(req)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def add_scaling(self, seconds: float) -> None:
        self.scaling_s += seconds

    def add_instance_lifetime(self, seconds: float) -> None:
        self.instance_s += seconds

    def observe(self, now: float, usage: Usage) -> None:
        """`usage` held over (last observation, now]: credit it to that interval."""
        if now > self._last_t:
            dt = now - self._last_t
            u = usage
            self.node_seconds[Hardware.CPU] += u.cpu_nodes_used * dt
            self.node_seconds[Hardware.GPU] += u.gpu_nodes_used * dt
            self.kv_alloc_byte_s += u.kv_alloc_bytes * dt
            self.kv_used_byte_s += u.kv_used_bytes * dt
        if self._last is None or (usage.cpu_nodes_used, usage.gpu_nodes_used) != (
                self._last.cpu_nodes_used, self._last.gpu_nodes_used):
            self._timeline_point(now, usage)
        self._last_t = max(self._last_t, now)
        self._last = usage

    def _timeline_point(self, now: float, usage: Usage) -> None:
        """One point per timeline step (the last change in it) so long runs stay small."""
        point = (now, usage.cpu_nodes_used, usage.gpu_nodes_used)
        step = self.timeline_step_s
        if self.timeline and int(self.timeline[-1][0] / step) == int(now / step):
            self.timeline[-1] = point
        else:
            self.timeline.append(point)

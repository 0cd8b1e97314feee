"""The small port the placer's plug-ins (burst scale-out, module scaler, pre-loader) and its
parts share, instead of the whole placer: the settings, the connections, the model registry,
the profiles as last read, the decision counts, and node commands."""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from services.placer.commands import send_command
from services.placer.settings import PlacerSettings
from shared.cluster import load_perf
from shared.core.perf_model import PerfModel
from shared.registry import ModelRegistry
from shared.schemas import NodeCommand, NodeReply

PERF_REFRESH_S = 2.0


class PlacerPort:
    def __init__(self, settings: PlacerSettings, nc: NATS, redis: Redis) -> None:
        self.s = settings  # may be replaced while running (a benchmark switches the core's knobs)
        self.nc, self.redis = nc, redis
        self.registry = ModelRegistry(redis)
        self.perf = PerfModel()  # the profiles as last read (`refresh_perf`)
        self._perf_at = 0.0
        self.decisions: dict[str, int] = {}  # what was decided -> count (tests, metrics)

    def count(self, decision: str, n: int = 1) -> None:
        self.decisions[decision] = self.decisions.get(decision, 0) + n

    async def refresh_perf(self) -> None:
        """Read the profiles again if the copy is older than PERF_REFRESH_S."""
        if time.monotonic() - self._perf_at > PERF_REFRESH_S:
            perf = await load_perf(self.redis)
            if perf.profiles or not self.perf.profiles:  # an emptied Redis: keep deciding as before
                self.perf = perf
            self._perf_at = time.monotonic()

    def reread_perf(self) -> None:
        """A profile was stored that the copy lacks: the next `refresh_perf` reads them."""
        self._perf_at = 0.0

    async def command(self, node_id: str, cmd: NodeCommand,
                      timeout_s: float | None = None) -> NodeReply | None:
        return await send_command(self.nc, node_id, cmd, timeout_s or self.s.admit_timeout_s)

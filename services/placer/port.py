"""The small port the placer's plug-ins (burst scale-out, module scaler, pre-loader) and its
parts share, instead of the whole placer: the settings, the connections, the model registry,
the profiles as last read, the decision counts, and node commands."""

from __future__ import annotations

import math
import time

from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from services.placer.commands import send_command
from services.placer.settings import PlacerSettings
from shared.cluster import load_perf, member_ids, views_of
from shared.core.perf_model import PerfModel
from shared.core.types import NodeView
from shared.registry import ModelRegistry, records_of
from shared.schemas import ModelRecord, NodeCommand, NodeReply
from shared.subjects import MODELS_HASH, NODES_SET, node_key

PERF_REFRESH_S = 2.0


class PlacerPort:
    def __init__(self, settings: PlacerSettings, nc: NATS, redis: Redis) -> None:
        self.s = settings  # may be replaced while running (a benchmark switches the core's knobs)
        self.nc, self.redis = nc, redis
        self.registry = ModelRegistry(redis)
        self.perf = PerfModel()  # the profiles as last read (`refresh_perf`)
        self._perf_at = -math.inf  # never (monotonic time counts from boot)
        self.decisions: dict[str, int] = {}  # what was decided -> count (tests, metrics)
        self._node_ids: list[str] = []  # the members of the last `read_turn`

    async def read_turn(self) -> tuple[list[NodeView], list[ModelRecord]]:
        """The live nodes' views and the registry's records, as a turn decides on them, in one
        Redis round trip: the snapshots asked for are those of the nodes the last read found
        (a node that joined or left since costs a second trip)."""
        asked = self._node_ids  # as of now: another caller's read may replace it meanwhile
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(NODES_SET)
            pipe.hgetall(MODELS_HASH)
            if asked:
                pipe.mget([node_key(i) for i in asked])
            members, models, *known = await pipe.execute()
        ids, blobs = member_ids(members), (known[0] if known else [])
        if ids != asked:
            blobs = await self.redis.mget([node_key(i) for i in ids]) if ids else []
            self._node_ids = ids
        return await views_of(self.redis, ids, blobs), records_of(models)

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
        self._perf_at = -math.inf  # never (monotonic time counts from boot)

    async def command(self, node_id: str, cmd: NodeCommand,
                      timeout_s: float | None = None) -> NodeReply | None:
        return await send_command(self.nc, node_id, cmd, timeout_s or self.s.admit_timeout_s)

"""Burst scale-out in the placer (λScale §3, §7.5; the decision is `shared.core.burst`'s).

The placer sees every arrival, so it keeps each model's recent ones (`note`). When a placement
starts a new instance of a model (NEW_INSTANCE), the core is asked, before the placed instance is
committed, whether that model's recent demand outgrows what its instances hold (`plan`): the
placed instance is then admitted with the startup the core priced for it in the burst's
multicast (`BurstPlan.placed`), and once its node accepted, the extra instances are started at
once on their nodes (`start`; START_INSTANCE: an instance with no request yet); those that
receive the model by multicast join the placed instance's multicast of this turn after it (one
multicast feeds them all, in the order the core priced them). The requests that follow are
placed on them by the ordinary `place`: each START reply's fresh node view shows the new
instance to the rest of the turn.

Arrivals are counted per placer: with several placers sharing the stream, each sees its share.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.placer.commands import with_startup
from services.placer.port import PlacerPort
from services.placer.scaleout import ScaleOut
from shared.cluster import model_spec, request_view
from shared.core.burst import BurstPlan, plan_burst
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.placement import PlacementPlan
from shared.core.types import AdapterSpec, NodeView
from shared.schemas import CommandKind, InferenceRequest, ModelRecord, NodeCommand

log = logging.getLogger("slinfer.placer.burst")


@dataclass(frozen=True)
class BurstRecord:
    """One burst the placer carried out (tests, logs)."""

    model: str
    request_id: str  # the placement that set it off
    planned: tuple[str, ...]  # the nodes the core chose for the extra instances
    started: tuple[str, ...]  # those that started one (the others refused on fresher state)
    instances: int  # the core's count, the placed request's instance included
    demand: float


class BurstStarter:
    def __init__(self, port: PlacerPort, config: CoreConfig, scaleout: ScaleOut,
                 queued: Callable[[str, str], int]) -> None:
        self.p = port
        self.config = config
        self.scaleout = scaleout  # the instances it starts join this turn's multicasts
        self.queued = queued  # (model, request id) -> the model's other requests in the queue
        self._arrivals: dict[str, deque[float]] = {}  # model -> arrival times within the window
        self.records: deque[BurstRecord] = deque(maxlen=256)  # newest last

    @property
    def enabled(self) -> bool:
        return self.config.burst_scaleout

    def note(self, req: InferenceRequest, now: float) -> None:
        """A new request (not a redelivery, nor a resumed copy): one arrival of its model."""
        if not self.enabled or req.resumed_token_ids:
            return
        seen = self._arrivals.setdefault(req.model, deque())
        seen.append(now)
        self._forget_old(seen, now)

    def _forget_old(self, seen: deque[float], now: float) -> None:
        while seen and seen[0] <= now - self.config.burst_window_s:
            seen.popleft()

    def plan(self, req: InferenceRequest, plan: PlacementPlan, record: ModelRecord,
             ctx: DecisionContext, adapter: AdapterSpec | None = None) -> BurstPlan | None:
        """The burst that goes with `plan` (`place`'s NEW_INSTANCE for `req` on `ctx`, not
        committed yet): the core prices the placed instance at its place in the burst's
        multicast (`BurstPlan.placed`, what the ADMIT carries) and plans the extra instances.
        None when burst scale-out is off."""
        if not self.enabled:
            return None
        seen = self._arrivals.get(req.model, deque())
        self._forget_old(seen, ctx.now)
        queued = self.queued(req.model, req.request_id)
        return plan_burst(plan, request_view(req), model_spec(record), ctx, seen, queued,
                          adapter)

    async def start(self, req: InferenceRequest, record: ModelRecord, burst: BurstPlan,
                    nodes: list[NodeView]) -> list[NodeView]:
        """The node accepted the placed instance: start the burst's extra instances. Returns
        the views with the started instances in them."""
        if not burst.spots:
            return nodes
        return await self._start(req, record, burst, nodes)

    async def _start(self, req: InferenceRequest, record: ModelRecord, burst: BurstPlan,
                     nodes: list[NodeView]) -> list[NodeView]:
        started = []
        for spot in burst.spots:
            cmd = NodeCommand(CommandKind.START_INSTANCE, request=req, model=record)
            if spot.startup is not None:
                cmd = with_startup(cmd, spot.startup)
            reply = await self.p.command(spot.node_id, cmd)
            if reply is not None and reply.accepted:
                started.append(spot.node_id)
                if spot.startup is not None:
                    nodes = self.scaleout.join(record, spot.startup, spot.node_id, nodes)
            else:
                log.info("burst: %s refused an instance of %s: %s", spot.node_id, record.name,
                         reply.reason if reply else "no reply")
            if reply is not None and reply.node is not None:  # fresher: the rest of the turn sees it
                nodes = [reply.node if n.node_id == spot.node_id else n for n in nodes]
        self.p.count("burst_instance", len(started))
        self.records.append(BurstRecord(record.name, req.request_id,
                                        tuple(s.node_id for s in burst.spots), tuple(started),
                                        burst.size.instances, burst.size.demand))
        log.info("burst of %s (demand %.1f, %d per instance): %d more instances on %s",
                 record.name, burst.size.demand, burst.size.per_instance, len(started),
                 ",".join(started) or "none")
        return nodes

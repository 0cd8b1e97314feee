"""Predictive pre-warming on the placer (`CoreConfig.prewarm`; the policy is the core's
`shared.core.prewarm`, Shahrad et al. ATC'20, which the simulator runs too).

The policy learns each model's idle times, from the end of its last call in flight to its next
call. Every call passes through the placer, so it sees each one start (`note`, on arrival); it
does not see one end, which happens on a node. A placed call is taken to have ended once a node
view taken after its placement shows it nowhere (nodes publish their views at every change and
heartbeat), and a call that was never placed (dropped, failed, cancelled) ends when it is
answered (`answered`). Warm-ups (pinning's, the admin's preload) are not calls.

What the policy says is carried out in two ways:
- a model whose next call is predicted soon keeps the instance that served it for the policy's
  window: its requests carry that window as their keep-alive (`with_window`), unless the
  request or the model has its own;
- a model predicted to be called again later gets an instance started shortly before
  (`plan_prewarms`: only on a node whose memory and compute take it beside its serving instances,
  never displacing one), by START_INSTANCE with a stand-in request; the node re-checks it with
  its own core and may refuse. Its idle window is the policy's.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace

from services.placer.periodic import Periodic
from services.placer.port import PlacerPort
from shared.cluster import PREWARM_ID_PREFIX, is_warm_up, model_spec, warm_up_request
from shared.core.prewarm import IdleTracker, PrewarmConfig, PrewarmPlan, plan_prewarms
from shared.core.types import NodeView
from shared.schemas import CommandKind, InferenceRequest, ModelRecord, NodeCommand

log = logging.getLogger("slinfer.placer.prewarm")
STAND_IN_TIMEOUT_S = 30.0  # a pre-warm's stand-in request: a deadline, though nobody waits on it


@dataclass
class _Call:
    model: str
    node_id: str | None = None  # where it was placed (None: queued at the placer)
    placed_at: float = 0.0


class Prewarmer:
    def __init__(self, port: PlacerPort, config: PrewarmConfig, interval_s: float) -> None:
        self.p = port
        self.tracker = IdleTracker(config)
        self.calls: dict[str, _Call] = {}  # request id -> the call in flight
        self.started: list[PrewarmPlan] = []  # pre-warms a node accepted (tests, logs)
        self._periodic = Periodic(self._check, interval_s, log, "pre-warming failed (%r); retrying",
                                  enabled=port.s.core.prewarm)

    @property
    def enabled(self) -> bool:
        return self.p.s.core.prewarm

    # --- what the placer tells it -------------------------------------------------------------
    def note(self, req: InferenceRequest, now: float) -> None:
        """A request arrived: a call of its model starts (a copy of one in flight does not)."""
        if not self.enabled or is_warm_up(req.request_id) or req.request_id in self.calls:
            return
        self.calls[req.request_id] = _Call(req.model)
        self.tracker.started(req.model, now)

    def answered(self, request_id: str, node_id: str | None, now: float) -> None:
        """It left the placer's queue: placed on `node_id` (it ends on that node, `ended_in`),
        or answered without running anywhere (dropped, failed, cancelled: it ends now)."""
        call = self.calls.get(request_id)
        if call is None:
            return
        if node_id is not None:
            call.node_id, call.placed_at = node_id, now
        else:
            del self.calls[request_id]
            self.tracker.ended(call.model, now)

    def with_window(self, req: InferenceRequest, record: ModelRecord) -> InferenceRequest:
        """`req` with the policy's keep-alive for its instance, where the policy keeps the
        instance that serves it (`shared.core.prewarm.keep_alive_spec`'s rule)."""
        if not self.enabled or req.keep_alive_s is not None or record.keep_alive_s is not None:
            return req
        windows = self.tracker.windows(req.model, self.p.s.core.keep_alive_s)
        if not windows.predicted or windows.prewarm_s > 0:
            return req
        return replace(req, keep_alive_s=windows.keep_alive_s)

    # --- every interval -----------------------------------------------------------------------
    async def turn(self) -> None:
        await self._periodic.turn()

    async def _check(self) -> None:
        nodes, listed = await self.p.read_turn()
        now = time.time()
        self.ended_in(nodes, now)
        records = {r.name: r for r in listed if r.base_model is None}
        specs = {name: model_spec(r) for name, r in records.items()}
        await self.p.refresh_perf()
        for plan in plan_prewarms(self.tracker, specs, nodes, self.p.perf, now, self.p.s.core):
            await self._start(plan, records[plan.model], now)

    def ended_in(self, nodes: list[NodeView], now: float) -> None:
        """The placed calls that ended: no view holds them, and the view of the node they were
        placed on was taken after their placement (or that node is gone). A call ended by then:
        the view's time is its end's."""
        running = {r.request_id for n in nodes for i in n.instances for r in i.requests}
        taken = {n.node_id: n.heartbeat for n in nodes}
        for rid, call in list(self.calls.items()):
            if call.node_id is None or rid in running:
                continue
            seen = taken.get(call.node_id, now)
            if seen > call.placed_at:
                del self.calls[rid]
                self.tracker.ended(call.model, min(seen, now))

    async def _start(self, plan: PrewarmPlan, record: ModelRecord, now: float) -> None:
        stand_in = warm_up_request(record, f"{PREWARM_ID_PREFIX}{uuid.uuid4().hex}", now, STAND_IN_TIMEOUT_S)
        cmd = NodeCommand(CommandKind.START_INSTANCE, request=stand_in,
                          model=replace(record, keep_alive_s=plan.keep_alive_s))
        reply = await self.p.command(plan.node_id, cmd)
        if reply is None or not reply.accepted:
            self.p.count("prewarm_refused")
            log.info("pre-warm of %s refused by %s: %s", plan.model, plan.node_id,
                     reply.reason if reply else "no reply")
            return
        self.p.count("prewarm")
        self.started.append(plan)
        log.info("pre-warmed %s on %s (%s), kept %.1f s", plan.model, plan.node_id,
                 reply.instance_id, plan.keep_alive_s)

"""The placer's part of CoCoServe's module scaling: the core decides
(`shared.core.module_scaling.plan_module_scaling`), this carries the plans out with the nodes.

The planner gets what the simulator gives it (sim/cocoserve.py), so both decide alike:
- memory pressure, what placement saw: a request that no node could take (QUEUE or DROP) with
  a memory refusal on some node for a new instance is pressure on the node that lacked the
  least (`memory_deficit`);
- demand: the requests placement would serve only with a new instance or not at all (NEW_INSTANCE,
  QUEUE, DROP), each passed once (CoCoServe replicates a lone instance of the model first);
- overloaded hosts: nodes hosting another instance's layers whose own requests got a token late
  since the last run (their published `late_tokens` count rose).
Every `interval_s` the planner runs on the cluster view with those (and load spikes from the
view itself); each plan runs in its own task:

    shed / replicate:  HOST_LAYERS to the host (it holds the bytes and the stage's share of
                       its compute, builds the stage, answers its address) -> SHED_LAYERS /
                       REPLICATE_LAYERS to the owner.
    drop a replica:    DROP_REPLICA to the owner -> RELEASE_LAYERS to the host.
    take layers back:  TAKE_LAYERS to the owner (it reserves their bytes, parked until they
                       fit, reads them and takes their K/V from the stage) -> RELEASE_LAYERS
                       to the host. Not for `settle_s` after the instance shed (nor on a node
                       with pressure noted: the planner sees it).

A host that refuses leaves the owner untouched. An owner that refuses keeps its layers (its
engine changes nothing it could not keep) and the host is told to release the stage. An owner
that does not answer may have moved them or not: its next published view says (the layout
names the stage), and the stage is released only if it does not. A host a release does not
reach releases the stage itself once no layout uses it (services/node/layer_moves.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from services.placer.periodic import Periodic
from services.placer.port import PlacerPort
from shared.cluster import read_nodes
from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.module_scaling import (MemoryPressure, ModuleAction, ModulePlan, ModuleSettings,
                                        memory_deficit, plan_module_scaling)
from shared.core.perf_model import PerfModel
from shared.core.placement import PlaceAction, PlacementPlan
from shared.core.types import ModelSpec, NodeView, RequestView
from shared.schemas import CommandKind, ModelRecord, NodeCommand, NodeReply

log = logging.getLogger("slinfer.placer.modules")
HOST_TIMEOUT_S = 150.0  # a host's hold may park, then it reads the layers' weights
MOVE_TIMEOUT_S = 60.0  # the owner waits for its iteration, then moves the layers' K/V
PRESSURE_TTL_S = 10.0  # pressure not seen again for this long is forgotten
# After a move that frees memory on a node, pressure noted there is ignored for this long: the
# placer's cluster view (a heartbeat behind) still shows the memory that just left.
RELIEF_COOLDOWN_S = 3.0
VIEW_WAIT_S = 2.0  # an owner that did not answer: its view is read again after this
# Placements that are demand for a model's module scaling (the simulator's `CoCoServe.offer`)
DEMAND = (PlaceAction.NEW_INSTANCE, PlaceAction.QUEUE, PlaceAction.DROP)


@dataclass
class ModuleRecord:
    """One plan carried out (tests, logs): what was decided and what came of it."""

    plan: ModulePlan
    started: float
    ok: bool = False
    outcome: str = ""
    address: str = ""
    seconds: float = 0.0


class ModuleScaler:
    def __init__(self, port: PlacerPort, settings: ModuleSettings, interval_s: float) -> None:
        self.p = port
        self.settings = settings
        self.interval_s = interval_s
        self.pressure: dict[str, tuple[int, float]] = {}  # node -> (deficit, when last seen)
        self.busy: set[str] = set()  # instances with a plan under way
        self.relieved: dict[str, float] = {}  # node -> pressure ignored until then (monotonic)
        self.shed_at: dict[str, float] = {}  # instance -> when its last shed ended (monotonic)
        self.records: deque[ModuleRecord] = deque(maxlen=256)
        self.demand: dict[str, tuple[RequestView, float]] = {}  # request -> (view, when seen)
        self.late_seen: dict[str, int] = {}  # node -> its late_tokens at the last run
        self._tasks: set[asyncio.Task] = set()
        self._periodic = Periodic(self._plan_and_start, interval_s, log,
                                  "module scaling failed (%r); placement goes on", self.enabled)

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 and (self.settings.shed or self.settings.replicate)

    def note(self, plan: PlacementPlan, request: RequestView, model: ModelSpec,
             nodes: list[NodeView]) -> None:
        """A placement that needs a new instance or found no room is demand for the model; one
        that found no room also puts the node that lacked the least memory for a new instance
        under pressure (the request may fit there once layers moved off)."""
        if not self.enabled or plan.action not in DEMAND:
            return
        self.demand[request.request_id] = (request, time.monotonic())
        if plan.action is PlaceAction.NEW_INSTANCE:
            return
        by_id = {n.node_id: n for n in nodes}
        refused = [by_id[a.node_id] for a in plan.attempts if a.reason is AdmitReason.MEMORY
                   and a.instance_id is None and a.node_id in by_id]
        deficits = [(d, n.node_id) for n in refused if (d := memory_deficit(n, model, request)) > 0]
        now = time.monotonic()
        deficits = [d for d in deficits if self.relieved.get(d[1], 0.0) <= now]
        if deficits:
            deficit, node_id = min(deficits)
            self.pressure[node_id] = (deficit, now)

    async def turn(self) -> None:
        """Run the planner on the cluster view if `interval_s` passed since it last ran; start
        its plans (each in its own task; `Periodic`)."""
        await self._periodic.turn()

    async def _plan_and_start(self) -> None:
        nodes = await read_nodes(self.p.redis)
        records = {r.name: r for r in await self.p.registry.list()}
        await self.p.refresh_perf()  # (placement refreshes it only while requests wait)
        plans = self.decide(nodes, self.p.perf, time.time(), self.p.s.core)
        for plan in plans:
            record = records.get(_model_of(nodes, plan))
            if record is None:
                continue
            self.busy.add(plan.instance_id)
            freed = _freed_node(plan)
            if freed is not None:
                self.pressure.pop(freed, None)
                self.relieved[freed] = math.inf  # until the move ended and a view passed
            task = asyncio.create_task(self._carry(plan, record),
                                       name=f"{plan.action.value}-{plan.instance_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def decide(self, nodes: list[NodeView], perf: PerfModel, now: float,
               config: CoreConfig) -> list[ModulePlan]:
        """The planner on this view with what was noted since the last run (module doc); the
        demand noted is passed once."""
        now_m = time.monotonic()
        self.pressure = {n: v for n, v in self.pressure.items() if now_m - v[1] < PRESSURE_TTL_S}
        pressures = [MemoryPressure(n, d) for n, (d, _) in self.pressure.items()]
        demand = [view for view, seen in self.demand.values() if now_m - seen < PRESSURE_TTL_S]
        self.demand = {}
        self.shed_at = {i: t for i, t in self.shed_at.items()
                        if now_m - t < self.settings.settle_s}
        return plan_module_scaling(DecisionContext(nodes, perf, now, config), pressures,
                                   self.settings, frozenset(self.busy), demand=demand,
                                   overloaded=self._overloaded(nodes),
                                   stay=frozenset(self.shed_at))

    def _overloaded(self, nodes: list[NodeView]) -> list[str]:
        """Hosts of another instance's layers whose own requests got a token late since the last
        run (what the simulator reports as a host's violation)."""
        hosts = {r.node_id for n in nodes for i in n.instances if i.layout for r in i.layout.runs}
        out = [n.node_id for n in nodes if n.node_id in hosts
               and n.late_tokens > self.late_seen.get(n.node_id, n.late_tokens)]
        self.late_seen = {n.node_id: n.late_tokens for n in nodes}
        return out

    async def _carry(self, plan: ModulePlan, record: ModelRecord) -> ModuleRecord:
        rec = ModuleRecord(plan, time.time())
        started = time.perf_counter()
        try:
            if plan.action is ModuleAction.DROP_REPLICA:
                await self._drop(plan, rec)
            elif plan.action is ModuleAction.TAKE:
                await self._take(plan, rec)
            else:
                await self._move(plan, record, rec)
                if rec.ok and plan.action is ModuleAction.SHED:
                    self.shed_at[plan.instance_id] = time.monotonic()
        except Exception as exc:  # NATS trouble: the next turn decides again
            log.exception("%s of %s failed", plan.action.value, plan.instance_id)
            rec.outcome = f"error: {exc!r}"
        finally:
            self.busy.discard(plan.instance_id)
            if (freed := _freed_node(plan)) is not None:
                self.relieved[freed] = time.monotonic() + RELIEF_COOLDOWN_S
            rec.seconds = time.perf_counter() - started
            self.records.append(rec)
        log.info("module scaling: %s layers %d:%d of %s (%s -> %s, %s): %s in %.2f s",
                 plan.action.value, plan.start, plan.end, plan.instance_id, plan.owner_node,
                 plan.host_node, plan.why, rec.outcome, rec.seconds)
        return rec

    async def _move(self, plan: ModulePlan, record: ModelRecord, rec: ModuleRecord) -> None:
        host = await self._ask(plan.host_node, NodeCommand(
            CommandKind.HOST_LAYERS, model=record, instance_id=plan.instance_id,
            layer_start=plan.start, layer_end=plan.end, stage_node=plan.owner_node,
            stage_bytes=plan.host_bytes, stage_load=plan.load), HOST_TIMEOUT_S)
        if host is None or not host.accepted or not host.stage_address:
            rec.outcome = f"host refused: {host.reason if host else 'no answer'}"
            return
        rec.address = host.stage_address
        kind = CommandKind.SHED_LAYERS if plan.action is ModuleAction.SHED \
            else CommandKind.REPLICATE_LAYERS
        owner = await self._ask(plan.owner_node, NodeCommand(
            kind, instance_id=plan.instance_id, layer_start=plan.start, layer_end=plan.end,
            stage_address=host.stage_address, stage_node=plan.host_node,
            hop_latency_s=self.settings.hop_latency_s,
            hop_bytes_per_s=self.settings.link_bytes_per_s), MOVE_TIMEOUT_S)
        if owner is None and await self._uses(plan, host.stage_address):
            owner = NodeReply(True, "moved (seen in its view)")
        if owner is not None and owner.accepted:
            rec.ok, rec.outcome = True, owner.reason
            return
        if owner is not None and _in_view(owner, plan, host.stage_address):
            rec.outcome = f"owner refused: {owner.reason}; it uses the stage already"
            return  # another placer's identical plan moved them: the stage is in use
        rec.outcome = f"owner refused: {owner.reason if owner else 'no answer'}; released"
        await self._release(plan)

    async def _drop(self, plan: ModulePlan, rec: ModuleRecord) -> None:
        await self._owner_then_release(plan, rec, CommandKind.DROP_REPLICA, MOVE_TIMEOUT_S,
                                       "dropped")

    async def _take(self, plan: ModulePlan, rec: ModuleRecord) -> None:
        await self._owner_then_release(plan, rec, CommandKind.TAKE_LAYERS, HOST_TIMEOUT_S,
                                       "taken")

    async def _owner_then_release(self, plan: ModulePlan, rec: ModuleRecord, kind: CommandKind,
                                  timeout_s: float, done: str) -> None:
        """The owner stops using the stage (drops the replica, or runs the layers again); then
        the host lets it go. An owner that did not answer may have done it or not: its view
        says (its layout no longer names the stage), and the stage is released only then."""
        owner = await self._ask(plan.owner_node, NodeCommand(
            kind, instance_id=plan.instance_id, layer_start=plan.start, layer_end=plan.end,
            stage_address=plan.address, stage_node=plan.host_node), timeout_s)
        if owner is None and not await self._uses(plan, plan.address):
            owner = NodeReply(True, f"{done} (seen in its view)")
        if owner is None or not (owner.accepted or owner.reason.startswith("not_here")):
            rec.outcome = f"owner refused: {owner.reason if owner else 'no answer'}"
            return
        rec.ok, rec.outcome = True, done
        await self._release(plan)

    async def _release(self, plan: ModulePlan) -> None:
        await self._ask(plan.host_node, NodeCommand(
            CommandKind.RELEASE_LAYERS, instance_id=plan.instance_id, layer_start=plan.start,
            layer_end=plan.end), MOVE_TIMEOUT_S)

    async def _uses(self, plan: ModulePlan, address: str) -> bool:
        """Does the owner's published view show the instance using the stage at `address`?"""
        await asyncio.sleep(VIEW_WAIT_S)
        for node in await read_nodes(self.p.redis):
            inst = node.instance(plan.instance_id) if node.node_id == plan.owner_node else None
            if inst is not None and inst.layout is not None:
                return any(r.address == address for r in inst.layout.runs)
        return False

    async def _ask(self, node_id: str, cmd: NodeCommand, timeout_s: float) -> NodeReply | None:
        return await self.p.command(node_id, cmd, timeout_s=timeout_s)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)


def _freed_node(plan: ModulePlan) -> str | None:
    """The node whose memory the plan frees (a shed frees its owner's, a dropped replica or
    layers taken back their host's); None for a replication."""
    if plan.action is ModuleAction.SHED:
        return plan.owner_node
    if plan.action in (ModuleAction.DROP_REPLICA, ModuleAction.TAKE):
        return plan.host_node
    return None


def _in_view(reply: NodeReply, plan: ModulePlan, address: str) -> bool:
    inst = reply.node.instance(plan.instance_id) if reply.node is not None else None
    return inst is not None and inst.layout is not None and \
        any(r.address == address for r in inst.layout.runs)


def _model_of(nodes: list[NodeView], plan: ModulePlan) -> str:
    for node in nodes:
        if node.node_id == plan.owner_node and (inst := node.instance(plan.instance_id)):
            return inst.model.name
    return ""

"""CoCoServe's layer commands on a node worker: hosting layers of another node's instance, and
moving or replicating an own instance's layers (the placer decides, shared/core/module_scaling.py).

Host side (HOST_LAYERS, RELEASE_LAYERS): the stage's bytes are held in the node's memory
ledger under its stage key (`NodeScheduler.hold`) before it is built: the hold's LOAD op, which
the reservation station starts once the bytes fit, builds the stage (`StageHost.run_op`); the
reply waits for it and carries the stage's address. Its UNLOAD op releases it. Every few beats
the held bytes follow what the stage really holds (its K/V pool mirrors the owner's, which the
owner resizes). A receiver of the model's multicast asked to host a range for another
receiver's instance (λScale Algorithm 2: the command carries that pipeline) serves it from its own
copy, its arriving blocks once they cover the range (`PipelineStarts.host_from_own_copy`), and
holds the range's K/V only while its own instance's bytes count the weights (when that instance
goes first, the hold grows by the range's weights, which the stage's views keep alive). The
hold also carries the stage's share of this node's compute: the planner's prediction (the
command's `stage_load`) until the node has measured the stage for a window (its forwards'
seconds, sampled every beat, `busy.BusyMeter` over the core's `busy_window_s`), the measured
share then (`NodeScheduler.stage_measured`). The node's view reports it and its own
admissions count it until it is released. (Replicas come with no load: they yield to the
node's own work, so they are neither predicted nor measured.)

A stage no instance's layout in the cluster view uses (its owner went away, dropped it, or never
attached it) is released after a grace (`stage_host.ORPHAN_GRACE_S`).

Owner side (SHED_LAYERS, REPLICATE_LAYERS, DROP_REPLICA, TAKE_LAYERS): the engine changes its
layers between two iterations (the token loop's lock), moving the K/V of every request in flight
with them (`stages.Split`), so requests keep streaming; then the core's view of the instance
follows (`NodeScheduler.set_layout`: its share of the bytes, its layout for shadow validation).
An engine that refuses or fails leaves the instance as it was, and the reply says so. Taking
layers back reserves their bytes first (a hold, as a host does), so pessimistic memory never
exceeds capacity while the weights are read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace

from services.node.engines.base import MovesLayers
from services.node.pipeline_mode import PipelineStarts
from services.node.runtime import NodeRuntime
from services.node.stage_host import StageHost, is_stage_key
from shared.cluster import read_nodes
from shared.core.busy import BusyMeter
from shared.core.cost import kv_for_layers, layout_spec
from shared.core.modules import stage_key
from shared.core.types import InstanceLayout, InstanceStatus, LayerRun
from shared.schemas import CommandKind, NodeCommand, NodeReply

log = logging.getLogger("slinfer.node.layers")
LAYER_KINDS = frozenset({CommandKind.HOST_LAYERS, CommandKind.RELEASE_LAYERS,
                         CommandKind.SHED_LAYERS, CommandKind.REPLICATE_LAYERS,
                         CommandKind.TAKE_LAYERS, CommandKind.DROP_REPLICA})
HOLD_TIMEOUT_S = 120.0  # a hold parked (or a stage building) longer than this is given up
TEND_EVERY_S = 2.0  # orphans and byte drift are checked this often
OPS_WAIT_S = 10.0  # a move waits this long for the instance's memory ops to end


class LayerMoves:
    def __init__(self, rt: NodeRuntime, pipelines: PipelineStarts) -> None:
        self.rt, self.pipelines = rt, pipelines
        s = rt.s
        self.host = StageHost(None, bind_host=s.multicast_host,
                              advertise_host=s.multicast_advertise_host, device=s.device)
        self._tended = -math.inf  # never (monotonic time counts from boot)
        self._drift_logged: set[str] = set()
        # Stage key -> (its meter, the forward seconds and the time it was last sampled at), for
        # the stages hosted with a load (moved layers).
        self.meters: dict[str, tuple[BusyMeter, float, float]] = {}
        self._counted: set[str] = set()  # stage keys hosted with a load

    # -- the node's hooks ----------------------------------------------------------------------

    def start(self) -> None:
        self.host.loader = self.rt.loader  # made in NodeWorker.start

    def owns_op(self, key: str) -> bool:
        return is_stage_key(key) or key.endswith(TAKE_MARK)

    def run_op(self, kind: str, key: str) -> None:
        """(Worker thread) A memory op of a stage key; a take's reservation needs no work."""
        if is_stage_key(key):
            self.host.run_op(kind, key)

    async def close(self) -> None:
        await asyncio.to_thread(self.host.close)

    def measure(self, now: float) -> None:
        """(Heartbeat) Sample the forward seconds of the stages hosted with a load; once a
        stage is measured for a window its measured share replaces the planned one."""
        window = self.rt.s.core.busy_window_s
        for key in list(self.meters.keys() | self._counted):
            hosted = self.host.get(key)
            if hosted is None or key not in self._counted:
                self.meters.pop(key, None)
                continue
            spent = hosted.server.stage.forward_s
            if key not in self.meters:  # from when it is built: its idle time counts too
                self.meters[key] = (BusyMeter.start(window, now), spent, now)
                continue
            meter, last_s, last_t = self.meters[key]
            meter = meter.observe(last_t, now, busy_s=spent - last_s)
            self.meters[key] = (meter, spent, now)
            if meter.observed_s(now) >= meter.window_s:
                self.rt.sched.stage_measured(key, meter.fraction(now))

    def measured(self, key: str, now: float) -> float | None:
        """The stage's measured share of this node's compute so far (None: not measured)."""
        entry = self.meters.get(key)
        return entry[0].fraction(now) if entry is not None else None

    async def tend(self) -> None:
        """(Heartbeat) Measure the stages' loads; release orphans; make the held bytes follow
        the stages' real bytes."""
        self.measure(time.time())
        if not self.host.hosted or time.monotonic() - self._tended < TEND_EVERY_S:
            return
        self._tended = time.monotonic()
        nodes = await read_nodes(self.rt.redis)
        me = self.rt.s.node_id
        in_use = {r.address for n in nodes for i in n.instances if i.layout is not None
                  for r in i.layout.runs if r.node_id == me}
        # λScale's execution pipelines (ewl's pipeline mode) use stages hosted here too.
        in_use |= {a for n in nodes for i in n.instances
                   if i.pipeline is not None and me in i.pipeline.helpers
                   for a in i.pipeline.stages}
        for key in self.host.orphans(in_use, time.time()):
            log.info("releasing %s: no instance uses it", key)
            self._hold(key, 0)
        ledger = self.rt.sched.ledger
        copies = self._own_copies()
        for key, hosted in list(self.host.hosted.items()):
            counted = hosted.order.own_copy and hosted.order.model_path in copies
            actual = await asyncio.to_thread(hosted.bytes, counted)
            held = ledger.target(key)
            # (Not below the reservation before its owner attached it: its pool comes then.)
            if actual == held or ledger.busy(key) or \
                    (actual < held and hosted.address not in in_use):
                continue
            if not self._hold(key, actual) and key not in self._drift_logged:
                self._drift_logged.add(key)
                log.warning("stage %s holds %d bytes, its hold %d: the budget has no room for "
                            "the difference", key, actual, ledger.target(key))

    def _own_copies(self) -> set[str]:
        """The models whose weights an instance on this node counts in the ledger (a stage on
        the node's own copy of one of them holds its K/V only)."""
        return {self.rt.records[i.instance_id].path for i in self.rt.sched.node.instances
                if i.instance_id in self.rt.records}

    # -- answering (services/node/intake.py calls this from its own task) ----------------------

    async def handle(self, cmd: NodeCommand) -> NodeReply:
        if cmd.instance_id is None or cmd.layer_start < 0 or \
                (cmd.kind is not CommandKind.DROP_REPLICA and cmd.layer_end <= cmd.layer_start):
            return NodeReply(False, "bad_command: an instance and a layer range are needed")
        handlers = {CommandKind.HOST_LAYERS: self._host, CommandKind.RELEASE_LAYERS: self._release,
                    CommandKind.SHED_LAYERS: self._move, CommandKind.REPLICATE_LAYERS: self._move,
                    CommandKind.DROP_REPLICA: self._drop, CommandKind.TAKE_LAYERS: self._take}
        return await handlers[cmd.kind](cmd)

    # -- host side -----------------------------------------------------------------------------

    async def _host(self, cmd: NodeCommand) -> NodeReply:
        record = cmd.model
        if record is None or cmd.stage_node is None or cmd.stage_bytes <= 0:
            return NodeReply(False, "bad_command: host_layers needs the model, owner and bytes")
        if self.rt.draining:
            return NodeReply(False, "draining")
        if record.layers and cmd.layer_end > record.layers:
            return NodeReply(False, f"bad_command: {record.name} has {record.layers} layers")
        key = stage_key(cmd.instance_id, cmd.layer_start, cmd.layer_end)
        hosted = self.host.get(key)
        if hosted is not None:  # a repeated command: the stage it built
            return NodeReply(True, "hosting", cmd.instance_id, stage_address=hosted.address,
                             stage_bytes=self.rt.sched.ledger.target(key))
        if self.host.owns(key):
            return NodeReply(False, "busy: being built")
        tensors, own_copy = None, cmd.pipeline is not None and bool(cmd.pipeline.ranges)
        if own_copy:  # a receiver hosting from its own copy (services/node/pipeline_mode.py)
            tensors, why = await self.pipelines.host_from_own_copy(cmd)
            if why is not None:
                return NodeReply(False, why, cmd.instance_id)
        self.host.expect(key, record.path, cmd.layer_start, cmd.layer_end, cmd.instance_id,
                         cmd.stage_node, tensors, own_copy)
        if not self._hold(key, cmd.stage_bytes, cmd.stage_load):
            self.host.release(key)
            return NodeReply(False, "memory", cmd.instance_id)
        settled = await self._settled(key)
        hosted = self.host.get(key)
        if not settled or hosted is None:
            self._hold(key, 0)  # cancels a parked hold, or frees a stage that failed
            self.host.release(key)
            return NodeReply(False, "memory_parked" if not settled else "stage_failed",
                             cmd.instance_id)
        return NodeReply(True, "hosting", cmd.instance_id, stage_address=hosted.address,
                         stage_bytes=cmd.stage_bytes)

    async def _release(self, cmd: NodeCommand) -> NodeReply:
        key = stage_key(cmd.instance_id, cmd.layer_start, cmd.layer_end)
        if not self.host.owns(key) and not self.rt.sched.ledger.target(key):
            return NodeReply(True, "not_here", cmd.instance_id)
        self._hold(key, 0)
        return NodeReply(True, "released", cmd.instance_id)

    def _hold(self, key: str, nbytes: int, load: float | None = None) -> bool:
        """Hold `nbytes` under `key` (0: release); `load`: the stage's predicted share of this
        node's compute, in its view until released or measured (None: as held so far)."""
        if not nbytes:
            self._counted.discard(key)
        elif load:
            self._counted.add(key)
        ok, ops = self.rt.sched.hold(key, nbytes, time.time(), load)
        self.rt.start_ops(ops)
        self.rt.wake.set()
        return ok

    async def _settled(self, key: str) -> bool:
        """Until the hold's op completed (through the reservation-station stream); False when
        it was still parked or running after HOLD_TIMEOUT_S."""
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while self.rt.sched.ledger.busy(key):
            if time.monotonic() > deadline or self.rt.stopping:
                return False
            await asyncio.sleep(0.01)
        return True

    # -- owner side ----------------------------------------------------------------------------

    async def _instance(self, cmd: NodeCommand):
        """(instance view, engine) of a ready instance (its memory ops done: waited for a
        while), or the refusal."""
        iid = cmd.instance_id
        deadline = time.monotonic() + OPS_WAIT_S
        while self.rt.sched.ledger.busy(iid) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        inst = self.rt.sched.node.instance(iid)
        if inst is None:
            return NodeReply(False, "instance_gone", iid)
        if inst.status is not InstanceStatus.READY or not self.rt.loaded(iid) or \
                self.rt.sched.ledger.busy(iid):
            return NodeReply(False, "busy: not ready", iid)
        engine = self.rt.engines[iid]
        if not isinstance(engine, MovesLayers):
            return NodeReply(False, f"engine: the {engine.name} engine keeps its layers", iid)
        full = inst.layout.model if inst.layout is not None else inst.model
        if full.layers <= 1:
            return NodeReply(False, f"bad_command: {full.name}'s layers are not known", iid)
        return inst, engine

    def _layout(self, inst, cmd: NodeCommand) -> InstanceLayout:
        full = inst.layout.model if inst.layout is not None else inst.model
        return inst.layout or InstanceLayout(full, (), cmd.hop_latency_s,
                                             cmd.hop_bytes_per_s or 1e9)

    async def _move(self, cmd: NodeCommand) -> NodeReply:
        found = await self._instance(cmd)
        if isinstance(found, NodeReply):
            return found
        inst, engine = found
        if not cmd.stage_address or not cmd.stage_node:
            return NodeReply(False, "bad_command: the stage's address and node are needed")
        replica = cmd.kind is CommandKind.REPLICATE_LAYERS
        layout = self._layout(inst, cmd)
        layout = replace(layout, runs=(*layout.runs, LayerRun(
            cmd.layer_start, cmd.layer_end, cmd.stage_node, cmd.stage_address, replica)))
        if not 0 < layout.local_layers():
            return NodeReply(False, "bad_command: an instance keeps a layer here", inst.instance_id)
        action = engine.replicate_layers if replica else engine.shed_layers
        started = time.perf_counter()
        failed = await self.rt.changing(inst.instance_id, action, cmd.stage_address)
        if failed is not None:
            log.warning("%s of %s to %s failed: %r", cmd.kind.value, inst.instance_id,
                        cmd.stage_address, failed)
            return NodeReply(False, f"engine: {failed}", inst.instance_id)
        ok, ops = self.rt.sched.set_layout(inst.instance_id, layout, time.time())
        self.rt.start_ops(ops)
        log.info("%s: layers %d:%d of %s %s %s on %s in %.3f s", cmd.kind.value, cmd.layer_start,
                 cmd.layer_end, inst.instance_id, "replicated at" if replica else "moved to",
                 cmd.stage_address, cmd.stage_node, time.perf_counter() - started)
        return NodeReply(ok, "replicated" if replica else "shed", inst.instance_id)

    async def _drop(self, cmd: NodeCommand) -> NodeReply:
        found = await self._instance(cmd)
        if isinstance(found, NodeReply):
            return found
        inst, engine = found
        layout = inst.layout
        run = next((r for r in (layout.runs if layout else ()) if r.replica
                    and r.address == cmd.stage_address), None)
        if run is None:
            return NodeReply(False, "not_here: no such replica", inst.instance_id)
        failed = await self.rt.changing(inst.instance_id, engine.drop_replica, run.address)
        if failed is not None:
            return NodeReply(False, f"engine: {failed}", inst.instance_id)
        ok, ops = self.rt.sched.set_layout(
            inst.instance_id, replace(layout, runs=tuple(r for r in layout.runs if r != run)),
            time.time())
        self.rt.start_ops(ops)
        return NodeReply(ok, "dropped", inst.instance_id)

    async def _take(self, cmd: NodeCommand) -> NodeReply:
        """Layers [start, end) come home: their bytes are reserved first (a hold parked until
        they fit), then the engine reads them and takes their K/V from the stage, then the hold
        becomes the instance's own bytes."""
        found = await self._instance(cmd)
        if isinstance(found, NodeReply):
            return found
        inst, engine = found
        layout = inst.layout
        run = next((r for r in (layout.runs if layout else ()) if not r.replica
                    and (r.start, r.end) == (cmd.layer_start, cmd.layer_end)), None)
        if run is None:
            return NodeReply(False, "not_here: those layers do not run elsewhere", inst.instance_id)
        after = replace(layout, runs=tuple(r for r in layout.runs if r != run))
        spec = layout_spec(after) if after.runs else layout.model
        kv = kv_for_layers(inst.kv_bytes, layout.local_layers(), after.local_layers())
        need = spec.weight_bytes + kv - self.rt.sched.ledger.target(inst.instance_id)
        key = f"{inst.instance_id}{TAKE_MARK}"
        if not self._hold(key, need):
            return NodeReply(False, "memory", inst.instance_id)
        try:
            if not await self._settled(key):
                return NodeReply(False, "memory_parked", inst.instance_id)
            failed = await self.rt.changing(inst.instance_id, engine.take_layers, run.start,
                                          run.end)
            if failed is not None:
                return NodeReply(False, f"engine: {failed}", inst.instance_id)
            self._hold(key, 0)  # the reservation becomes the instance's own bytes
            ok, ops = self.rt.sched.set_layout(inst.instance_id, after, time.time())
            self.rt.start_ops(ops)
        finally:
            self._hold(key, 0)
        return NodeReply(ok, "taken", inst.instance_id)



TAKE_MARK = "/take"

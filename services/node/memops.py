"""Memory-op execution: the core's LOAD, SCALE and UNLOAD ops run here, each in a worker thread,
by what they act on (an instance's engine, a LoRA adapter, a hosted stage's bytes), and report
completion through the JetStream reservation-station stream; its consumer (`on_done`) feeds them
back to the core, which releases parked scale-ups. A completion that cannot be published is
applied here directly. Engines are made by an injectable factory (`create_engine` by default).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from nats.aio.msg import Msg

from services.node.adapters import Adapters
from services.node.book import RequestBook
from services.node.engines import create_engine
from services.node.engines.base import Engine, load_info
from services.node.layer_moves import LayerMoves
from services.node.lifecycle import RequestLifecycle
from services.node.load_failure import LoadFailures
from services.node.load_record import LoadRecord
from services.node.pipeline_mode import PipelineStarts
from services.node.runtime import NodeRuntime
from shared import wire
from shared.core.memory import MemOp, MemOpKind
from shared.core.node_scheduler import AdmitResult
from shared.core.readiness import load_seconds
from shared.cluster import model_spec
from shared.core.types import adapter_owner
from shared.schemas import MemOpCompletion, ModelRecord, NodeCommand, NodeReply

log = logging.getLogger("slinfer.node")
HISTORY_LEN = 4096
# A load waiting for its model to arrive by multicast gives up (and reads its tiers) after
# this many times the expected arrival, and never sooner than ARRIVAL_MIN_WAIT_S.
ARRIVAL_PATIENCE = 3.0
ARRIVAL_MIN_WAIT_S = 30.0

EngineFactory = Callable[..., Engine]  # create_engine's signature


class MemOps:
    def __init__(self, rt: NodeRuntime, book: RequestBook, requests: RequestLifecycle,
                 adapters: Adapters, layers: LayerMoves, pipelines: PipelineStarts,
                 failures: LoadFailures, engine_factory: EngineFactory | None = None) -> None:
        self.rt, self.book, self.requests, self.failures = rt, book, requests, failures
        self.adapters, self.layers, self.pipelines = adapters, layers, pipelines
        self.engine_factory = engine_factory  # None: `create_engine`, looked up at each load
        self.ops: dict[int, MemOp] = {}
        self.loads: deque[LoadRecord] = deque(maxlen=HISTORY_LEN)
        self._loading: dict[str, LoadRecord] = {}  # instance id -> its load, until it ends
        self._born = time.time()  # completions from an earlier life of this node id are ignored
        rt.bind_memops(self.launch)

    # --- executing ------------------------------------------------------------------------------
    def launch(self, op: MemOp) -> None:
        self.ops[op.op_id] = op
        asyncio.create_task(self._execute(op), name=f"memop-{op.op_id}")

    async def _execute(self, op: MemOp) -> None:
        await self.rt.unmoved(op.instance_id)  # not while its layers move (CoCoServe)
        started = time.time()
        error = None
        try:
            await asyncio.to_thread(self.run, op)
        except Exception as exc:
            log.exception("memory op %s failed", op)
            error = str(exc)
        done = MemOpCompletion(self.rt.s.node_id, op.op_id, op.instance_id, op.kind,
                               op.bytes_before, op.bytes_after, started, time.time(),
                               parked_s=started - op.issued_at, ok=error is None, error=error)
        self.rt.obs.memop_done(op, done)
        try:
            await self.rt.outbox.memop_done(done)
        except Exception as exc:
            # NATS is down: the reservation station must not wait forever for this completion
            # (the instance would stay LOADING). Apply it here; the stream misses this one record.
            log.warning("memory-op completion %s not published (%r): applied locally",
                        op.op_id, exc)
            await self.done(done)

    def run(self, op: MemOp) -> None:
        """(Worker thread) Carry out one memory op, by what it acts on and its kind. A load
        that fails on the model's broken files raises `FilesBroken` (load_failure.py)."""
        try:
            self._run(op)
        except Exception as exc:
            record = self._loaded_record(op) if op.kind is MemOpKind.LOAD else None
            broken = self.failures.problem(record) if record is not None else None
            if broken is None:
                raise
            raise broken from exc

    def _loaded_record(self, op: MemOp) -> ModelRecord | None:
        """The model (or LoRA adapter) whose files a LOAD op reads; None: a hosted stage's."""
        if (owner := adapter_owner(op.instance_id)) is not None:
            return self.adapters.records.get(owner[1])
        if self.layers.owns_op(op.instance_id):
            return None
        return self.rt.records.get(op.instance_id)

    def _run(self, op: MemOp) -> None:
        if (owner := adapter_owner(op.instance_id)) is not None:  # LoRA (issue 12)
            self.adapters.run_op(op, *owner)
            return
        if self.layers.owns_op(op.instance_id):  # a hosted stage's bytes (CoCoServe)
            self.layers.run_op(op.kind.value, op.instance_id)
            return
        record = self.rt.records[op.instance_id]
        inst = self.rt.sched.node.instance(op.instance_id)  # a split instance holds its share
        weights = inst.model.weight_bytes if inst else record.weight_bytes
        kv_bytes = max(0, op.bytes_after - weights)
        if op.kind is MemOpKind.LOAD:
            self.rt.engines[op.instance_id] = self._load(op.instance_id, record, kv_bytes)
        elif op.kind is MemOpKind.SCALE:  # (a pipelined engine's pool is its layers' share)
            self.rt.engines[op.instance_id].resize_kv(
                self.pipelines.kv_share(op.instance_id, kv_bytes))
        else:
            self.pipelines.unloaded(op.instance_id)
            engine = self.rt.engines.pop(op.instance_id, None)
            if engine is not None:
                engine.unload()

    def _load(self, instance_id: str, record: ModelRecord, kv_bytes: int) -> Engine:
        load = self._loading.pop(instance_id, None)
        started = time.perf_counter()
        try:  # λScale: serve through a pipeline while the model arrives, if so planned
            engine = self.pipelines.load(instance_id, record, kv_bytes)
            if engine is None:
                self._await_arrival(record)
                factory = self.engine_factory or create_engine
                engine = factory(record.engine, record.path, device=self.rt.s.device,
                                 kv_capacity_bytes=kv_bytes, loader=self.rt.loader)
                started = time.perf_counter()
                engine.load()
        except BaseException:
            if load is not None:
                load.ok, load.seconds = False, time.perf_counter() - started
                self.rt.obs.load_done(load)
            raise
        if load is not None:
            info = load_info(engine)
            load.seconds, load.ok = time.perf_counter() - started, True
            load.tier, load.loader_seconds = info.get("tier"), info.get("loader_seconds")
            load.bytes = int(info.get("bytes", 0) or 0)
            self.rt.obs.load_done(load)
        return engine

    def _await_arrival(self, record: ModelRecord) -> None:
        """(Load thread) A model on its way here by multicast: wait until it is in the DRAM tier,
        or its transfer ended without it, or it is long overdue; then the load reads the
        fastest tier that holds it (the DRAM tier, or the storage tiers as a fallback)."""
        arrival = self.rt.arriving.get(record.name)
        if arrival is None or self.rt.multicast is None:
            return
        expected = max(0.0, arrival.expected_at - time.time())
        patience = ARRIVAL_PATIENCE * (time.monotonic() - arrival.since + expected)
        outcome = self.rt.multicast.wait_for_model(arrival.model_path, arrival.since,
                                                   max(ARRIVAL_MIN_WAIT_S, patience))
        if self.rt.arriving.get(record.name) is arrival:
            del self.rt.arriving[record.name]
        if not outcome:
            log.warning("node %s: %s did not arrive by multicast (%s); loading it from the tiers",
                        self.rt.s.node_id, record.name, "transfer failed" if outcome is False
                        else "no transfer ended in time")

    def carry_out(self, result: AdmitResult, record: ModelRecord, cold: bool) -> bool:
        """What the core's admission started: a cold start's load expected (`cold`), its memory
        ops running, the instance's model known here. True when it admitted."""
        if result.admission.ok and cold:
            self.expect_load(result.instance_id, record)
        self.rt.start_ops(result.start_ops)
        if result.admission.ok:
            self.rt.records[result.instance_id] = record
        return result.admission.ok

    def unload_model(self, cmd: NodeCommand) -> NodeReply:
        """UNLOAD_MODEL (the admin's unload-now): the core unloads the model's idle instances
        now and each busy one once its requests have ended (`NodeScheduler.unload_model`). The
        reply carries the node's view (the intake adds it): what is left of the model there."""
        if cmd.model is None:
            return NodeReply(False, "bad_command: unload_model needs a model")
        self.rt.start_ops(self.rt.sched.unload_model(cmd.model.name, time.time()))
        self.rt.wake.set()
        return NodeReply(True, "unloading")

    def expect_load(self, instance_id: str, record: ModelRecord) -> None:
        """A cold start admitted: what the core expects of its load, from the view it decided
        on (before its LOAD op starts, so the loader's queue is the loads ahead of it)."""
        sched = self.rt.sched
        storage = sched.node.storage
        profile = sched.perf.get(record.name, sched.node.hardware)
        expected = load_seconds(sched.node, model_spec(record), profile) if profile else 0.0
        tier = storage.holds.get(record.name, "registry") if storage else None
        if storage is not None and record.name in storage.arriving and tier != "dram":
            tier = "multicast"  # then its DRAM tier
        load = LoadRecord(instance_id, record.name, time.time(), tier, expected)
        self._loading[instance_id] = load
        self.loads.append(load)

    # --- completions (the reservation-station stream) -------------------------------------------
    async def on_done(self, msg: Msg) -> None:
        try:
            done = wire.decode(MemOpCompletion, msg.data)
        except wire.WireError:
            return
        await self.done(done)

    async def done(self, done: MemOpCompletion) -> None:
        if done.started < self._born:
            return  # a completion from an earlier life of this node id (op ids start again)
        op = self.ops.get(done.op_id)
        if op is None or op.instance_id != done.instance_id:
            return  # already applied (published and applied locally), or not ours
        del self.ops[done.op_id]
        sched = self.rt.sched
        released = sched.memop_done(op, time.time())
        if (owner := adapter_owner(op.instance_id)) is not None:  # LoRA (issue 12)
            if op.kind is MemOpKind.LOAD:
                await self.adapters.after_load(*owner, done)
        elif op.kind is MemOpKind.LOAD:
            await self._after_load(op.instance_id, done)
        if op.kind is MemOpKind.UNLOAD and not sched.node.instance(op.instance_id):
            self.rt.records.pop(op.instance_id, None)
            self._loading.pop(op.instance_id, None)  # unloaded before its load ran
        self.rt.start_ops(released)
        self.rt.wake.set()

    async def _after_load(self, instance_id: str, done: MemOpCompletion) -> None:
        waiting = [lv for lv in self.book.live.values() if lv.instance_id == instance_id]
        if not done.ok:
            # The core counted the load done: unload it before anything awaits, or a request
            # routed to it meanwhile would run on an engine that is not there.
            self.rt.start_ops(self.rt.sched.preempt([instance_id], time.time())[1])
            await self.failures.ended(self.rt.records.get(instance_id), "model", done.error,
                                      waiting)
            return
        for live in waiting:
            self.requests.engine_add(live)

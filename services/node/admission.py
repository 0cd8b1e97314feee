"""Admission on the node: ADMIT, START_INSTANCE and PREEMPT_ADMIT. The core re-checks each
placement (`NodeScheduler.admit`, `start_instance`, `preempt_and_admit`); this part decodes the
command's inputs, passes the redelivery gate (`RequestBook.gate`), and carries out what the core
admitted: the request becomes ours, its memory ops start, victims are handed back or moved live.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from services.node.adapters import Adapters
from services.node.book import RequestBook
from services.node.cluster_sync import ClusterSync
from services.node.lifecycle import RequestLifecycle
from services.node.memops import MemOps
from services.node.migration_source import MigrationSource
from services.node.runtime import Arrival, NodeRuntime
from shared.cluster import model_spec, request_view
from shared.core.node_scheduler import AdmitResult
from shared.core.types import AdapterSpec
from shared.schemas import InferenceRequest, MigrationTarget, ModelRecord, NodeCommand, NodeReply

log = logging.getLogger("slinfer.node")


class Admission:
    def __init__(self, rt: NodeRuntime, book: RequestBook, requests: RequestLifecycle,
                 adapters: Adapters, memops: MemOps, sync: ClusterSync,
                 source: MigrationSource) -> None:
        self.rt, self.book, self.requests = rt, book, requests
        self.adapters, self.memops, self.sync, self.source = adapters, memops, sync, source

    async def admit(self, cmd: NodeCommand) -> NodeReply:
        checked = await self._inputs(cmd)
        if isinstance(checked, NodeReply):
            return checked
        req, record, adapter = checked
        expected = self._expect_arrival(cmd, record)
        result = self.rt.sched.admit(request_view(req), cmd.instance_id, model_spec(record),
                                     time.time(), adapter)
        if expected and not result.admission.ok:
            self.rt.arriving.pop(record.name, None)  # refused: the placer sends it no multicast
        return self._commit(req, record, result, cold=cmd.instance_id is None)

    async def start_instance(self, cmd: NodeCommand) -> NodeReply:
        """START_INSTANCE (burst scale-out): a new instance with no request yet, checked and
        sized by the core as one for the stand-in request would be; its load starts now (waiting
        for the multicast the placer announced, if any), and later ADMITs join it."""
        if cmd.request is None or cmd.model is None or cmd.instance_id is not None:
            return NodeReply(False, "bad_command: start_instance needs a request and a model")
        record = cmd.model
        await self.sync.learn_model(record)
        expected = self._expect_arrival(cmd, record)
        result = self.rt.sched.start_instance(request_view(cmd.request), model_spec(record),
                                              time.time())
        if expected and not result.admission.ok:
            self.rt.arriving.pop(record.name, None)  # refused: the placer sends it no multicast
        self.memops.carry_out(result, record, cold=True)
        self.rt.wake.set()
        return NodeReply(result.admission.ok, result.admission.reason.value, result.instance_id)

    async def preempt_admit(self, cmd: NodeCommand) -> NodeReply:
        """§VIII-A: the core re-checks the admission without the victims first; a refusal leaves
        them untouched. Their requests go back to the request stream, each with the destination
        the plan validated, before the reply (so a placer that dies now loses none of them)."""
        checked = await self._inputs(cmd)
        if isinstance(checked, NodeReply):
            return checked
        req, record, adapter = checked
        if cmd.handover_s is not None:
            return self._preempt_live(cmd, req, record, adapter)
        expected = self._expect_arrival(cmd, record)
        targets = {m.request_id: m for m in cmd.migrations}
        moved = []
        # Between two iterations: the victims' engines are unloaded by the ops this starts, and
        # an engine freed under its running iteration fails it.
        async with self.rt.iter_lock:
            result = self.rt.sched.preempt_and_admit(cmd.preempt_instance_ids, request_view(req),
                                                     cmd.instance_id, model_spec(record),
                                                     time.time(), adapter)
            if expected and not result.admission.ok:
                self.rt.arriving.pop(record.name, None)
            for view in result.evicted:
                resumed = self._hand_back(view.request_id, view.grace_s, targets)
                if resumed is not None:
                    moved.append(resumed)
            reply = self._commit(req, record, result, cold=cmd.instance_id is None)
        for resumed in moved:  # before the reply: a placer that dies now loses none of them
            await self.rt.outbox.requeue(resumed)
        return replace(reply, evicted=moved)

    def _hand_back(self, request_id: str, grace_s: float,
                   targets: dict[str, MigrationTarget]) -> InferenceRequest | None:
        """A victim's request off this node, addressed to where the plan validated it."""
        resumed = self.requests.take_back(request_id, grace_s)
        if resumed is not None and (target := targets.get(request_id)) is not None:
            resumed = replace(resumed, target_node=target.node_id,
                              target_instance=target.instance_id)
        return resumed

    def _preempt_live(self, cmd: NodeCommand, req: InferenceRequest, record: ModelRecord,
                      adapter: AdapterSpec | None) -> NodeReply:
        """Preemption by live migration: the core re-checks the admission with the victims'
        work on the node until the plan's handover and the newcomer's instance waiting for it.
        The victims run on; their requests move live (`_hand_over`), then they are unloaded,
        and only then does the newcomer's memory (held in the reservation station) grow."""
        result = self.rt.sched.preempt_and_admit(cmd.preempt_instance_ids, request_view(req),
                                                 cmd.instance_id, model_spec(record), time.time(),
                                                 adapter, handover_s=cmd.handover_s)
        reply = self._commit(req, record, result, cold=cmd.instance_id is None)
        if not result.admission.ok:
            return reply
        moving = [r.request_id for r in result.migrating]
        targets = {m.request_id: m for m in cmd.migrations}
        self.rt.spawn(self._hand_over(list(cmd.preempt_instance_ids), moving, targets),
                      f"handover-{req.request_id}")
        return replace(reply, migrating=moving)

    async def _hand_over(self, victims: list[str], moving: list[str],
                         targets: dict[str, MigrationTarget]) -> None:
        """Source side of a live preemption: every displaced request migrates at once to where
        the plan validated it (each destination recomputes its migrants in turn); then the
        victims are unloaded. A request whose migration was refused or failed goes stop-and-
        resume: back to the request stream with its tokens and the plan's destination."""
        moves = [self.source.migrate_out(rid, targets[rid].node_id,
                                         targets[rid].instance_id or None)
                 for rid in moving if rid in targets]
        for outcome in await asyncio.gather(*moves, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.warning("a live preemption's migration failed: %r", outcome)
        async with self.rt.iter_lock:  # between two iterations: no victim is running one
            now = time.time()
            requeue = []
            for victim in victims:
                left, ops = self.rt.sched.finish_handover(victim, now)
                for view in left:
                    resumed = self._hand_back(view.request_id, view.grace_s, targets)
                    if resumed is not None:
                        requeue.append(resumed)
                self.rt.start_ops(ops)
        for resumed in requeue:
            log.info("live preemption: %s moves stop-and-resume", resumed.request_id)
            await self.rt.outbox.requeue(resumed)
        self.rt.wake.set()

    async def _inputs(self, cmd: NodeCommand) -> tuple[InferenceRequest, ModelRecord,
                                                       AdapterSpec | None] | NodeReply:
        """The request, model record and adapter an admission needs, or the reply that
        refuses it (or answers a redelivery)."""
        req = cmd.request
        if req is None:
            return NodeReply(False, "bad_command: admit without a request")
        gate = self.book.gate(req)
        if gate.stale is not None:
            self.requests.drop_stale(gate.stale)
        if gate.resend is not None:  # in case the gateway missed it too
            await self.rt.outbox.token(gate.resend, headers=False)
        if gate.reply is not None:
            return gate.reply
        record = cmd.model if cmd.instance_id is None else self.rt.records.get(cmd.instance_id)
        if record is None:
            return NodeReply(False, "instance_gone" if cmd.instance_id else "bad_command: no model")
        await self.sync.learn_model(record)
        adapter = await self.adapters.spec(req, record)  # LoRA (issue 12)
        if isinstance(adapter, NodeReply):
            return adapter
        return req, record, adapter

    def _expect_arrival(self, cmd: NodeCommand, record: ModelRecord) -> bool:
        """A new instance whose model the placer multicasts here (λScale §5): the core's load
        estimate counts the arrival (`StorageView.arriving`), and the load waits for it. True
        when this command announced it (a refusal withdraws it)."""
        if cmd.multicast_s is None or cmd.instance_id is not None or self.rt.multicast is None \
                or record.name in self.rt.arriving:
            return False
        expected_at = time.time() + max(0.0, cmd.multicast_s)
        self.rt.arriving[record.name] = Arrival(record.path, expected_at, time.monotonic(),
                                                cmd.pipeline)
        self.rt.refresh_storage()
        return True

    def _commit(self, req: InferenceRequest, record: ModelRecord, result: AdmitResult,
                cold: bool) -> NodeReply:
        """Carry out what the core admitted: the request becomes ours, its memory ops start."""
        if not self.memops.carry_out(result, record, cold):
            return NodeReply(False, result.admission.reason.value)
        iid = result.instance_id
        req = replace(req, grace_s=result.admission.grace_s, target_node=None, target_instance=None)
        live = self.requests.adopt(req, iid, req.resumed_token_ids, cold=cold)
        if self.rt.loaded(iid):
            self.requests.engine_add(live)
        self.rt.wake.set()
        return NodeReply(True, result.admission.reason.value, iid)

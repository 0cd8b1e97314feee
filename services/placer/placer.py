"""The placer: consumes the durable request stream, asks the policy core where each request goes,
and carries the plan out with the nodes (which re-check and may refuse on fresher state).

Several placers may share the durable consumer; a request is acked only once a node accepted it
(or it was dropped), so a placer that dies mid-decision loses nothing: JetStream redelivers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from redis.asyncio import Redis

from services.placer.settings import PlacerSettings
from shared import wire
from shared.bus import ensure_streams
from shared.cluster import load_perf, model_spec, read_nodes, request_view
from shared.core.perf_model import PerfModel
from shared.core.placement import PlaceAction, PlacementPlan, place
from shared.core.types import NodeView
from shared.registry import ModelRegistry
from shared.schemas import (CancelNotice, CommandKind, FinishReason, InferenceRequest, ModelRecord,
                            NodeCommand, NodeReply, TokenMessage)
from shared.subjects import (CANCEL_SUBJECT, PLACER_DURABLE, REQUEST_SUBJECT, node_command_subject,
                             token_subject)

log = logging.getLogger("slinfer.placer")
ACK_WAIT_S = 30.0
PERF_REFRESH_S = 2.0
MAX_REFUSALS = 8  # a request refused this often is failed with the nodes' reason, not retried forever


@dataclass
class Pending:
    msg: Msg
    request: InferenceRequest
    received: float  # placer clock when first seen
    tries: int = 0  # nodes that refused it so far
    next_try: float = 0.0  # back off after a refusal: the next view may be fresher
    last_refusal: str = ""
    last_progress: float = 0.0  # last in_progress() sent to JetStream


class Placer:
    def __init__(self, settings: PlacerSettings, nc: NATS, redis: Redis) -> None:
        self.s = settings
        self.nc, self.js, self.redis = nc, nc.jetstream(), redis
        self.registry = ModelRegistry(redis)
        self.queue: dict[str, Pending] = {}
        self.perf = PerfModel()
        self._perf_at = 0.0
        self.decisions: dict[str, int] = {}  # action -> count (for tests and metrics)

    async def start(self) -> None:
        await ensure_streams(self.js)
        self.sub = await self.js.pull_subscribe(
            REQUEST_SUBJECT, durable=PLACER_DURABLE,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
                                  max_ack_pending=10_000))
        await self.nc.subscribe(CANCEL_SUBJECT, cb=self._on_cancel)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._fetch(timeout=0.05 if self.queue else 0.5)
            if self.queue:
                await self.place_queued()

    async def _fetch(self, timeout: float) -> None:
        try:
            msgs = await self.sub.fetch(batch=64, timeout=timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            return
        for msg in msgs:
            try:
                req = wire.decode(InferenceRequest, msg.data)
            except wire.WireError as exc:
                log.warning("dropping undecodable request message: %s", exc)
                await msg.term()
                continue
            self.queue.setdefault(req.request_id, Pending(msg, req, time.time()))

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            notice = wire.decode(CancelNotice, msg.data)
        except wire.WireError:
            return
        pending = self.queue.pop(notice.request_id, None)
        if pending is not None:
            await pending.msg.ack()

    # --- decisions ---------------------------------------------------------------------------
    async def place_queued(self) -> None:
        nodes = await read_nodes(self.redis)
        await self._refresh_perf()
        records = {r.name: r for r in await self.registry.list()}
        now = time.time()
        for rid in list(self.queue):
            pending = self.queue.get(rid)
            if pending is not None and pending.next_try <= now:
                nodes = await self._place_one(pending, nodes, records)

    async def _refresh_perf(self) -> None:
        if time.monotonic() - self._perf_at > PERF_REFRESH_S:
            self.perf, self._perf_at = await load_perf(self.redis), time.monotonic()

    async def _place_one(self, p: Pending, nodes: list[NodeView],
                         records: dict[str, ModelRecord]) -> list[NodeView]:
        record = records.get(p.request.model)
        if record is None:
            await self._fail(p, FinishReason.ERROR, f"model {p.request.model!r} is not registered")
            return nodes
        specs = {name: model_spec(r) for name, r in records.items()}
        plan = place(request_view(p.request), specs[record.name], nodes, self.perf, time.time(),
                     self.s.core, models=specs)
        self.decisions[plan.action.value] = self.decisions.get(plan.action.value, 0) + 1
        if plan.action is PlaceAction.DROP:
            await self._fail(p, FinishReason.DROPPED, _drop_message(plan))
        elif plan.action is PlaceAction.QUEUE:
            await self._keep_waiting(p)
        else:
            nodes = await self._carry_out(p, plan, record, nodes)
        return nodes

    async def _carry_out(self, p: Pending, plan: PlacementPlan, record: ModelRecord,
                         nodes: list[NodeView]) -> list[NodeView]:
        if plan.action is PlaceAction.PREEMPT_AND_ROUTE:
            reply = await self._command(plan.node_id, NodeCommand(
                CommandKind.PREEMPT, preempt_instance_ids=list(plan.preempt)))
            for evicted in (reply.evicted if reply else []):
                await self._requeue(evicted)
        new = plan.instance_id is None
        reply = await self._command(plan.node_id, NodeCommand(
            CommandKind.ADMIT, request=p.request, instance_id=plan.instance_id,
            model=record if new else None))
        if reply is not None and reply.accepted:
            self.queue.pop(p.request.request_id, None)
            await p.msg.ack()
            log.info("placed %s on %s/%s (%s)", p.request.request_id, plan.node_id,
                     reply.instance_id, plan.action.value)
        else:
            await self._refused(p, plan.node_id, reply.reason if reply else "no reply")
        if reply is not None and reply.node is not None:  # fresher than Redis: use it
            nodes = [reply.node if n.node_id == reply.node.node_id else n for n in nodes]
        return nodes

    async def _refused(self, p: Pending, node_id: str, reason: str) -> None:
        p.tries += 1
        p.last_refusal = f"{node_id}: {reason}"
        log.info("node %s refused %s: %s", node_id, p.request.request_id, reason)
        if p.tries >= MAX_REFUSALS:
            await self._fail(p, FinishReason.ERROR, f"refused {p.tries} times (last: {p.last_refusal})")
        else:
            p.next_try = time.time() + min(1.0, 0.02 * 2**p.tries)

    async def _command(self, node_id: str, cmd: NodeCommand) -> NodeReply | None:
        try:
            msg = await self.nc.request(node_command_subject(node_id), wire.encode(cmd),
                                        timeout=self.s.admit_timeout_s)
            return wire.decode(NodeReply, msg.data)
        except (NatsTimeout, asyncio.TimeoutError, wire.WireError) as exc:
            log.warning("node %s did not answer: %s", node_id, exc)
            return None
        except Exception as exc:  # e.g. no responders: the node is gone
            log.warning("node %s unreachable: %s", node_id, exc)
            return None

    async def _requeue(self, req: InferenceRequest) -> None:
        """A preempted request goes back through the stream with its tokens (it resumes)."""
        msg_id = f"{req.request_id}:resume:{len(req.resumed_token_ids)}"
        await self.js.publish(REQUEST_SUBJECT, wire.encode(req), headers={"Nats-Msg-Id": msg_id})

    async def _keep_waiting(self, p: Pending) -> None:
        now = time.time()
        if now - p.last_progress > ACK_WAIT_S / 3:
            await p.msg.in_progress()  # still deciding: don't redeliver to another placer
            p.last_progress = now

    async def _fail(self, p: Pending, reason: FinishReason, error: str) -> None:
        self.queue.pop(p.request.request_id, None)
        await self.nc.publish(token_subject(p.request.request_id), wire.encode(TokenMessage(
            p.request.request_id, len(p.request.resumed_token_ids), [], finished=True,
            finish_reason=reason, output_token_ids=list(p.request.resumed_token_ids),
            prompt_tokens=len(p.request.prompt_token_ids), error=error)))
        await p.msg.ack()
        log.info("%s %s: %s", reason.value, p.request.request_id, error)


def _drop_message(plan: PlacementPlan) -> str:
    tried = ", ".join(f"{a.node_id}:{a.reason.value}" for a in plan.attempts) or "no nodes"
    return f"no node can meet the request's TTFT SLO (tried {tried})"



"""The placer: consumes the durable request stream, asks the policy core where each request goes,
and carries the plan out with the nodes (which re-check and may refuse on fresher state).

Several placers may share the durable consumer; a request is acked only once a node accepted it
(or it was dropped), so a placer that dies mid-decision loses nothing: JetStream redelivers it
`ack_wait_s` after the last sign of life (a request waiting in a live placer's queue is kept
claimed with `in_progress`).

Faults: a Redis or NATS error in the run loop is logged and retried with a back-off; the queue is
kept. Cancels are durable (the cancel stream, replayed at start), and a request past its
deadline (`InferenceRequest.deadline`: nobody waits for it any more) is never placed. A request
the gateway resumed (a higher `attempt`) replaces its older attempt in the queue. After Redis
lost its data, the registry and the profiles are written back (`keeper.StateKeeper`).

A request that waited in the stream while no live placer held it (it arrived before this
placer started, or it is a redelivery: the placer that held it died) was delayed by a fault, not
by load: that wait is its TTFT grace, the way a cold start's load is (§IX-A). Without it every
request that arrived during a placer restart would be dropped as late the moment it is seen.

Each decision is a span (`place <model>`, child of the gateway's request span through the
request message's headers) that says what was decided and why: every candidate tried with the
core's admission answer, preemptions and migrations, the chosen node and instance, the node's
answer and the time queued. The span starts bare before the node command (which carries its
context); what it says is written once the command was answered. Only the first of a run of QUEUE decisions gets a span (a queued
request is re-planned every few tens of ms); the final span counts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode
from redis.asyncio import Redis

from services.placer.burst import BurstStarter
from services.placer.keeper import StateKeeper
from services.placer.module_scaler import ModuleScaler
from services.placer.preloader import ClusterPreloader
from services.placer.readiness import ReadinessGate, Verdict, hold_or_fail
from services.placer.settings import PlacerSettings
from shared import telemetry as tm
from shared import wire
from shared.bus import STREAM_MAX_AGE_S, ensure_streams
from shared.cluster import load_perf, model_spec, read_nodes, request_view
from shared.core.perf_model import PerfModel
from shared.core.placement import PlaceAction, PlacementPlan, place
from shared.core.startup import StartupChoice, StartupMethod, helper_bytes
from shared.core.types import NodeView
from shared.registry import ModelRegistry
from shared.schemas import (CancelNotice, CommandKind, FinishReason, InferenceRequest,
                            MigrationTarget, ModelRecord, NodeCommand, NodeReply, TokenMessage)
from shared.subjects import (CANCEL_STREAM, CANCEL_SUBJECT, PLACER_DURABLE, REQUEST_SUBJECT,
                             multicast_node_subject, node_command_subject, token_subject)

log = logging.getLogger("slinfer.placer")
_tracer = trace.get_tracer("slinfer.placer")
PERF_REFRESH_S = 2.0
KEEPER_CHECK_S = 1.0  # how often the registry/profile copy is refreshed (and Redis checked for loss)
MAX_REFUSALS = 8  # a request refused this often is failed with the nodes' reason, not retried forever
MAX_BACKOFF_S = 2.0  # the run loop's back-off while Redis or NATS fails
CANCEL_REPLAY_S = 5.0  # at start, wait at most this long for the cancel stream's replay
MULTICAST_TIMEOUT_S = 600.0  # one multicast's bound (its incomplete nodes then load from storage)


@dataclass
class Pending:
    msg: Msg
    request: InferenceRequest
    received: float  # placer clock when first seen
    tries: int = 0  # nodes that refused it so far
    next_try: float = 0.0  # back off after a refusal: the next view may be fresher
    last_refusal: str = ""
    last_progress: float = 0.0  # last in_progress() sent to JetStream
    trace_parent: Context = field(default_factory=Context)  # from the message's headers
    queue_decisions: int = 0  # QUEUE plans so far

    def rank(self) -> tuple[int, int]:
        """Of two messages for one request, the later one: a higher attempt (the gateway resumed
        it), else more tokens (a node handed it back after generating more)."""
        return self.request.attempt, len(self.request.resumed_token_ids)


class Placer:
    def __init__(self, settings: PlacerSettings, nc: NATS, redis: Redis,
                 telemetry: tm.Telemetry | None = None) -> None:
        self.s = settings
        self.nc, self.js, self.redis = nc, nc.jetstream(), redis
        self.registry = ModelRegistry(redis)
        self.queue: dict[str, Pending] = {}
        self.perf = PerfModel()
        self._perf_at = 0.0
        self.decisions: dict[str, int] = {}  # action -> count (for tests and metrics)
        # request id -> cancel every attempt below this (math.inf: all), and when it was seen
        self.cancelled: dict[str, tuple[float, float]] = {}
        self._cancel_seq = 0  # last cancel-stream sequence seen
        self.keeper = StateKeeper(redis)
        self.readiness = ReadinessGate(redis)  # models still converting/profiling, or failed
        self._kept_at = 0.0
        self.errors = 0  # run-loop turns that failed (Redis or NATS trouble)
        self._failing = False
        self.started_at = time.time()
        tel = telemetry or tm.local("placer")
        # λScale §5: new instances admitted this turn that receive their model by multicast,
        # (model path, sources) -> destination nodes; one multicast each, started after the turn.
        self._scaleout: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        # ... those of them with a destination serving through a pipeline meanwhile: the model's
        # head goes first (execute-while-load, λScale §4.3).
        self._head_first: set[tuple[str, tuple[str, ...]]] = set()
        self._multicasts: set[asyncio.Task] = set()
        self.multicast_reports: deque = deque(maxlen=256)  # MulticastReport, newest last
        # CoCoServe: the core's module-scaling plans, carried out with the nodes.
        self.modules = ModuleScaler(self, settings.modules, settings.module_scaling_s)
        # ServerlessLoRA §4.1: the cluster's pre-loading plan, from the rates every request shows.
        self.preloader = ClusterPreloader(self, settings.preload_interval_s)
        # λScale's burst scale-out: the core's extra instances for a model whose demand outgrows
        # the instance just started (off unless settings.core.burst_scaleout).
        self.bursts = BurstStarter(self, settings.core)
        self._decision_counter = tel.meter("slinfer.placer").create_counter(
            tm.PLACER_DECISIONS, unit="{decision}", description="Placement decisions by action")

    async def start(self) -> None:
        await ensure_streams(self.js)
        self.sub = await self.js.pull_subscribe(
            REQUEST_SUBJECT, durable=PLACER_DURABLE,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.s.ack_wait_s,
                                  max_ack_pending=10_000))
        # Every cancel of the last hour, then the new ones (an ordered consumer: it re-creates
        # itself after a NATS restart). Placing starts once the replay caught up, so a request
        # cancelled while no placer ran is not placed now.
        last = (await self.js.stream_info(CANCEL_STREAM)).state.last_seq
        await self.js.subscribe(CANCEL_SUBJECT, cb=self._on_cancel, ordered_consumer=True,
                                deliver_policy=DeliverPolicy.ALL, idle_heartbeat=1.0)
        deadline = time.monotonic() + CANCEL_REPLAY_S
        while self._cancel_seq < last and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        try:
            await self.keeper.check()
        except Exception as exc:
            log.warning("could not read the registry copy at start: %r", exc)
        self.started_at = time.time()

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: fetch, place. A turn that fails (Redis or NATS down) is retried with a
        back-off; the queue and its claims on the stream are kept."""
        backoff = 0.0
        while not stop.is_set():
            try:
                await self.turn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors += 1
                backoff = min(MAX_BACKOFF_S, max(0.05, backoff * 2))
                if not self._failing:
                    log.warning("placer turn failed (%r); retrying with back-off, %d queued",
                                exc, len(self.queue))
                self._failing = True
                try:
                    await asyncio.wait_for(stop.wait(), backoff)
                except TimeoutError:
                    pass
                continue
            if self._failing:
                log.info("placer turns work again; %d queued", len(self.queue))
            self._failing, backoff = False, 0.0

    async def turn(self) -> None:
        """One turn of the run loop (raises what Redis or NATS raise)."""
        await self._fetch(timeout=0.05 if self.queue else 0.5)
        await self._keep_claims()
        if time.monotonic() - self._kept_at > KEEPER_CHECK_S:
            await self.keeper.check()
            self._kept_at = time.monotonic()
        if self.queue:
            await self.place_queued()
        await self.modules.turn()  # rate limited (settings.module_scaling_s)
        await self.preloader.turn()  # rate limited (settings.preload_interval_s)

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
            await self._enqueue(msg, req)

    async def _enqueue(self, msg: Msg, req: InferenceRequest) -> None:
        unclaimed = _unclaimed_since(msg, req, self.started_at)
        if unclaimed > 0:  # it waited for a live placer (module docstring)
            req = replace(req, grace_s=max(req.grace_s, unclaimed))
        new = Pending(msg, req, time.time(), trace_parent=tm.extract_context(msg.headers,
                                                                          req.trace_context))
        old = self.queue.get(req.request_id)
        if old is None:
            self.queue[req.request_id] = new
            self.preloader.note(req, new.received)
            self.bursts.note(req, new.received)
        elif _stream_seq(old.msg) == _stream_seq(msg):
            old.msg = msg  # redelivered while we still hold it: answer the latest delivery
        elif new.rank() > old.rank():
            self.queue[req.request_id] = new  # a resumed or handed-back copy supersedes it
            await old.msg.ack()
        else:
            await msg.ack()  # an older copy of one we hold

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            self._cancel_seq = max(self._cancel_seq, msg.metadata.sequence.stream)
        except Exception:
            pass
        try:
            notice = wire.decode(CancelNotice, msg.data)
        except wire.WireError:
            return
        below = math.inf if notice.below_attempt is None else notice.below_attempt
        now = time.time()
        earlier = self.cancelled.get(notice.request_id, (0.0, now))[0]
        self.cancelled[notice.request_id] = (max(below, earlier), now)
        pending = self.queue.get(notice.request_id)
        if pending is not None and pending.request.attempt < below:
            del self.queue[notice.request_id]
            await pending.msg.ack()
        if len(self.cancelled) > 1024 and now - next(iter(self.cancelled.values()))[1] > STREAM_MAX_AGE_S:
            self.cancelled = {k: v for k, v in self.cancelled.items()
                              if now - v[1] <= STREAM_MAX_AGE_S}

    def _given_up(self, req: InferenceRequest, now: float) -> str | None:
        """Why nobody waits for this request any more, if so."""
        below = self.cancelled.get(req.request_id, (0.0, 0.0))[0]
        if req.attempt < below:
            return "cancelled"
        if req.deadline and now > req.deadline:
            return "deadline passed"
        return None

    async def _keep_claims(self) -> None:
        """Tell JetStream that every request in the queue is still ours (else it redelivers it
        after ack_wait), whatever is happening to it (queued, backing off after a refusal)."""
        now = time.time()
        for p in list(self.queue.values()):
            if now - p.last_progress > self.s.ack_wait_s / 3:
                await p.msg.in_progress()
                p.last_progress = now

    # --- decisions ---------------------------------------------------------------------------
    async def place_queued(self) -> None:
        # A draining node (POST /admin/nodes/{id}/drain) takes no new work; it would refuse it.
        nodes = [n for n in await read_nodes(self.redis) if not n.draining]
        await self._refresh_perf()
        records = {r.name: r for r in await self.registry.list()}
        now = time.time()
        for rid in list(self.queue):
            pending = self.queue.get(rid)
            if pending is None or pending.next_try > now:
                continue
            why = self._given_up(pending.request, now)
            if why is not None:
                await self._forget(pending, why)
                continue
            nodes = await self._place_one(pending, nodes, records)
        self._start_multicasts()

    def _start_multicasts(self) -> None:
        """One multicast per model (and set of sources) to the nodes admitted this turn with a
        multicast startup (λScale §4.2: the binomial pipeline, k-way with several sources).
        It runs on its own: a node whose copy does not arrive loads from its tiers."""
        batches, self._scaleout = self._scaleout, {}
        head_first, self._head_first = self._head_first, set()
        for (path, sources), dests in batches.items():
            task = asyncio.create_task(
                self._multicast(path, list(sources), dests, (path, sources) in head_first),
                name=f"multicast-{path}")
            self._multicasts.add(task)
            task.add_done_callback(self._multicasts.discard)

    async def _multicast(self, path: str, sources: list[str], dests: list[str],
                         head_first: bool = False) -> None:
        from services.node.multicast_coordinator import multicast

        try:
            report = await multicast(self.nc, path, sources, dests, timeout_s=MULTICAST_TIMEOUT_S,
                                     head_first=head_first)
        except Exception as exc:  # no source could offer it: every destination reads its tiers
            log.warning("multicast of %s from %s to %s failed: %r", path, sources, dests, exc)
            await self._abandon(path, dests)
            return
        self.multicast_reports.append(report)
        log.info("multicast of %s from %s to %s: %.2f s%s", path, ",".join(report.sources),
                 ",".join(dests), report.seconds,
                 f"; failed {report.failed}" if not report.ok else "")
        await self._abandon(path, list(report.failed))

    async def _abandon(self, path: str, nodes: list[str]) -> None:
        """Nodes the model will not reach by this multicast: their loads stop waiting for it
        (an endpoint that took part knows already; one that never heard of it learns here)."""
        for node in nodes:
            try:
                await self.nc.publish(multicast_node_subject(node), json.dumps(
                    {"op": "abandon", "model_path": path}).encode())
            except Exception as exc:  # NATS down: the node gives up waiting on its own
                log.warning("could not tell %s that %s is not coming: %r", node, path, exc)

    async def _forget(self, p: Pending, why: str) -> None:
        """Ack without placing: nobody waits for it (no message: nobody would read it)."""
        self.queue.pop(p.request.request_id, None)
        self.decisions["given_up"] = self.decisions.get("given_up", 0) + 1
        await p.msg.ack()
        log.info("not placing %s: %s", p.request.request_id, why)

    async def _refresh_perf(self) -> None:
        if time.monotonic() - self._perf_at > PERF_REFRESH_S:
            perf = await load_perf(self.redis)
            if perf.profiles or not self.perf.profiles:  # an emptied Redis: keep deciding as before
                self.perf = perf
            self._perf_at = time.monotonic()

    async def _place_one(self, p: Pending, nodes: list[NodeView],
                         records: dict[str, ModelRecord]) -> list[NodeView]:
        record = records.get(p.request.model)
        if record is None:
            with self._span(p, None):
                await self._fail(p, FinishReason.ERROR, f"model {p.request.model!r} is not registered")
            return nodes
        ready = await self.readiness.check(record, nodes, self.perf)
        if ready.verdict is not Verdict.SERVE:  # not profiled yet, or its lifecycle failed
            await hold_or_fail(self, p, ready)
            return nodes
        if p.request.target_node is not None and await self._offer_to_target(p, record, nodes):
            return nodes
        specs = {name: model_spec(r) for name, r in records.items()}
        plan = place(request_view(p.request), specs[record.name], nodes, self.perf, time.time(),
                     self.s.core, models=specs)
        self.decisions[plan.action.value] = self.decisions.get(plan.action.value, 0) + 1
        self._decision_counter.add(1, {"slinfer.placement.action": plan.action.value})
        self.modules.note(plan, request_view(p.request), specs[record.name], nodes)
        if plan.action is PlaceAction.QUEUE:
            p.queue_decisions += 1
            if p.queue_decisions == 1:  # later ones only counted: re-planned every few tens of ms
                with self._span(p, plan):
                    pass
            return nodes  # still ours: `_keep_claims` renews the claim every turn
        with self._span(p, plan) as outcome:
            if plan.action is PlaceAction.DROP:
                await self._fail(p, FinishReason.DROPPED, _drop_message(plan))
            else:
                nodes = await self._carry_out(p, plan, record, nodes, outcome)
        return nodes

    @contextmanager
    def _span(self, p: Pending, plan: PlacementPlan | None):
        """The decision's span, current while it is carried out (node commands carry it). It
        starts bare: the decision's attributes and one event per admission attempt are written
        after the plan was carried out, off the way to the node."""
        now, tries, last_refusal = time.time(), p.tries, p.last_refusal  # as they were when decided
        span = _tracer.start_span(f"place {p.request.model}", context=p.trace_parent)
        outcome: dict = {}  # what carrying it out learned (the node's answer), written last
        with trace.use_span(span, end_on_exit=True):
            try:
                yield outcome
            finally:
                if span.is_recording():
                    span.set_attributes({**_decision_attributes(p, plan, now, tries, last_refusal),
                                         **outcome})
                    if plan is not None:
                        for a in plan.attempts:
                            span.add_event("admission", {"slinfer.node_id": a.node_id,
                                                         "slinfer.instance_id": a.instance_id or "(new)",
                                                         "slinfer.admit_reason": a.reason.value})

    async def _offer_to_target(self, p: Pending, record: ModelRecord, nodes: list[NodeView]) -> bool:
        """A request displaced by a stop-and-resume preemption (or whose live migration failed)
        goes first to the node and instance the plan validated for it (§VIII-A: preempted
        requests are moved, not queued). Only if that node refuses now is it placed afresh. True
        if it was placed. (A live preemption's node moves them itself: shared/core/migration.py.)"""
        req = p.request
        plan = PlacementPlan(PlaceAction.ROUTE, req.target_node, req.target_instance)
        p.request = replace(req, target_node=None, target_instance=None)  # one offer only
        with self._span(p, plan) as outcome:
            outcome["slinfer.placement.migration"] = True
            reply = await self._command(plan.node_id, NodeCommand(
                CommandKind.ADMIT, request=p.request, instance_id=plan.instance_id))
            outcome["slinfer.node.accepted"] = bool(reply and reply.accepted)
            outcome["slinfer.node.reason"] = reply.reason if reply else "no reply"
            if reply is not None and reply.accepted:
                await self._placed(p, plan, reply)
                return True
        log.info("migration target %s/%s refused %s (%s); placing it afresh", plan.node_id,
                 plan.instance_id, req.request_id, reply.reason if reply else "no reply")
        return False

    async def _placed(self, p: Pending, plan: PlacementPlan, reply: NodeReply) -> None:
        self.queue.pop(p.request.request_id, None)
        await p.msg.ack()
        log.info("placed %s on %s/%s (%s)", p.request.request_id, plan.node_id,
                 reply.instance_id, plan.action.value)

    async def _carry_out(self, p: Pending, plan: PlacementPlan, record: ModelRecord,
                         nodes: list[NodeView], outcome: dict) -> list[NodeView]:
        new = plan.instance_id is None
        if plan.action is PlaceAction.PREEMPT_AND_ROUTE:  # one command: the node re-checks first
            cmd = NodeCommand(CommandKind.PREEMPT_ADMIT, request=p.request,
                              instance_id=plan.instance_id, model=record if new else None,
                              preempt_instance_ids=list(plan.preempt),
                              migrations=[MigrationTarget(m.request_id, m.to_node, m.to_instance)
                                          for m in plan.migrations],
                              handover_s=plan.handover_s if plan.live else None)
        else:
            cmd = NodeCommand(CommandKind.ADMIT, request=p.request, instance_id=plan.instance_id,
                              model=record if new else None)
        startup = plan.startup if new else None
        by_multicast = startup is not None and startup.method is not StartupMethod.TIER
        if by_multicast:  # MULTICAST, or PIPELINE: serving through a pipeline meanwhile
            cmd = self.with_startup(cmd, startup)
            outcome["slinfer.placement.startup"] = _startup_label(startup)
        reply = await self._command(plan.node_id, cmd)
        outcome["slinfer.node.accepted"] = bool(reply and reply.accepted)
        outcome["slinfer.node.reason"] = reply.reason if reply else "no reply"
        if reply is not None and reply.instance_id:
            outcome["slinfer.placement.instance_id"] = reply.instance_id
        if reply is not None and reply.accepted:
            outcome["slinfer.placement.moved"] = [r.request_id for r in reply.evicted]
            if by_multicast and reply.reason == "admitted":
                nodes = self.join_multicast(record, startup, plan.node_id, nodes)
            if reply.migrating:
                outcome["slinfer.placement.migrating_live"] = list(reply.migrating)
            await self._placed(p, plan, reply)
        else:
            await self._refused(p, plan.node_id, reply.reason if reply else "no reply")
        if reply is not None and reply.node is not None:  # fresher than Redis: use it
            nodes = [reply.node if n.node_id == reply.node.node_id else n for n in nodes]
        if plan.action is PlaceAction.NEW_INSTANCE and reply is not None and reply.accepted \
                and reply.reason == "admitted":
            nodes = await self.bursts.after_new_instance(p.request, plan, record, nodes)
        return nodes

    @staticmethod
    def with_startup(cmd: NodeCommand, startup: StartupChoice) -> NodeCommand:
        """A new instance's command with its startup: the multicast the node's load waits for
        (MULTICAST, or PIPELINE: serving through a pipeline meanwhile); TIER: unchanged."""
        if startup.method is StartupMethod.TIER:
            return cmd
        return replace(cmd, multicast_s=startup.arrive_s, pipeline=startup.pipeline)

    def join_multicast(self, record: ModelRecord, startup: StartupChoice, node_id: str,
                       nodes: list[NodeView]) -> list[NodeView]:
        """A node admitted a new instance that receives `record` by `startup`: it joins this
        turn's multicast of the model from those sources (`_start_multicasts`). Returns the views
        with a pipeline helper's stage reserved."""
        if startup.method is StartupMethod.TIER:
            return nodes
        dests = self._scaleout.setdefault((record.path, startup.sources), [])
        if node_id not in dests:
            dests.append(node_id)
        if startup.pipeline is not None:
            self._head_first.add((record.path, startup.sources))
            nodes = _with_stage(nodes, startup, model_spec(record))
        return nodes

    async def _refused(self, p: Pending, node_id: str, reason: str) -> None:
        p.tries += 1
        p.last_refusal = f"{node_id}: {reason}"
        log.info("node %s refused %s: %s", node_id, p.request.request_id, reason)
        if p.tries >= MAX_REFUSALS:
            await self._fail(p, FinishReason.ERROR, f"refused {p.tries} times (last: {p.last_refusal})")
        else:
            p.next_try = time.time() + min(1.0, 0.02 * 2**p.tries)

    async def _command(self, node_id: str, cmd: NodeCommand,
                       timeout_s: float | None = None) -> NodeReply | None:
        try:
            msg = await self.nc.request(node_command_subject(node_id), wire.encode(cmd),
                                        timeout=timeout_s or self.s.admit_timeout_s,
                                        headers=tm.inject_headers())
            return wire.decode(NodeReply, msg.data)
        except (NatsTimeout, asyncio.TimeoutError, wire.WireError) as exc:
            log.warning("node %s did not answer: %s", node_id, exc)
            return None
        except Exception as exc:  # e.g. no responders: the node is gone
            log.warning("node %s unreachable: %s", node_id, exc)
            return None

    async def _fail(self, p: Pending, reason: FinishReason, error: str) -> None:
        self.queue.pop(p.request.request_id, None)
        span = trace.get_current_span()
        span.set_status(Status(StatusCode.ERROR, error))
        span.set_attribute("slinfer.finish_reason", reason.value)
        await self.nc.publish(token_subject(p.request.request_id), wire.encode(TokenMessage(
            p.request.request_id, len(p.request.resumed_token_ids), [], finished=True,
            finish_reason=reason, output_token_ids=list(p.request.resumed_token_ids),
            prompt_tokens=len(p.request.prompt_token_ids), error=error,
            attempt=p.request.attempt)))
        await p.msg.ack()
        log.info("%s %s: %s", reason.value, p.request.request_id, error)


def _decision_attributes(p: Pending, plan: PlacementPlan | None, now: float, tries: int,
                         last_refusal: str) -> dict:
    """The decision as it was taken at `now`, with the refusals seen before it."""
    req = p.request
    attrs = {tm.MODEL: req.model, "slinfer.request_id": req.request_id,
             "slinfer.placement.queued_s": now - p.received,  # in this placer's queue
             "slinfer.placement.waited_s": now - req.arrival,  # since the gateway took it
             "slinfer.placement.queue_decisions": p.queue_decisions,
             "slinfer.placement.refusals": tries,
             "slinfer.resumed_tokens": len(req.resumed_token_ids)}
    if last_refusal:
        attrs["slinfer.placement.last_refusal"] = last_refusal
    if plan is None:
        return attrs
    attrs["slinfer.placement.action"] = plan.action.value
    attrs["slinfer.placement.attempts"] = [
        f"{a.node_id}/{a.instance_id or '(new)'}: {a.reason.value}" for a in plan.attempts]
    if plan.node_id is not None:
        attrs["slinfer.placement.node_id"] = plan.node_id
        attrs["slinfer.placement.instance_id"] = plan.instance_id or "(new)"
    if plan.admission is not None:
        attrs["slinfer.placement.admit_reason"] = plan.admission.reason.value
        if plan.admission.kv_target_bytes is not None:
            attrs["slinfer.placement.kv_target_bytes"] = plan.admission.kv_target_bytes
    if plan.preempt:
        attrs["slinfer.placement.preempt"] = list(plan.preempt)
        attrs["slinfer.placement.migrations"] = [
            f"{m.request_id}: {m.from_instance} -> {m.to_node}/{m.to_instance}" for m in plan.migrations]
        attrs["slinfer.placement.preempt_live"] = plan.live
        attrs["slinfer.placement.handover_s"] = plan.handover_s
        if plan.preempt_why:
            attrs["slinfer.placement.preempt_why"] = plan.preempt_why
    return attrs


def _with_stage(nodes: list[NodeView], startup: StartupChoice, spec) -> list[NodeView]:
    """The placer's view once the pipeline's helpers reserved their stages (the next decision
    of this turn must not count the same room; a helper's own view follows at its heartbeat):
    a DRAM holder its stage, a receiver its ranges' K/V, as the core planned (`helper_bytes`)."""
    need = helper_bytes(spec, startup.pipeline)
    return [replace(n, budget_bytes=n.budget_bytes + need[n.node_id])
            if n.node_id in need else n for n in nodes]


def _startup_label(startup: StartupChoice) -> str:
    label = f"{startup.method.value} from {','.join(startup.sources)}"
    if startup.pipeline is not None:
        label += f", layers it lacks on {','.join(startup.pipeline.helpers)}"
    return label


def _unclaimed_since(msg: Msg, req: InferenceRequest, started_at: float) -> float:
    """Seconds the request waited in the stream with no live placer holding it."""
    try:
        redelivered = msg.metadata.num_delivered > 1
    except Exception:  # not a JetStream message (tests)
        redelivered = False
    held_from = time.time() if redelivered else started_at
    return max(0.0, held_from - req.arrival)


def _stream_seq(msg: Msg) -> int | None:
    try:
        return msg.metadata.sequence.stream
    except Exception:  # not a JetStream message (tests)
        return None


def _drop_message(plan: PlacementPlan) -> str:
    tried = ", ".join(f"{a.node_id}:{a.reason.value}" for a in plan.attempts) or "no nodes"
    return f"no node can meet the request's TTFT SLO (tried {tried})"



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

Each decision is a span (services/placer/tracing.py). Only the first of a run of QUEUE decisions
gets a span (a queued request is re-planned every few tens of ms); the final span counts them.

`Placer` is the composition root: it builds the port its parts share (`port.PlacerPort`: the
settings, connections, registry, profiles, decision counts and node commands) and the parts, each
in its own file, and runs the turn; what is left here is the decision itself: plan with the core,
carry the plan out with the nodes, and take the node's answer.

    intake.py       the request and cancel streams, the queue, the answers (placed, failed)
    commands.py     one node command and its reply
    scaleout.py     λScale multicasts for the new instances a turn admitted
    tracing.py      the decision spans
    burst.py, module_scaler.py, preloader.py, pinning.py, prewarmer.py, readiness.py: plug-ins on
    the port
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace

from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from services.placer.burst import BurstStarter
from services.placer.commands import with_startup
from services.placer.intake import Pending, RequestIntake
from services.placer.keeper import StateKeeper
from services.placer.module_scaler import ModuleScaler
from services.placer.pinning import PinKeeper
from services.placer.port import PlacerPort
from services.placer.preloader import ClusterPreloader
from services.placer.prewarmer import Prewarmer
from services.placer.readiness import ReadinessGate, Verdict, hold_or_fail
from services.placer.scaleout import ScaleOut
from services.placer.settings import PlacerSettings
from services.placer.tracing import decision_span, startup_label
from shared import telemetry as tm
from shared import wire
from shared.cluster import (adapter_spec, announcement, grace_from_now, model_spec,
                            request_view)
from shared.core.context import DecisionContext
from shared.core.perf_model import PerfModel
from shared.core.placement import PlaceAction, PlacementPlan, place
from shared.core.startup import StartupMethod
from shared.core.types import AdapterSpec, NodeView
from shared.schemas import (CommandKind, FinishReason, MigrationTarget, ModelRecord, NodeCommand,
                            NodeReply, RequestState)
from shared.subjects import token_subject

log = logging.getLogger("slinfer.placer")
KEEPER_CHECK_S = 1.0  # how often the registry/profile copy is refreshed (and Redis checked for loss)
MAX_REFUSALS = 8  # a request refused this often is failed with the nodes' reason, not retried forever
# A node's refusal that is its fault (its handler raised; it could not read what it needed), not
# its load: a request last refused so is failed with that reason, never dropped as overload.
NODE_FAULTS = ("error:", "bad_command:")
MAX_BACKOFF_S = 2.0  # the run loop's back-off while Redis or NATS fails


class Placer:
    def __init__(self, settings: PlacerSettings, nc: NATS, redis: Redis,
                 telemetry: tm.Telemetry | None = None) -> None:
        self.port = PlacerPort(settings, nc, redis)
        self.keeper = StateKeeper(redis)
        self.readiness = ReadinessGate(redis)  # models still converting/profiling, or failed
        self.scaleout = ScaleOut(nc)  # λScale §5: multicasts to the new instances of a turn
        # CoCoServe: the core's module-scaling plans, carried out with the nodes.
        self.modules = ModuleScaler(self.port, settings.modules, settings.module_scaling_s)
        # ServerlessLoRA §4.1: the cluster's pre-loading plan, from the rates every request shows.
        self.preloader = ClusterPreloader(self.port, settings.preload_interval_s)
        self.intake = RequestIntake(self.port, [self.preloader.note])
        # λScale's burst scale-out: the core's extra instances for a model whose demand outgrows
        # the instance just started (off unless settings.core.burst_scaleout).
        self.bursts = BurstStarter(self.port, settings.core, self.scaleout, self.intake.queued_for)
        self.intake.on_arrival.append(self.bursts.note)
        # Pinned models (min_instances): their missing instances started by warm-up requests.
        self.pinning = PinKeeper(self.port, settings.pin_check_s)
        # Predictive pre-warming (off unless settings.core.prewarm): each model's idle times.
        self.prewarmer = Prewarmer(self.port, settings.prewarm, settings.prewarm_check_s)
        self.intake.on_arrival.append(self.prewarmer.note)
        self.intake.on_answer.append(self.prewarmer.answered)
        self._kept_at = -math.inf  # never (monotonic time counts from boot)
        self.errors = 0  # run-loop turns that failed (Redis or NATS trouble)
        self._failing = False
        tel = telemetry or tm.local("placer")
        self._decision_counter = tel.meter("slinfer.placer").create_counter(
            tm.PLACER_DECISIONS, unit="{decision}", description="Placement decisions by action")

    # what tests, benchmarks and operators read (the parts own them)
    @property
    def s(self) -> PlacerSettings:
        return self.port.s

    @s.setter
    def s(self, settings: PlacerSettings) -> None:
        self.port.s = settings

    @property
    def queue(self) -> dict[str, Pending]:
        return self.intake.queue

    @property
    def decisions(self) -> dict[str, int]:
        return self.port.decisions

    @property
    def perf(self) -> PerfModel:
        return self.port.perf

    @property
    def multicast_reports(self):
        return self.scaleout.reports

    async def start(self) -> None:
        await self.intake.start()
        try:
            await self.keeper.check()
        except Exception as exc:
            log.warning("could not read the registry copy at start: %r", exc)
        self.intake.held_since_now()

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
        await self.intake.settled(timeout_s=5.0)  # acks still being retried

    async def turn(self) -> None:
        """One turn of the run loop (raises what Redis or NATS raise)."""
        await self.intake.fetch(timeout=0.05 if self.queue else 0.5)
        await self.intake.keep_claims()
        if time.monotonic() - self._kept_at > KEEPER_CHECK_S:
            await self.keeper.check()
            self._kept_at = time.monotonic()
        if self.queue:
            await self.place_queued()
        await self.modules.turn()  # rate limited (settings.module_scaling_s)
        await self.preloader.turn()  # rate limited (settings.preload_interval_s)
        await self.pinning.turn()  # rate limited (settings.pin_check_s)
        await self.prewarmer.turn()  # rate limited (settings.prewarm_check_s)

    # --- decisions ---------------------------------------------------------------------------
    async def place_queued(self) -> None:
        # A draining node (POST /admin/nodes/{id}/drain) takes no new work; it would refuse it.
        views, listed = await self.port.read_turn()
        nodes = [n for n in views if not n.draining]
        await self.port.refresh_perf()
        records = {r.name: r for r in listed}
        now = time.time()
        for rid in list(self.queue):
            pending = self.queue.get(rid)
            if pending is None or pending.next_try > now:
                continue
            why = self.intake.given_up(pending.request, now)
            if why is not None:
                await self.intake.forget(pending, why)
                continue
            nodes = await self._place_one(pending, nodes, records)
        self.scaleout.start()  # a node whose copy does not arrive loads from its tiers

    async def _place_one(self, p: Pending, nodes: list[NodeView],
                         records: dict[str, ModelRecord]) -> list[NodeView]:
        record = records.get(p.request.model)
        if record is None:
            with decision_span(p, None):
                await self.intake.fail(p, FinishReason.ERROR,
                                       f"model {p.request.model!r} is not registered")
            return nodes
        adapter = records.get(p.request.adapter) if p.request.adapter else None
        ready = await self.readiness.check(record, nodes, self.perf, adapter)
        if ready.verdict is not Verdict.SERVE:  # not profiled yet, or its lifecycle failed
            await hold_or_fail(self.port, self.intake, p, ready)
            return nodes
        if p.unanswered is not None and await self._settled_by_unanswered(p, nodes):
            return nodes
        if p.request.target_node is not None and await self._offer_to_target(p, record, nodes):
            return nodes
        if p.unanswered is not None:  # the target did not answer: asked first, next turn
            return nodes
        specs = {name: model_spec(r) for name, r in records.items()}
        ctx = DecisionContext(nodes, self.perf, time.time(), self.s.core, specs)
        adapter = adapter_spec(p.request, records)
        plan = place(request_view(p.request), specs[record.name], ctx, adapter=adapter)
        self.port.count(plan.action.value)
        self._decision_counter.add(1, {"slinfer.placement.action": plan.action.value})
        self.modules.note(plan, request_view(p.request), specs[record.name], nodes)
        if plan.action is PlaceAction.QUEUE:
            p.queue_decisions += 1
            if p.queue_decisions == 1:  # later ones only counted: re-planned every few tens of ms
                with decision_span(p, plan):
                    pass
            return nodes  # still ours: the intake renews the claim every turn
        p.request = self.prewarmer.with_window(p.request, record)  # (pre-warming on)
        with decision_span(p, plan) as outcome:
            if plan.action is PlaceAction.DROP and p.refused_by_fault:
                # A node failed it; the time its retries took is not overload: say what failed.
                await self.intake.fail(p, FinishReason.ERROR, _refused_message(p))
            elif plan.action is PlaceAction.DROP:
                await self.intake.fail(p, FinishReason.DROPPED, _drop_message(plan))
            else:
                nodes = await self._carry_out(p, plan, record, ctx, outcome, adapter)
        return nodes

    async def _offer_to_target(self, p: Pending, record: ModelRecord, nodes: list[NodeView]) -> bool:
        """A request displaced by a stop-and-resume preemption (or whose live migration failed)
        goes first to the node and instance the plan validated for it (§VIII-A: preempted
        requests are moved, not queued). Only if that node refuses now is it placed afresh. True
        if it was placed. (A live preemption's node moves them itself: shared/core/migration.py.)"""
        req = p.request
        plan = PlacementPlan(PlaceAction.ROUTE, req.target_node, req.target_instance)
        p.request = replace(req, target_node=None, target_instance=None)  # one offer only
        with decision_span(p, plan) as outcome:
            outcome["slinfer.placement.migration"] = True
            reply = await self.port.command(plan.node_id, NodeCommand(
                CommandKind.ADMIT, request=p.request, instance_id=plan.instance_id))
            outcome["slinfer.node.accepted"] = bool(reply and reply.accepted)
            outcome["slinfer.node.reason"] = reply.reason if reply else "no reply"
            if reply is not None and reply.accepted:
                await self._placed(p, plan, reply)
                return True
            if reply is None:
                p.unanswered = plan.node_id
                await self._refused(p, plan.node_id, "no reply")
        log.info("migration target %s/%s refused %s (%s); placing it afresh", plan.node_id,
                 plan.instance_id, req.request_id, reply.reason if reply else "no reply")
        return False

    async def _settled_by_unanswered(self, p: Pending, nodes: list[NodeView]) -> bool:
        """Whether the node that did not answer `p`'s admission settles it: it runs (or ran) the
        request, which is then placed there, or it may, and cannot be asked yet (asked again
        soon). Placing it elsewhere before knowing ran it twice (a NATS restart lost a node's
        "admitted"). It is asked even when out of the cluster view, which a Redis failover can
        empty of a live node for seconds (a multihost run re-placed a request its node had
        finished); silent and out of the view for `node_gone_s`, it is taken for gone. Each
        silence while in the view counts as a refusal."""
        node_id, req = p.unanswered, p.request
        in_view = any(n.node_id == node_id for n in nodes)
        reply = await self.port.command(node_id, NodeCommand(
            CommandKind.STATUS, request_id=req.request_id, attempt=req.attempt))
        now = time.time()
        if reply is None:
            p.silent_since = p.silent_since or now
            if in_view:  # alive by its heartbeats, not answering yet
                # Another refusal by its silence: one that never answers fails the request with
                # that reason after MAX_REFUSALS, as a node that never answered ADMIT did.
                await self._refused(p, node_id, "no reply")
                return True
            if now - p.silent_since < self.s.node_gone_s:
                p.next_try = now + min(1.0, self.s.node_gone_s / 4)  # not a refusal: it may be back
                return True
        if reply is not None and reply.reason in (RequestState.RUNNING.value, RequestState.FINISHED.value):
            p.unanswered = None
            log.info("node %s holds %s (its admission's answer was lost)", node_id, req.request_id)
            await self.intake.placed(p, node_id, reply.instance_id, "admitted, answer lost")
            # The node's own announcement may have been lost with its answer: tell the gateway
            # where the request is, so its watchdog asks that node if the stream stays quiet
            # (its tokens, even its final message, may have gone out while NATS was down).
            await self.port.nc.publish(token_subject(req.request_id),
                                       wire.encode(announcement(req, node_id)))
            return True
        if reply is None:
            log.info("node %s silent and out of the view for %.0f s: placing %s elsewhere",
                     node_id, now - p.silent_since, req.request_id)
        p.unanswered, p.silent_since = None, 0.0  # it never took it (or handed it back, or is
        _judge_from_now(p)  # gone): place it, judged from now, the questions being the fault's
        return False

    async def _placed(self, p: Pending, plan: PlacementPlan, reply: NodeReply) -> None:
        await self.intake.placed(p, plan.node_id, reply.instance_id, plan.action.value)

    async def _carry_out(self, p: Pending, plan: PlacementPlan, record: ModelRecord,
                         ctx: DecisionContext, outcome: dict,
                         adapter: AdapterSpec | None = None) -> list[NodeView]:
        """Send the node the command for `plan` (decided on `ctx`); returns the views with the
        node's answer in them."""
        nodes, new = ctx.nodes, plan.instance_id is None
        cmd = _command_for(p, plan, record)
        burst = None  # planned before the new instance is committed: it prices the instance
        if plan.action is PlaceAction.NEW_INSTANCE:
            burst = self.bursts.plan(p.request, plan, record, ctx, adapter)
        placed = burst.placed if burst is not None else None
        startup = (placed.startup if placed is not None else plan.startup) if new else None
        by_multicast = startup is not None and startup.method is not StartupMethod.TIER
        if by_multicast:  # MULTICAST, or PIPELINE: serving through a pipeline meanwhile
            cmd = with_startup(cmd, startup)
            outcome["slinfer.placement.startup"] = startup_label(startup)
        reply = await self.port.command(plan.node_id, cmd)
        if reply is None:
            _judge_from_now(p)
            p.unanswered = plan.node_id
        outcome["slinfer.node.accepted"] = bool(reply and reply.accepted)
        outcome["slinfer.node.reason"] = reply.reason if reply else "no reply"
        if reply is not None and reply.instance_id:
            outcome["slinfer.placement.instance_id"] = reply.instance_id
        if reply is not None and reply.accepted:
            outcome["slinfer.placement.moved"] = [r.request_id for r in reply.evicted]
            if by_multicast and reply.reason == "admitted":
                nodes = self.scaleout.join(record, startup, plan.node_id, nodes)
            if reply.migrating:
                outcome["slinfer.placement.migrating_live"] = list(reply.migrating)
            await self._placed(p, plan, reply)
        else:
            await self._refused(p, plan.node_id, reply.reason if reply else "no reply")
        if reply is not None and reply.node is not None:  # fresher than Redis: use it
            nodes = [reply.node if n.node_id == reply.node.node_id else n for n in nodes]
        if burst is not None and reply is not None and reply.accepted \
                and reply.reason == "admitted":
            nodes = await self.bursts.start(p.request, record, burst, nodes)
        return nodes

    async def _refused(self, p: Pending, node_id: str, reason: str) -> None:
        p.tries += 1
        p.last_refusal = f"{node_id}: {reason}"
        p.refused_by_fault = reason.startswith(NODE_FAULTS)
        log.info("node %s refused %s: %s", node_id, p.request.request_id, reason)
        if p.tries >= MAX_REFUSALS:
            await self.intake.fail(p, FinishReason.ERROR, _refused_message(p))
        else:
            p.next_try = time.time() + min(1.0, 0.02 * 2**p.tries)


def _judge_from_now(p: Pending) -> None:
    """The node did not answer (it died under the request, or the command was lost): the wait
    was a fault's, not load's. Like a request the gateway resumes, it is judged as a new arrival
    from now on (`resume_grace`), or it would be dropped as late for the seconds a dead node
    cost it; the request's own deadline (the gateway's timeout) still bounds it."""
    req = p.request
    p.request = replace(req, grace_s=grace_from_now(req, len(req.resumed_token_ids), time.time()))


def _command_for(p: Pending, plan: PlacementPlan, record: ModelRecord) -> NodeCommand:
    """The node command that carries `plan` out (without its startup)."""
    new = plan.instance_id is None
    if plan.action is PlaceAction.PREEMPT_AND_ROUTE:  # one command: the node re-checks first
        return NodeCommand(CommandKind.PREEMPT_ADMIT, request=p.request,
                           instance_id=plan.instance_id, model=record if new else None,
                           preempt_instance_ids=list(plan.preempt),
                           migrations=[MigrationTarget(m.request_id, m.to_node, m.to_instance)
                                       for m in plan.migrations],
                           handover_s=plan.handover_s if plan.live else None)
    return NodeCommand(CommandKind.ADMIT, request=p.request, instance_id=plan.instance_id,
                       model=record if new else None)


def _refused_message(p: Pending) -> str:
    return f"refused {p.tries} times (last: {p.last_refusal})"


def _drop_message(plan: PlacementPlan) -> str:
    tried = ", ".join(f"{a.node_id}:{a.reason.value}" for a in plan.attempts) or "no nodes"
    return f"no node can meet the request's TTFT SLO (tried {tried})"

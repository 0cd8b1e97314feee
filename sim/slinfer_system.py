"""SLINFER under simulation: the real policy core (`shared.core`) driving profile-timed nodes.

Nothing here decides anything the services would decide differently. The placer's decision is
`shared.core.placement.place` on the nodes' views; each node is a `NodeScheduler` that re-checks
admissions, picks the next iteration and runs the memory ledger. This module only plays the
engines and the clock: an iteration takes the time the profile predicts, a memory operation takes
its load / resize / unload time, and outcomes are fed back exactly as a node worker would.

Timing of memory operations (the engines' side, not the core's):
- LOAD: the profile's `load_s` (ServerlessLLM loader; the initial KV pool comes with it).
- SCALE: `Profile.kv_scale_s` (Fig. 17's magnitudes); the instance runs no iteration meanwhile
  (the node scheduler blocks an instance with a running op), and the time counts in
  `scaling_time_fraction`.
- UNLOAD: `shared.core.memory.UNLOAD_S`, freeing device memory (ASSUMPTION: tens of ms).
These are the same estimates the node scheduler puts into its timeline (`memop_seconds`).
Iterations take the prediction times `IterationNoise` (the node scheduler still plans with the
prediction, as a real node does).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from shared.core.burst import BurstPlan, plan_burst
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.iteration import IterationChoice, IterationKind
from shared.core.memory import UNLOAD_S, MemOp, MemOpKind, memop_seconds
from shared.core.node_scheduler import AdmitResult, NodeScheduler
from shared.core.perf_model import PerfModel
from shared.core.consolidation import Migration
from shared.core.placement import PlaceAction, PlacementPlan, place
from shared.core.prewarm import IdleTracker, PrewarmConfig, keep_alive_spec, plan_prewarms, stand_in
from shared.core.types import (AdapterSpec, Hardware, InstanceStatus, ModelSpec, NodeView,
                               RequestView)
from sim.cluster_port import SimNode
from sim.engine import Event, EventLoop, IterationNoise, Recorder, SimRequest, Usage
from sim.cocoserve import CoCoServe, node_perf
from sim.report import ADMIT_PREFIX
from sim.scaleout import Multicaster, annotate, start_load
from sim.storage import NodeStorage


@dataclass(frozen=True)
class Incoming:
    """A live migrant its destination admitted at the start of the handover (not batched yet)."""

    node_id: str
    instance_id: str
    request: RequestView


class SlinferSystem:
    name = "slinfer"

    def __init__(self, nodes: list[NodeView], perf: PerfModel, models: dict[str, ModelSpec],
                 config: CoreConfig, noise: IterationNoise | None = None,
                 storage: dict[str, NodeStorage] | None = None,
                 scaleout: Multicaster | None = None,
                 cocoserve: tuple | None = None, prewarm: PrewarmConfig | None = None):
        self.config = config
        self.scaleout = scaleout  # λScale's multicast and execute-while-load (sim/scaleout.py)
        self.noise = noise or IterationNoise(0.0, 0)
        self.perf = perf
        self.models = models
        # CoCoServe (sim/cocoserve.py): each node decides with its own copy of the profiles
        self.nodes = {n.node_id: SimNode(NodeScheduler(n, node_perf(perf) if cocoserve else perf, config),
                                         storage=(storage or {}).get(n.node_id)) for n in nodes}
        self.cocoserve = CoCoServe(self, *cocoserve) if cocoserve else None
        self.reqs: dict[str, SimRequest] = {}  # every request the system has seen, by id
        self.queue: list[RequestView] = []  # placed nowhere yet (QUEUE), FIFO
        self._born: dict[str, float] = {}  # instance id -> creation time (lifetime accounting)
        # model -> its arrival times within the burst window (the placer's record for
        # `shared.core.burst`; kept only with burst scale-out on)
        self._arrivals: dict[str, deque[float]] = {}
        self.loop: EventLoop | None = None
        self.rec: Recorder | None = None
        # Predictive pre-warming (`CoreConfig.prewarm`): the placer's record of every model's
        # idle times, and the models as registered (`self.models` carries the policy's
        # keep-alive, `shared.core.prewarm.keep_alive_spec`).
        self.idle = IdleTracker(prewarm or PrewarmConfig()) if config.prewarm else None
        self._registered = dict(models)
        if config.prewarm:
            self.models = dict(models)  # changed as the policy learns: not the caller's dict

    # --- System protocol ----------------------------------------------------------------------
    def bind(self, loop: EventLoop, rec: Recorder) -> None:
        self.loop, self.rec = loop, rec

    def on_arrival(self, req: SimRequest) -> None:
        self.reqs[req.rid] = req
        self.note_arrival(req.model, req.arrival)
        if self.idle is not None and self.idle.started(req.model, req.arrival):
            windows = self.idle.windows(req.model, self.config.keep_alive_s)
            self.models[req.model] = keep_alive_spec(self._registered[req.model], windows)
        spec = self.models[req.model]
        view = RequestView(req.rid, req.model, req.input_len, req.arrival, req.slo,
                           max_tokens=max(1, spec.max_context - req.input_len))
        self._place(view)

    def note_arrival(self, model: str, at: float) -> None:
        """One arrival of `model` (the placer's `BurstStarter.note`), kept for the burst window."""
        if not self.config.burst_scaleout:
            return
        seen = self._arrivals.setdefault(model, deque())
        seen.append(at)
        while seen[0] <= at - self.config.burst_window_s:
            seen.popleft()

    def handle(self, ev: Event) -> None:
        getattr(self, f"_on_{ev.kind}")(ev.data)

    def usage(self) -> Usage:
        used = {Hardware.CPU: 0, Hardware.GPU: 0}
        alloc = held = 0
        for sn in self.nodes.values():
            node = sn.sched.node
            if node.instances or (self.cocoserve is not None and sn.node_id in self.cocoserve.hosts()):
                used[node.hardware] += 1
            for inst in node.instances:
                alloc += sn.sched.kv_capacity_bytes(inst.instance_id)
                per_token = inst.model.kv_bytes_per_token
                held += per_token * sum(r.context_len() for r in inst.requests if r.prefilled)
        return Usage(used[Hardware.CPU], used[Hardware.GPU], alloc, held)

    def shutdown(self) -> None:
        now = self.loop.now
        for sn in self.nodes.values():
            for inst in sn.sched.node.instances:
                self.rec.add_instance_lifetime(now - self._born.pop(inst.instance_id, now))

    # --- placement ----------------------------------------------------------------------------
    def _views(self, model: str | None = None) -> list[NodeView]:
        """The nodes' state for `place()`. The service publishes copies; here the schedulers'
        own views are passed as they are, because `place()` only reads its inputs
        (tests/core/test_placement.py checks it) and copying every request of every node on
        every placement was most of a run's time."""
        for sn in self.nodes.values():
            self._sync_storage(sn, model)
        return [sn.sched.node for sn in self.nodes.values()]

    def _sync_storage(self, sn: SimNode, model: str | None = None) -> None:
        """The node reports its tiers as they are now (its loader's report, in the service); with
        multicast, a model it would receive sooner than it reads it is in the multicast tier."""
        if sn.storage is not None:
            view = sn.storage.view(self.loop.now)
            if self.scaleout is not None and model is not None:
                view = annotate(view, self.scaleout, sn.storage, model,
                                self.models[model].weight_bytes, sn.node_id,
                                self._holders(model), self.loop.now)
            sn.sched.node.storage = view

    def _holders(self, model: str) -> list[str]:
        """Nodes with a loaded instance of the model or its checkpoint in their DRAM tier."""
        return [sn.node_id for sn in self.nodes.values() if self.scaleout.is_holder(
            sn.node_id, model, [i.instance_id for i in sn.sched.node.instances
                                if i.model.name == model and i.status is InstanceStatus.READY],
            sn.storage is not None and model in sn.storage.dram, self.loop.now)]

    def decide(self, view: RequestView, now: float) -> PlacementPlan:
        """The placement decision on the nodes' views now: the call the placer service makes
        (`Placer._place_one`), with this run's core configuration (tests/sim/test_parity.py)."""
        ctx = DecisionContext(self._views(view.model), self.perf, now, self.config, self.models)
        return place(view, self.models[view.model], ctx, self._adapter(view))

    def _place(self, view: RequestView, from_queue: bool = False) -> bool:
        """Ask the core where the request goes and carry the plan out. True if it went somewhere
        (or was dropped); False if it stays queued."""
        now = self.loop.now
        model = self.models[view.model]
        plan = self.decide(view, now)
        for attempt in plan.attempts:
            self.rec.count(ADMIT_PREFIX + attempt.reason.value)
        if self.cocoserve is not None and plan.action in (
                PlaceAction.NEW_INSTANCE, PlaceAction.QUEUE, PlaceAction.DROP):
            outcome = self.cocoserve.offer(view)  # module-level scale-up, not a new instance
            if outcome == "admitted":
                return True
            if outcome == "wait":  # for replicas in transfer: retried when one is in place
                if not from_queue:
                    self._enqueue(view)
                return False
            if plan.action is not PlaceAction.NEW_INSTANCE and self.cocoserve.memory_pressure(view):
                plan = self.decide(view, now)
        if plan.action is PlaceAction.DROP:
            self._drop(view.request_id)
            return True
        if plan.action is PlaceAction.QUEUE:
            if not from_queue:
                self._enqueue(view)
            return False
        if plan.action is PlaceAction.PREEMPT_AND_ROUTE:
            return self._preempt_and_admit(plan, view)
        if plan.action is PlaceAction.NEW_INSTANCE and self.config.burst_scaleout:
            return self._burst(plan, view, model)
        return self._admit(plan.node_id, plan.instance_id, view)

    def _burst(self, plan: PlacementPlan, view: RequestView, model: ModelSpec) -> bool:
        """λScale's burst scale-out (`shared.core.burst`), as the placer does it: the burst is
        planned before the placed request's instance is committed (the core prices that
        instance at its place in the burst's multicast, `BurstPlan.placed`), the instance is
        admitted, then the instances the model's recent arrivals need start beside it, so one
        multicast feeds them. (Here the nodes receive a model by the simulator's multicaster,
        sim/scaleout.py, which the node's own view of its tiers already prices: the core sees
        a load from a tier, and `placed` is the plan's own.) Returns what `_admit` does."""
        now = self.loop.now
        burst = self.decide_burst(plan, view, now)
        if not self._admit(plan.node_id, None, view):
            return False
        for spot in burst.spots:
            sn = self.nodes[spot.node_id]
            self._sync_storage(sn, view.model)
            result = sn.sched.start_instance(view, model, now)
            self._start_ops(sn, result.start_ops)
            if not result.admission.ok:
                self.rec.count("node_rejections")
                continue
            self.rec.count("cold_starts")
            self.rec.count("burst_instances")
            self._born[result.instance_id] = now
        return True

    def decide_burst(self, plan: PlacementPlan, view: RequestView, now: float) -> BurstPlan:
        """The burst that goes with `plan` on the nodes' views now, before the placed instance
        is committed: the call the placer service makes (`BurstStarter.plan`)."""
        queued = sum(1 for v in self.queue if v.model == view.model and v is not view)
        ctx = DecisionContext(self._views(view.model), self.perf, now, self.config, self.models)
        return plan_burst(plan, view, self.models[view.model], ctx,
                          self._arrivals.get(view.model, ()), queued, self._adapter(view))

    def _adapter(self, view: RequestView) -> AdapterSpec | None:
        """The LoRA adapter the request runs through on its backbone's instance (sim/lora.py
        overrides this; here every model is served whole)."""
        del view
        return None

    def _enqueue(self, view: RequestView) -> None:
        """Wait for the next change in the cluster; dropped once its next token is due (a request
        evicted or moved late in its life may be due already: then at once)."""
        if view in self.queue:
            return
        self.queue.append(view)
        self.loop.schedule(max(self.loop.now, view.deadline()), "deadline", view.request_id)

    def _admit(self, node_id: str, instance_id: str | None, view: RequestView) -> bool:
        sn = self.nodes[node_id]
        now = self.loop.now
        self._sync_storage(sn, view.model)
        result = sn.sched.admit(view, instance_id, self.models[view.model], now, self._adapter(view))
        return self._admitted(sn, view, instance_id is None, result)

    # the ClusterPort (sim/cluster_port.py) that CoCoServe drives this system through
    def start_ops(self, sn: SimNode, ops) -> None:
        self._start_ops(sn, ops)

    def admitted(self, sn: SimNode, view: RequestView, cold: bool, result: AdmitResult) -> bool:
        return self._admitted(sn, view, cold, result)  # (a subclass may refine _admitted)

    def _admitted(self, sn: SimNode, view: RequestView, cold: bool, result: AdmitResult) -> bool:
        """Carry out the node's answer, as the node worker does."""
        now = self.loop.now
        self._start_ops(sn, result.start_ops)
        if not result.admission.ok:  # the node's re-check disagreed: wait for the next change
            self.rec.count("node_rejections")
            self._enqueue(view)
            return False
        if cold:
            self.rec.count("cold_starts")
            self._born[result.instance_id] = now
        self.reqs[view.request_id].grace_s = result.admission.grace_s
        self._kick(sn)
        return True

    def _preempt_and_admit(self, plan: PlacementPlan, view: RequestView) -> bool:
        """§VIII-A as the service does it: one node step that re-checks first; the displaced
        requests go to the destinations the plan validated (placed afresh if those refuse).
        A live plan (the services' default): the victims run on until the handover, then their
        requests move (`_on_handover`)."""
        sn = self.nodes[plan.node_id]
        now = self.loop.now
        result = sn.sched.preempt_and_admit(list(plan.preempt), view, plan.instance_id,
                                            self.models[view.model], now, self._adapter(view),
                                            handover_s=plan.handover_s if plan.live else None)
        if result.admission.ok:
            # a new instance preempts only idle instances the pre-warming policy kept
            self.rec.count("prewarm_gave_way" if plan.instance_id is None else "preemptions",
                           len(plan.preempt))
            if plan.live:
                incoming = self._begin_migrations(result.migrating, plan.migrations)
                self.loop.schedule(now + max(0.0, plan.handover_s), "handover",
                                   (plan.node_id, plan.preempt, incoming))
            else:
                for iid in plan.preempt:
                    self.rec.add_instance_lifetime(now - self._born.pop(iid, now))
        placed = self._admitted(sn, view, plan.instance_id is None, result)
        dest = {m.request_id: m for m in plan.migrations}
        for req in result.evicted:
            self._move_stopped(req, dest.get(req.request_id))
        return placed

    def _move_stopped(self, req: RequestView, move: Migration | None) -> None:
        """Stop-and-resume: the request recomputes its KV cache where it lands, the plan's
        destination first."""
        moved = replace(req, prefilled=False)
        self.rec.count("migrations")
        if move is None or not self._offer(move.to_node, move.to_instance, moved):
            self._place(moved)

    def _begin_migrations(self, moving: tuple[RequestView, ...],
                          migrations: tuple[Migration, ...]) -> tuple[Incoming, ...]:
        """A live preemption's migrations begin (the node workers' MIGRATE_BEGIN): each
        destination the plan validated admits its migrant now, its memory counted but the
        request not batched until the handover commits it (the destination recomputes its KV
        cache meanwhile: that compute is not charged to it here). One a destination refuses
        stays on its victim and moves stop-and-resume at the handover."""
        dest = {m.request_id: m for m in migrations}
        out = []
        for req in moving:
            move = dest.get(req.request_id)
            if move is None:
                continue
            sn = self.nodes[move.to_node]
            self._sync_storage(sn, req.model)
            # as the node workers' MIGRATE_BEGIN: with its tokens so far, its KV cache to
            # recompute there (`shared.cluster.request_view`: not prefilled)
            result = sn.sched.admit(replace(req, prefilled=False), move.to_instance,
                                    self.models[req.model], self.loop.now, self._adapter(req))
            self._start_ops(sn, result.start_ops)
            if not result.admission.ok:
                self.rec.count("migration_refusals")
                continue
            inst = sn.sched.node.instance(result.instance_id)
            held = next(r for r in inst.requests if r.request_id == req.request_id)
            inst.requests.remove(held)  # admitted (memory counted), not batched before the commit
            out.append(Incoming(move.to_node, result.instance_id, held))
        return tuple(out)

    def _on_handover(self, data: tuple[str, tuple[str, ...], tuple[Incoming, ...]]) -> None:
        """A live preemption's handover is due (the plan's estimate of its migrations): each
        migrant the destination admitted at the start joins its batch there with the tokens it
        made on the victim meanwhile (the commit), then the victims are unloaded
        (`NodeScheduler.finish_handover`); their requests left move stop-and-resume. Waits for
        a victim's iteration in flight (the node worker's lock)."""
        sn = self.nodes[data[0]]
        running = sn.sched.node.running
        if sn.busy and running is not None and running.instance_id in data[1]:
            sn.handovers.append(data)  # `_on_iter_done` hands over before the next iteration
            return
        self._hand_over(sn, data)
        self._kick(sn)

    def _hand_over(self, sn: SimNode,
                   data: tuple[str, tuple[str, ...], tuple[Incoming, ...]]) -> None:
        _, victims, incoming = data
        now = self.loop.now
        on_victims = {r.request_id: r for v in victims
                      for r in getattr(sn.sched.node.instance(v), "requests", ())}
        for mig in incoming:
            dest = self.nodes[mig.node_id]
            inst = dest.sched.node.instance(mig.instance_id)
            source = on_victims.get(mig.request.request_id)
            if inst is None or source is None:  # it finished meanwhile, or the instance went
                continue
            inst.requests.append(replace(mig.request, generated=source.generated,
                                         prefilled=True))
            self.rec.count("migrations")
            self._start_ops(sn, sn.sched.cancel(source.request_id, now))
            self._kick(dest)
        for victim in victims:
            left, ops = sn.sched.finish_handover(victim, now)
            self._start_ops(sn, ops)
            self.rec.add_instance_lifetime(now - self._born.pop(victim, now))
            for req in left:
                self._move_stopped(req, None)

    def _offer(self, node_id: str, instance_id: str, view: RequestView) -> bool:
        """A displaced request at the destination the plan validated; False if it refuses now."""
        sn = self.nodes[node_id]
        self._sync_storage(sn, view.model)
        result = sn.sched.admit(view, instance_id, self.models[view.model], self.loop.now,
                                self._adapter(view))
        if not result.admission.ok:
            self.rec.count("migration_refusals")
            return False
        return self._admitted(sn, view, False, result)

    def _retry_queue(self) -> None:
        """Something was freed: give queued requests another placement, oldest first."""
        if not self.queue:
            return
        waiting, self.queue = self.queue, []
        blocked: set[str] = set()  # models that found no room in this round
        for view in waiting:
            if self.reqs[view.request_id].done:
                continue
            # One failed placement per model per round: the next request of that model meets
            # the same cluster (a simulator economy; the deadline still drops it on time).
            if view.model in blocked or not self._place(view, from_queue=True):
                blocked.add(view.model)
                self.queue.append(view)

    def _drop(self, request_id: str) -> None:
        req = self.reqs[request_id]
        if req.done:
            return
        req.dropped = True
        self.rec.count("dropped")
        self.rec.request_done(req)
        self._ended(req)

    # --- predictive pre-warming (`shared.core.prewarm`) ---------------------------------------
    def _ended(self, req: SimRequest) -> None:
        """A call ended: if its model is idle now and its histogram predicts the next call,
        wake up when the pre-warm is due."""
        if self.idle is None or not self.idle.ended(req.model, self.loop.now):
            return
        at = self.idle.prewarm_at(req.model, self.config.keep_alive_s)
        if at is not None:
            self.loop.schedule(max(at, self.loop.now), "prewarm", req.model)

    def _on_prewarm(self, model: str) -> None:
        """Pre-warms due now (the placer's plan), each started by its node's own re-check."""
        now = self.loop.now
        for plan in plan_prewarms(self.idle, self.models, self._views(), self.perf, now,
                                  self.config):
            sn = self.nodes[plan.node_id]
            spec = self.models[plan.model]
            self._sync_storage(sn, plan.model)
            result = sn.sched.start_instance(stand_in(spec, now),
                                             replace(spec, keep_alive_s=plan.keep_alive_s), now)
            self._start_ops(sn, result.start_ops)
            if not result.admission.ok:
                self.rec.count("prewarm_refusals")
                continue
            self.rec.count("prewarms")
            self._born[result.instance_id] = now
            self._kick(sn)

    # --- node execution -----------------------------------------------------------------------
    def _kick(self, sn: SimNode) -> None:
        if sn.busy:
            return
        now = self.loop.now
        plan = sn.sched.step(now)
        self._start_ops(sn, plan.start_ops)
        for ev in plan.evictions:  # §VII-D: memory could not grow; reschedule elsewhere
            self.rec.count("evictions")
            self.reqs[ev.request.request_id].evictions += 1
            self._place(replace(ev.request, prefilled=False))
        if plan.iteration is not None:
            sn.busy = True
            actual = plan.predicted_s * self.noise()
            if self.cocoserve is not None:  # a host first does the replica work queued on it
                actual += self.cocoserve.host_delay(sn.node_id, now)
            if self.scaleout is not None:
                actual += self._pipeline_extra(sn, plan.iteration)
            self.loop.schedule(now + actual, "iter_done", (sn.node_id, plan.iteration, actual))
        self._schedule_reclaim(sn)

    def _on_iter_done(self, data: tuple[str, IterationChoice, float]) -> None:
        node_id, choice, seconds = data
        sn = self.nodes[node_id]
        sn.busy = False
        now = self.loop.now
        hw = sn.sched.node.hardware
        prefill = choice.kind is IterationKind.PREFILL
        self.rec.iteration(now, hw, prefill, len(choice.request_ids), seconds)
        finished: set[str] = set()
        late = sum(self.reqs[rid].late_tokens for rid in choice.request_ids)
        for rid in choice.request_ids:
            req = self.reqs[rid]
            if req.done:  # dropped meanwhile (cannot happen for placed requests; defensive)
                finished.add(rid)
                continue
            if req.first_token_at is None:
                req.first_token_at, req.hardware = now, hw
            req.token(now)
            if req.generated >= req.output_len:
                req.finished_at = now
                self.rec.request_done(req)
                self._ended(req)
                finished.add(rid)
        ops = sn.sched.finish_iteration(choice, now, finished)
        self._start_ops(sn, ops)
        if self.cocoserve is not None:
            self.cocoserve.iteration_ran(choice.instance_id, seconds, now)
            if sum(self.reqs[rid].late_tokens for rid in choice.request_ids) > late:
                self.cocoserve.host_violated(node_id)  # module reduction on an SLO violation
        due, sn.handovers = sn.handovers, []
        for data in due:
            self._hand_over(sn, data)
        if finished:
            self._retry_queue()
        self._kick(sn)

    def _start_ops(self, sn: SimNode, ops) -> None:
        for op in ops:
            seconds = self._op_seconds(sn, op)
            sn.ops_running[op.op_id] = op
            self.loop.schedule(self.loop.now + seconds, "memop_done", (sn.node_id, op))

    def _op_seconds(self, sn: SimNode, op: MemOp) -> float:
        if self.cocoserve is not None and self.cocoserve.owns(op):
            return self.cocoserve.op_seconds(op)
        inst = sn.sched.node.instance(op.instance_id)
        if op.kind is MemOpKind.UNLOAD or inst is None:
            return UNLOAD_S
        profile = self.perf.get(inst.model.name, sn.sched.node.hardware)
        load_s = None
        if op.kind is MemOpKind.LOAD and sn.storage is not None:
            if self.scaleout is not None:
                tier, seconds = start_load(self.scaleout, sn.storage, inst.model.name,
                                           inst.model.weight_bytes, sn.node_id,
                                           self._holders(inst.model.name), self.loop.now,
                                           inst.instance_id)
            else:
                tier, seconds = sn.storage.load(inst.model.name, inst.model.weight_bytes, self.loop.now)
            load_s = seconds + profile.engine_init_s
            self.rec.count(f"loads:{tier}")
        seconds = memop_seconds(op, profile, inst.model.weight_bytes, load_s)
        if op.kind is MemOpKind.SCALE:
            self.rec.add_scaling(seconds)
            self.rec.count("kv_scalings")
        return seconds

    def _pipeline_extra(self, sn: SimNode, choice: IterationChoice) -> float:
        """What an iteration costs beyond the profile while its instance serves in an
        execute-while-load pipeline, or once at its mode switch (sim/scaleout.py)."""
        inst = sn.sched.node.instance(choice.instance_id)
        if inst is None:
            return 0.0
        ids = set(choice.request_ids)
        reqs = [r for r in inst.requests if r.request_id in ids]
        prefill = choice.kind is IterationKind.PREFILL
        tokens = sum(r.context_len() for r in reqs) if prefill else len(reqs)
        if choice.chunk is not None:  # a chunked prefill's chunk carries its own tokens
            tokens = choice.chunk.tokens
        context = sum(r.context_len() for r in inst.requests if r.prefilled)
        return self.scaleout.iteration_extra(inst.instance_id, inst.model.name, tokens, context,
                                             inst.model.kv_bytes_per_token, self._profile_of(sn, inst),
                                             self.loop.now)

    def _profile_of(self, sn: SimNode, inst):
        return self.perf.get(inst.model.name, sn.sched.node.hardware)

    def _on_memop_done(self, data: tuple[str, MemOp]) -> None:
        node_id, op = data
        sn = self.nodes[node_id]
        sn.ops_running.pop(op.op_id, None)
        started = sn.sched.memop_done(op, self.loop.now)
        if self.cocoserve is not None:
            if self.cocoserve.owns(op):
                if self.cocoserve.op_done(node_id, op):
                    self._retry_queue()
            elif op.kind is MemOpKind.UNLOAD:
                self.cocoserve.instance_gone(op.instance_id)
        self._start_ops(sn, started)
        if op.kind is MemOpKind.UNLOAD or not op.grows:
            self._retry_queue()
        self._kick(sn)

    def _schedule_reclaim(self, sn: SimNode) -> None:
        """Keep-alive: wake up when the earliest idle READY instance expires."""
        now = self.loop.now
        # An instance with a memory op in flight cannot be reclaimed yet; its op's completion
        # kicks the node, which comes back here. Each instance has its own window
        # (`shared.core.keepalive`): the core says when the first one runs out.
        at = sn.sched.next_reclaim_at()
        if at is None:
            return
        if at <= now and sn.checked_at == now:
            at = now + self.config.keep_alive_s  # just checked and still there: do not spin
        if sn.reclaim_at is not None and now <= sn.reclaim_at <= at:
            return
        sn.reclaim_at = max(at, now)
        self.loop.schedule(sn.reclaim_at, "reclaim", sn.node_id)

    def _on_reclaim(self, node_id: str) -> None:
        sn = self.nodes[node_id]
        now = self.loop.now
        if sn.reclaim_at is not None and sn.reclaim_at > now:
            return  # superseded by a later check
        sn.reclaim_at = None
        sn.checked_at = now
        idle_before = {i.instance_id for i in sn.sched.node.instances}
        ops = sn.sched.reclaim_idle(now)
        self._start_ops(sn, ops)
        gone = idle_before - {i.instance_id for i in sn.sched.node.instances
                              if i.status is not InstanceStatus.UNLOADING}
        for iid in sorted(gone):
            self.rec.add_instance_lifetime(now - self._born.pop(iid, now))
        self._kick(sn)

    def _on_deadline(self, request_id: str) -> None:
        view = next((v for v in self.queue if v.request_id == request_id), None)
        if view is not None:
            self.queue.remove(view)
            self._drop(request_id)

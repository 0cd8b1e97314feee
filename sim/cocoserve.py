"""CoCoServe in the simulator: module-level scaling (CoCoServe §3-4) on SLINFER's nodes, decided
by the same core planner the placer runs for the node workers
(`shared.core.module_scaling.plan_module_scaling`), executed here in simulated time. Compared
with SLINFER's own instance-level scaling (a new instance).

Scale-up (the planner's `demand`). When the core's placement would start a new instance of a
model, or finds no room (queue / drop), the planner is asked first: the busiest instance of the
model that is alone of its model on its node replicates the layers Algorithm 1 (`scale_up`)
picks onto idle nodes of its kind (nodes that run no request; by default only idle fragments,
nodes that already hold an instance or host replicas: CoCoServe re-uses idle capacity, an empty
node is left to instance-level scaling), one contiguous range per host. Each host holds the
range's bytes (its weights and its share of the instance's K/V pool) through
`NodeScheduler.hold`, a LOAD op that lasts the transfer (the layers' weights over the link plus
CoCoServe Table 2's ~0.25 s floor). Once it ends, the instance's layout names the replica
(`NodeScheduler.set_layout`) and its node decides with `cost.layout_profile`: decode
splits the batch among the replicas (`replicated_profile`, the speedup model on the profile's
own tables, plus the hops); a prefill (one request on one executor) gains nothing. A request
that can wait for the transfer within its TTFT SLO waits in the queue (retried when the
transfer ends) instead of starting a new instance; one that cannot follows the core's plan.

Scale-down (module reduction). A host whose own requests get a token late (`overloaded`)
loses the replicas it hosts, cheapest first (`eviction_order`). A placement that finds no room
on any node (memory pressure on the node that lacked the least, as the placer notes it) drops
the replicas that node hosts, else sheds the fewest layers of one of its instances to a node
with room (`layers_to_shed`): the moved layers then run there (the instance pays the hops,
`pipeline_profile`), their bytes move when the transfer ends; only to a host whose own requests
still meet their TPOT with the moved layers' share of its compute. Every second (the placer's
planner period) shed layers whose node has room again come back (the planner's TAKE, not within
`settle_s` of the shed): the owner reserves their bytes while they cross the link, then its
layout shrinks back and the host lets the stage go. An instance that is unloaded (keep-alive,
preemption) gives its replicas and moved layers back.

Host compute. Every iteration of a split or replicated instance gives each host its share of the
work: the layers it holds over the instance's layers, over their replica count for a replica
(the batch is split evenly). A host's own next iteration waits for the work queued on it. Each
moved layers' stage has a meter of the host's time spent on it (`busy.BusyMeter`, the core's
`busy_window_s`), started when the owner attaches the stage; once it has measured a window, the
host's core counts the measured share (`NodeScheduler.stage_measured`) in its own admissions
instead of the planner's prediction (`module_scaling.predicted_load`, which the owner's measured
busy fraction gives). Replicas it does not count (they yield: dropped once its requests run
late), so their interference shows as late tokens.

Not modelled: the paper's fixed 39 ms inter-replica coordination (a hop here is one activation
transfer over the link), projections as modules (layers only), the K/V of requests in flight
moving with shed layers (their transfer time; the bytes are accounted).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.core.busy import BusyMeter
from shared.core.context import DecisionContext
from shared.core.cost import layer_weight_bytes, layout_replication, run_layer_work
from shared.core.memory import UNLOAD_S, MemOp, MemOpKind
from shared.core.module_scaling import (MemoryPressure, ModuleAction, ModulePlan, ModuleSettings,
                                        memory_deficit, plan_module_scaling)
from shared.core.modules import stage_key
from shared.core.perf_model import PerfModel
from shared.core.types import InstanceLayout, InstanceStatus, RequestView
from sim.cluster_port import ClusterPort


TAKE_MARK = "/take"  # a take's reservation on the owner (services/node/layer_moves.py's)
TAKE_EVERY_S = 1.0  # the placer's SLINFER_MODULE_SCALING_S default
REPLICA_FIXED_S = 0.25  # CoCoServe Table 2: moving one layer takes 0.25-0.3 s, 40 layers 0.8-0.9 s
STEP_LATENCY_S = 50e-6  # one activation transfer's latency (as sim/scaleout.py's step)


@dataclass
class Transfer:
    """A plan whose layers are on their way (its hold's LOAD op is under way): to the host, or
    back to the owner (a take: the owner reserves their bytes while they come)."""

    plan: ModulePlan
    key: str  # the hold's ledger entry: the stage key (also the stage's "address") or a take's
    ready_at: float  # when the transfer should end (estimated)
    node: str = ""  # where the hold is (the host; the owner for a take)


class CoCoServe:
    """Carries the core's module-scaling plans out in the simulator."""

    def __init__(self, system: ClusterPort, link_gbps: float, layers: dict[str, int],
                 hidden: dict[str, int], empty_hosts: bool = False) -> None:
        if not link_gbps > 0:
            raise ValueError("cocoserve link_gbps must be > 0")
        self.sys = system
        self.link_bytes_per_s = link_gbps * 1e9 / 8
        self.settings = ModuleSettings(hop_latency_s=STEP_LATENCY_S,
                                       link_bytes_per_s=self.link_bytes_per_s, shed=True,
                                       replicate=True, spikes=False, empty_hosts=empty_hosts)
        # The models' layer counts and activation sizes (16-bit), which the planner needs; the
        # weights are spread over the layers (no separate head: what a layer costs to move).
        for model, spec in list(system.models.items()):
            if model in layers:
                system.models[model] = replace(spec, layers=layers[model], head_bytes=0,
                                               token_bytes=2 * hidden[model])
        self.transfers: dict[str, Transfer] = {}  # stage key -> its transfer
        self.layouts: dict[str, InstanceLayout] = {}  # instance -> its layout (until unloaded)
        self.op_s: dict[int, float] = {}  # op id -> its duration (the ops this controller made)
        self.host_work: dict[str, float] = {}  # host -> until when its share keeps it busy
        self.meters: dict[str, BusyMeter] = {}  # a moved stage's key -> its host's time on it
        self.shed_at: dict[str, float] = {}  # instance -> when its last shed ended
        self.next_take = 0.0  # when shed layers are next looked at for taking back

    # --- queries ------------------------------------------------------------------------------
    def hosts(self) -> set[str]:
        return {r.node_id for lay in self.layouts.values() for r in lay.runs} | \
            {t.plan.host_node for t in self.transfers.values()}

    def _nodes(self):
        return [sn.sched.node for sn in self.sys.nodes.values()]  # read only by the planner

    def _busy(self) -> frozenset[str]:
        return frozenset(t.plan.instance_id for t in self.transfers.values())

    def _plan(self, **inputs) -> list[ModulePlan]:
        now = self.sys.loop.now
        stay = frozenset(i for i, t in self.shed_at.items() if now - t < self.settings.settle_s)
        ctx = DecisionContext(self._nodes(), self.sys.perf, now, self.sys.config)
        return plan_module_scaling(ctx, inputs.pop("pressures", []), self.settings,
                                   self._busy(), stay=stay, **inputs)

    # --- scale-up (the planner's demand) ------------------------------------------------------
    def offer(self, view: RequestView) -> str | None:
        """Before a new instance (or queueing): "admitted" if a replicated instance of the model
        took the request; "wait" if replicas of one are in transfer (started now or before) and
        the request can wait for them within its TTFT SLO; None: follow the core's plan."""
        for iid, layout in self.layouts.items():
            if layout.model.name == view.model and self._try_admit(iid, view):
                return "admitted"
        plans = self.scale_up_plans(view)
        if any(p.action is ModuleAction.REPLICATE for p in plans):
            self.sys.rec.count("cocoserve_scale_ups")
        for plan in plans:
            self._carry(plan)
        now = self.sys.loop.now
        waiting = [t for t in self.transfers.values() if t.plan.action is ModuleAction.REPLICATE
                   and self._model(t.plan) == view.model]
        if any(self._can_wait(view, t, now) for t in waiting):
            return "wait"
        return None

    def scale_up_plans(self, view: RequestView) -> list[ModulePlan]:
        """The planner's answer to one request of demand (what the placer's module scaler passes
        it for a placement that needs a new instance or finds no room)."""
        return self._plan(demand=[view])

    def _can_wait(self, view: RequestView, t: Transfer, now: float) -> bool:
        """Its first token still in time if its prefill starts once the replicas are in place."""
        profile = self.sys.perf.get(view.model, self.sys.nodes[t.plan.owner_node].sched.node.hardware)
        prefill = profile.prefill_s(view.context_len())
        return max(t.ready_at, now) + prefill * (1 + self.sys.config.overestimate) <= view.deadline()

    def _model(self, plan: ModulePlan) -> str:
        inst = self.sys.nodes[plan.owner_node].sched.node.instance(plan.instance_id)
        return inst.model.name if inst is not None else ""

    def _try_admit(self, instance_id: str, view: RequestView) -> bool:
        node_id = next((sn.node_id for sn in self.sys.nodes.values()
                        if sn.sched.node.instance(instance_id) is not None), None)
        if node_id is None:
            return False
        sn = self.sys.nodes[node_id]
        result = sn.sched.admit(view, instance_id, self.sys.models[view.model], self.sys.loop.now)
        if not result.admission.ok:
            self.sys.start_ops(sn, result.start_ops)
            return False
        return self.sys.admitted(sn, view, False, result)

    # --- carrying plans out ---------------------------------------------------------------------
    def _carry(self, plan: ModulePlan) -> None:
        if plan.action is ModuleAction.DROP_REPLICA:
            self._drop(plan)
            return
        now = self.sys.loop.now
        take = plan.action is ModuleAction.TAKE
        node_id = plan.owner_node if take else plan.host_node
        sn = self.sys.nodes[node_id]
        owner = self.sys.nodes[plan.owner_node].sched.node.instance(plan.instance_id)
        if take:  # the owner reserves what its instance grows by (the node worker's take)
            key = f"{plan.instance_id}{TAKE_MARK}"
            nbytes = plan.owner_bytes_after - (owner.model.weight_bytes + owner.kv_bytes)
        else:
            key = stage_key(plan.instance_id, plan.start, plan.end)
            nbytes = plan.host_bytes
        ok, ops = sn.sched.hold(key, nbytes, now, load=plan.load)
        if not ok:  # the node's budget moved since the plan: not there
            return
        full = owner.layout.model if owner.layout is not None else owner.model
        layer_bytes = layer_weight_bytes(full, full.layers, full.head_bytes)
        seconds = (plan.end - plan.start) * layer_bytes / self.link_bytes_per_s + REPLICA_FIXED_S
        for op in ops:
            self.op_s[op.op_id] = seconds
        # a parked hold starts once the node's ops under way end (as the core estimates it)
        self.transfers[key] = Transfer(plan, key, max(now, sn.sched.node.memops_until) + seconds,
                                       node_id)
        if plan.action is ModuleAction.SHED:
            self.sys.rec.count("cocoserve_migrations")
        self.sys.start_ops(sn, ops)

    def _drop(self, plan: ModulePlan) -> None:
        """The owner stops using the replica at once; the host frees it (an unload)."""
        osn = self.sys.nodes[plan.owner_node]
        layout = self.layouts.get(plan.instance_id)
        if layout is not None and osn.sched.node.instance(plan.instance_id) is not None:
            runs = tuple(r for r in layout.runs if r.address != plan.address)
            self._set_layout(osn, plan.instance_id, replace(layout, runs=runs))
        self.sys.rec.count("cocoserve_replicas_evicted", plan.end - plan.start)
        self._release(plan.host_node, plan.address)

    def _release(self, host: str, key: str) -> None:
        self.meters.pop(key, None)
        hsn = self.sys.nodes[host]
        t = self.transfers.pop(key, None)
        if t is not None and t.node:
            hsn = self.sys.nodes[t.node]  # (a take's reservation is on the owner)
        _, ops = hsn.sched.hold(key, 0, self.sys.loop.now)
        self.sys.start_ops(hsn, ops)

    def _set_layout(self, sn, instance_id: str, layout: InstanceLayout) -> bool:
        ok, ops = sn.sched.set_layout(instance_id, layout, self.sys.loop.now)
        if not ok:
            return False
        for op in ops:  # the engine's memory changed with the move: only the ledger follows
            self.op_s[op.op_id] = UNLOAD_S
        if layout.runs:
            self.layouts[instance_id] = layout
        else:
            self.layouts.pop(instance_id, None)
        self.sys.start_ops(sn, ops)
        return True

    # --- host compute -------------------------------------------------------------------------
    def iteration_ran(self, instance_id: str, seconds: float, now: float) -> None:
        """A split or replicated instance ran an iteration of `seconds`: its hosts did their share.
        (Also the simulator's clock for the placer's periodic planner run: moved layers are
        looked at for taking back every TAKE_EVERY_S.)"""
        if now >= self.next_take:
            self.next_take = now + TAKE_EVERY_S
            for key in list(self.meters):  # (idle stages' loads decay too)
                host = self._host_of(key)
                if host is not None:
                    self._measured(key, host, now)
            self._take_back()
        layout = self.layouts.get(instance_id)
        if layout is None:
            return
        layers = layout.model.layers
        degrees = layout_replication(layout).degrees()
        for run in layout.runs:
            work = seconds * run_layer_work(run, degrees) / layers
            start = max(now, self.host_work.get(run.node_id, 0.0))
            self.host_work[run.node_id] = start + work
            meter = self.meters.get(run.address)
            if meter is not None:
                self.meters[run.address] = meter.observe(start, start + work)
                self._measured(run.address, run.node_id, now)

    def _measured(self, key: str, host: str, now: float) -> None:
        """`host` counts the stage's measured share once it has measured a window."""
        meter = self.meters[key]
        if meter.observed_s(now) >= meter.window_s:
            self.sys.nodes[host].sched.stage_measured(key, meter.fraction(now))

    def _host_of(self, key: str) -> str | None:
        return next((r.node_id for lay in self.layouts.values() for r in lay.runs
                     if r.address == key), None)

    def _take_back(self) -> None:
        """The planner's take-back plans (shed layers whose node has room again), carried out."""
        if not any(not r.replica for lay in self.layouts.values() for r in lay.runs):
            return
        for plan in self._plan():
            if plan.action is ModuleAction.TAKE:
                self.sys.rec.count("cocoserve_takes")
            self._carry(plan)

    def host_delay(self, node_id: str, now: float) -> float:
        """How long the host's own iteration starting now waits for queued replica work."""
        return max(0.0, self.host_work.get(node_id, 0.0) - now)

    # --- scale-down (module reduction) --------------------------------------------------------
    def host_violated(self, node_id: str) -> None:
        """A host's own request got a token late: the replicas it hosts go, cheapest first."""
        if node_id not in self.hosts():
            return
        self.sys.rec.count("cocoserve_host_violations")
        for plan in self.overload_plans(node_id):
            self._carry(plan)

    def overload_plans(self, node_id: str) -> list[ModulePlan]:
        """The planner's answer to a host whose own request ran late (the placer's module scaler
        sees the host's `late_tokens` rise)."""
        return self._plan(overloaded=[node_id])

    def memory_pressure(self, view: RequestView) -> bool:
        """No node had room: module reduction on the node that lacked the least for a new
        instance of the request's model. True if anything was planned."""
        spec = self.sys.models[view.model]
        deficits = [(memory_deficit(n, spec, view), n.node_id) for n in self._nodes()
                    if n.hardware in self._servable(view.model)]
        deficits = [d for d in deficits if d[0] > 0]
        if not deficits:
            return False
        deficit, node_id = min(deficits)
        plans = self._plan(pressures=[MemoryPressure(node_id, deficit)])
        for plan in plans:
            self._carry(plan)
        return bool(plans)

    def _servable(self, model: str) -> set:
        return {hw for (m, hw) in self.sys.perf.profiles if m == model}

    # --- memory ops and instance lifetimes ----------------------------------------------------
    def owns(self, op: MemOp) -> bool:
        return op.op_id in self.op_s or op.instance_id in self.transfers

    def op_seconds(self, op: MemOp) -> float:
        return self.op_s.pop(op.op_id, UNLOAD_S)

    def op_done(self, node_id: str, op: MemOp) -> bool:
        """A hold completed: a transfer ended, the owner now uses the layers there. True if that
        changed an instance (retry the queue)."""
        t = self.transfers.get(op.instance_id)
        if t is None or op.kind is not MemOpKind.LOAD or node_id != t.node:
            return False
        if self.sys.nodes[node_id].sched.ledger.busy(op.instance_id):
            return False  # a later change of this hold is still under way
        if t.plan.action is ModuleAction.TAKE:
            return self._taken(t)
        del self.transfers[t.key]
        plan = t.plan
        osn = self.sys.nodes[plan.owner_node]
        inst = osn.sched.node.instance(plan.instance_id)
        if inst is None or inst.status is not InstanceStatus.READY or \
                not self._set_layout(osn, plan.instance_id,
                                     plan.layout_after(inst, t.key, self.settings)):
            self._release(node_id, t.key)  # the instance went (or changed) meanwhile
            return False
        if plan.action is ModuleAction.SHED:
            self.shed_at[plan.instance_id] = self.sys.loop.now
            self.meters[t.key] = BusyMeter.start(self.sys.config.busy_window_s, self.sys.loop.now)
        return True

    def _taken(self, t: Transfer) -> bool:
        """A take's layers are here: the reservation becomes the instance's own bytes, the
        host lets the stage go. True if the instance changed."""
        plan = t.plan
        osn = self.sys.nodes[plan.owner_node]
        self._release(plan.owner_node, t.key)
        inst = osn.sched.node.instance(plan.instance_id)
        if inst is None or inst.status is not InstanceStatus.READY or \
                not self._set_layout(osn, plan.instance_id,
                                     plan.layout_after(inst, "", self.settings)):
            return False  # gone (its stages go with it) or no room after all: they stay there
        self._release(plan.host_node, plan.address)
        return True

    def instance_gone(self, instance_id: str) -> None:
        layout = self.layouts.pop(instance_id, None)
        for run in layout.runs if layout is not None else ():
            self._release(run.node_id, run.address)
        for key, t in list(self.transfers.items()):
            if t.plan.instance_id == instance_id:
                self._release(t.node, key)


def node_perf(perf: PerfModel) -> PerfModel:
    """A node's own copy of the profiles (kept for callers; layouts need no per-node copies)."""
    return PerfModel(dict(perf.profiles))

"""CoCoServe in the simulator: module-level scaling (CoCoServe §3-4) on SLINFER's nodes, with the
plans of `shared.core.modules` (speedup model, `scale_up` = Algorithm 1, `module_reduction` =
Algorithm 2's order). Compared with SLINFER's own instance-level scaling (a new instance).

Scale-up. When the core's placement would start a new instance of a model, or finds no room
(queue / drop), and an instance of the model is loaded (the only one of its model on its node),
that instance first tries to replicate decoder layers onto hosts: other nodes of its hardware
kind that run no request of their own now and already hold an instance (CoCoServe re-uses idle
fragments rather than new capacity: an empty node is left to instance-level scaling), as many
layers as their free memory takes. `scale_up` picks the layers (contiguous runs first, each kept
only if it raises the modelled speedup). Once a replica's transfer has ended, the instance's node
decides with the instance's profile divided by the speedup of the replicas in place (prefill and
decode tables): the core's shadow validation admits against the replicated instance's cost (each
node has its own copy of the profiles for this). A request that can wait for the transfer within
its TTFT SLO waits in the queue (retried when the transfer ends) instead of starting a new
instance; one that cannot follows the core's plan.

Accounting. The replica's bytes (weights / layers per layer; its share of the KV cache is not
counted) are held on the host through `NodeScheduler.hold`, so the host's budget, the placer's
view and the reservation station see them; the hold's LOAD op lasts the transfer (layer bytes
over the link plus CoCoServe Table 2's ~0.25 s floor). A node hosting replicas counts as used.

Host compute. Every iteration of a replicated instance gives each host its share of the work:
for each layer it holds, that layer's time over the layer's replica count (the batch is split
evenly, Eq. 4). A host's own next iteration waits for the replica work queued on it; its core
does not know (it plans as if the node were its own), so interference shows as late tokens.

Scale-down (module reduction). A host whose own requests get a token late (an SLO violation)
sheds its replicas; a placement that finds no room on any node (memory pressure) sheds replicas
from hosts until one could take a new instance of the request's model. Each shed follows
`module_reduction`: migrate the host's replicas to another idle host with room (MIGRATE), else
evict them in `eviction_order` (the one whose loss costs the least speedup first). Reducing the
batch (its last phase) is SLINFER's own eviction. An instance that is unloaded (keep-alive,
preemption) drops its replicas.

Not modelled: the replica's KV share, the paper's fixed 39 ms inter-replica coordination (the
hop cost here is one activation transfer over the link), projections as modules (layers only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from shared.core.memory import UNLOAD_S, MemOp, MemOpKind, kv_demand
from shared.core.modules import Device, Reduction, Replication, module_reduction, scale_up, speedup
from shared.core.perf_model import PerfModel, Profile
from shared.core.types import InstanceStatus, RequestView

if TYPE_CHECKING:
    from sim.slinfer_system import SimNode, SlinferSystem

REPLICA_FIXED_S = 0.25  # CoCoServe Table 2: moving one layer takes 0.25-0.3 s, 40 layers 0.8-0.9 s
STEP_LATENCY_S = 50e-6  # one activation transfer's latency (as sim/scaleout.py's step)
HOP_BATCH = 16  # the batch the hop cost C is taken at (a decode step of 16 requests)
HOP_CONTEXT = 1024
REPLICA_SEP = "~rep@"


def replica_key(instance_id: str, host: str) -> str:
    return f"{instance_id}{REPLICA_SEP}{host}"


def scaled(profile: Profile, factor: float) -> Profile:
    """The profile with every prefill and decode time multiplied by `factor`."""
    return replace(profile,
                   prefill=replace(profile.prefill, seconds=[s * factor for s in profile.prefill.seconds]),
                   decode=replace(profile.decode, seconds=[[s * factor for s in row]
                                                           for row in profile.decode.seconds]))


@dataclass
class Replicated:
    instance_id: str
    node_id: str
    model: str
    base: Profile  # the instance's own profile (no replicas)
    rep: Replication
    hop_cost: float
    layer_bytes: int
    loaded: set[str] = field(default_factory=set)  # hosts whose replica transfer has ended

    def planned(self) -> float:
        return speedup(self.rep, self.hop_cost)

    def pending(self) -> bool:
        return any(h not in self.loaded for h in self.rep.on)

    def active(self) -> float:
        live = Replication(self.rep.layers, {d: set(h) for d, h in self.rep.on.items()
                                             if d in self.loaded})
        return speedup(live, self.hop_cost)


class CoCoServe:
    """The controller: scale-up by layer replication, module reduction under pressure."""

    def __init__(self, system: SlinferSystem, link_gbps: float, layers: dict[str, int],
                 hidden: dict[str, int], empty_hosts: bool = False) -> None:
        if not link_gbps > 0:
            raise ValueError("cocoserve link_gbps must be > 0")
        self.sys = system
        # False: fragments only (nodes already holding an instance); True: empty nodes too
        self.empty_hosts = empty_hosts
        self.link_bytes_per_s = link_gbps * 1e9 / 8
        self.layers = layers  # model -> decoder layers
        self.hidden = hidden  # model -> hidden size
        self.replicated: dict[str, Replicated] = {}  # instance id -> its replicas
        self.op_s: dict[int, float] = {}  # replica op id -> its duration
        self.ready: dict[str, float] = {}  # replica key -> when its transfer ends (estimated)
        self.host_work: dict[str, float] = {}  # host -> until when replica work keeps it busy

    # --- queries ------------------------------------------------------------------------------
    def hosts(self) -> set[str]:
        return {h for r in self.replicated.values() for h in r.rep.on}

    def hop_cost(self, model: str, base: Profile) -> float:
        """C of the speedup model: one activation transfer over the link per one layer's compute."""
        hop = STEP_LATENCY_S + HOP_BATCH * self.hidden[model] * 2 / self.link_bytes_per_s
        return hop / (base.decode_s(HOP_BATCH, HOP_CONTEXT) / self.layers[model])

    # --- scale-up (Algorithm 1) ---------------------------------------------------------------
    def offer(self, view: RequestView) -> str | None:
        """Before a new instance (or queueing): "admitted" if a replicated instance of the model
        took the request; "wait" if replicas of one are in transfer (started now or before) and
        the request can wait for them within its TTFT SLO; None: follow the core's plan."""
        mine = [r for r in self.replicated.values() if r.model == view.model]
        for r in mine:
            if r.loaded and self._try_admit(r.node_id, r.instance_id, view):
                return "admitted"
        now = self.sys.loop.now
        waiting = [r for r in mine if r.pending()]
        for sn, inst in self._candidates(view.model):
            if inst.instance_id not in self.replicated or not self.replicated[inst.instance_id].pending():
                if self._scale_up(sn, inst):
                    self.sys.rec.count("cocoserve_scale_ups")
                    waiting.append(self.replicated[inst.instance_id])
        if any(self._can_wait(view, r, now) for r in waiting):
            return "wait"
        return None

    def _ready_at(self, r: Replicated) -> float:
        return max((self.ready.get(replica_key(r.instance_id, h), 0.0) for h in r.rep.on
                    if h not in r.loaded), default=self.sys.loop.now)

    def _can_wait(self, view: RequestView, r: Replicated, now: float) -> bool:
        """Its first token still in time if its prefill starts once the replicas are in place."""
        prefill = r.base.prefill_s(view.context_len()) / r.planned()
        return max(self._ready_at(r), now) + prefill * (1 + self.sys.config.overestimate) \
            <= view.deadline()

    def _candidates(self, model: str):
        """Loaded instances of the model, alone of their model on their node, largest batch first."""
        out = []
        for sn in self.sys.nodes.values():
            mine = [i for i in sn.sched.node.instances if i.model.name == model]
            if len(mine) == 1 and mine[0].status is InstanceStatus.READY:
                out.append((sn, mine[0]))
        return sorted(out, key=lambda x: (-x[1].batch_size, x[0].node_id))

    def _devices(self, sn: SimNode, model: str, layer_bytes: int) -> list[Device]:
        """Idle fragments: nodes of the instance's kind holding an instance but running no
        request (with `empty_hosts`, empty nodes after them), with room for a layer; the most
        free memory first."""
        hw = sn.sched.node.hardware
        out = []
        for other in self.sys.nodes.values():
            node = other.sched.node
            if other is sn or node.hardware is not hw or node.draining:
                continue
            empty = not node.instances and other.node_id not in self.hosts()
            if empty and not self.empty_hosts:
                continue
            if any(i.requests for i in node.instances):
                continue
            free = node.memory_bytes - node.budget_bytes
            if free >= layer_bytes:
                out.append((empty, free, node.node_id))
        out.sort(key=lambda x: (x[0], -x[1], x[2]))
        return [Device(name, min(self.layers[model], free // layer_bytes)) for _, free, name in out]

    def _scale_up(self, sn: SimNode, inst) -> bool:
        model = inst.model.name
        r = self.replicated.get(inst.instance_id)
        if r is None:
            base = self.sys.perf.get(model, sn.sched.node.hardware)
            r = Replicated(inst.instance_id, sn.node_id, model, base, Replication(self.layers[model]),
                           self.hop_cost(model, base), inst.model.weight_bytes // self.layers[model])
        devices = self._devices(sn, model, r.layer_bytes)
        if not devices:
            return False
        grown = scale_up(r.rep, devices, r.hop_cost)
        grown.on = {d: h for d, h in grown.on.items() if h}
        if speedup(grown, r.hop_cost) <= r.planned() + 1e-9:
            return False
        self.replicated[inst.instance_id] = r
        self._apply(r, grown)
        return True

    def _apply(self, r: Replicated, target: Replication) -> None:
        """Move the instance's replicas to `target` (a copy the caller gives up): hold / release
        bytes on the hosts, and let the instance's node decide with the new speedup."""
        now = self.sys.loop.now
        for host in sorted(set(r.rep.on) | set(target.on)):
            before, after = len(r.rep.on.get(host, ())), len(target.on.get(host, ()))
            if before == after and r.rep.on.get(host) == target.on.get(host):
                continue
            hsn = self.sys.nodes[host]
            ok, ops = hsn.sched.hold(replica_key(r.instance_id, host), after * r.layer_bytes, now)
            if not ok:  # the host's budget moved since the plan: no replica there
                target.on.pop(host, None)
                continue
            seconds = (after - before) * r.layer_bytes / self.link_bytes_per_s + REPLICA_FIXED_S
            for op in ops:
                if after > before:
                    self.op_s[op.op_id] = seconds
            # a parked hold starts once the host's ops under way end (as the core estimates it)
            self.ready[replica_key(r.instance_id, host)] = max(now, hsn.sched.node.memops_until) + seconds
            r.loaded.discard(host)  # its transfer (or release) is under way
            self.sys._start_ops(hsn, ops)
        r.rep = Replication(target.layers, {d: set(h) for d, h in target.on.items() if h})
        self._set_profile(r)
        if not r.rep.on:
            del self.replicated[r.instance_id]

    def _set_profile(self, r: Replicated) -> None:
        """The instance's node decides with the speedup of the replicas in place."""
        sn = self.sys.nodes[r.node_id]
        sn.sched.perf.add(scaled(r.base, 1.0 / r.active()))

    def _try_admit(self, node_id: str, instance_id: str, view: RequestView) -> bool:
        sn = self.sys.nodes[node_id]
        result = sn.sched.admit(view, instance_id, self.sys.models[view.model], self.sys.loop.now)
        if not result.admission.ok:
            self.sys._start_ops(sn, result.start_ops)
            return False
        return self.sys._admitted(sn, view, False, result)

    # --- host compute -------------------------------------------------------------------------
    def iteration_ran(self, instance_id: str, seconds: float, now: float) -> None:
        """A replicated instance ran an iteration of `seconds`: its hosts did their share."""
        r = self.replicated.get(instance_id)
        if r is None or not r.loaded:
            return
        layer_s = seconds * r.active() / r.rep.layers  # one layer's time with the whole batch
        degrees = r.rep.degrees()
        for host in sorted(r.loaded & set(r.rep.on)):
            work = layer_s * sum(1 / degrees[i] for i in r.rep.on[host])
            self.host_work[host] = max(now, self.host_work.get(host, 0.0)) + work

    def host_delay(self, node_id: str, now: float) -> float:
        """How long the host's own iteration starting now waits for queued replica work."""
        return max(0.0, self.host_work.get(node_id, 0.0) - now)

    # --- scale-down (Algorithm 2's order) -----------------------------------------------------
    def host_violated(self, node_id: str) -> None:
        """A host's own request got a token late: its replicas go (migrated, else evicted)."""
        for r in [r for r in self.replicated.values() if node_id in r.rep.on]:
            self.sys.rec.count("cocoserve_host_violations")
            self._reduce(r, node_id, need_bytes=None)

    def memory_pressure(self, view: RequestView) -> bool:
        """No node had room: shed replicas until some host could take a new instance of the
        request's model. True if anything was shed."""
        spec = self.sys.models[view.model]
        need = spec.weight_bytes + kv_demand(spec, [view])
        shed = False
        for host in sorted(self.hosts()):
            for r in [r for r in self.replicated.values() if host in r.rep.on]:
                node = self.sys.nodes[host].sched.node
                if node.memory_bytes - node.budget_bytes >= need:
                    break
                self._reduce(r, host, need_bytes=need)
                shed = True
        return shed

    def _reduce(self, r: Replicated, host: str, need_bytes: int | None) -> None:
        """`module_reduction` on one pressured host: migrate its replicas to an idle host with
        room, else evict them in order (all, or until the host has `need_bytes` free)."""
        moving = len(r.rep.on[host]) * r.layer_bytes
        targets = [d.name for d in self._devices(self.sys.nodes[r.node_id], r.model, r.layer_bytes)
                   if d.name not in r.rep.on and d.name != host
                   and self._free(d.name) >= moving]
        node = self.sys.nodes[host].sched.node
        for step in module_reduction(r.rep, r.hop_cost, targets):
            if step.action is Reduction.MIGRATE:
                target = Replication(r.rep.layers, {d: set(h) for d, h in r.rep.on.items()})
                target.on[step.device] = target.on.pop(host)
                self.sys.rec.count("cocoserve_migrations")
                self._apply(r, target)
                return
            if step.action is Reduction.EVICT_REPLICA and step.device == host:
                target = Replication(r.rep.layers, {d: set(h) for d, h in r.rep.on.items()})
                target.on[host].discard(step.layer)
                self.sys.rec.count("cocoserve_replicas_evicted")
                self._apply(r, target)
                if host not in r.rep.on or (need_bytes is not None
                                            and node.memory_bytes - node.budget_bytes >= need_bytes):
                    return

    def _free(self, node_id: str) -> int:
        node = self.sys.nodes[node_id].sched.node
        return node.memory_bytes - node.budget_bytes

    # --- memory ops and instance lifetimes ----------------------------------------------------
    def owns(self, op: MemOp) -> bool:
        return REPLICA_SEP in op.instance_id

    def op_seconds(self, op: MemOp) -> float:
        return self.op_s.pop(op.op_id, UNLOAD_S)

    def op_done(self, node_id: str, op: MemOp) -> bool:
        """A replica's hold completed; True if it made the instance faster (retry the queue)."""
        iid = op.instance_id.split(REPLICA_SEP, 1)[0]
        r = self.replicated.get(iid)
        if r is None or op.kind is not MemOpKind.LOAD or node_id not in r.rep.on:
            return False
        if self.sys.nodes[node_id].sched.ledger.busy(op.instance_id):
            return False  # a later change of this replica is still under way
        r.loaded.add(node_id)
        self._set_profile(r)
        return True

    def instance_gone(self, instance_id: str) -> None:
        r = self.replicated.get(instance_id)
        if r is not None:
            self._apply(r, Replication(r.rep.layers))
            self.sys.nodes[r.node_id].sched.perf.add(r.base)


def node_perf(perf: PerfModel) -> PerfModel:
    """A node's own copy of the profiles (a replicated instance's node decides with its speedup)."""
    return PerfModel(dict(perf.profiles))

"""When to scale instances by modules (CoCoServe §3-4), as plans the placer carries out with the
node workers and the simulator executes in time: the decisions over `shared.core.modules`' cost
and memory models.

- Memory pressure (a request refused for memory on a node): module reduction's first action
  (Algorithm 2). Replicas that node hosts for other instances go first (`eviction_order`), then
  a running instance there sheds the fewest layers that free the deficit (`layers_to_shed`) to
  a node of its kind with that much free memory (`plan_layer_move`), instead of the request
  waiting for an eviction or queueing. The instance keeps its requests; its K/V of the moved
  layers goes with them (services/node/engines/split.py's `Split.shed`).
- A load spike (an instance whose decode step with its batch breaks the batch's TPOT SLO, as
  its profile with its layout predicts) while another node of its kind runs nothing: replicate
  the layers Algorithm 1 (`scale_up`) picks onto that node, if the modelled step gets faster.
- The spike passed (the instance's step would meet the SLO by a margin without its replicas):
  drop its replicas, the one whose loss costs the least speedup first (`eviction_order`).
- Room again: an instance whose node has room for layers it shed (with `take_headroom` of the
  node's memory left over, so that a take does not bring back the pressure that caused the
  shed) takes them back, the run next to its own layers first; also, with no headroom, those
  on a host whose own requests ran late (`overloaded`). Not while its node is under pressure,
  nor for an instance the caller keeps as it is (`stay`: a shed younger than `settle_s`).

A host's compute. A stage runs its layers for every iteration of the instance, on the host's
compute. The host measures the share its stages take (each stage's busy fraction over the
core's `busy_window_s`) and reports the sum (`NodeView.stage_load`), which its shadow validation
counts (`cost.contended`: each of its own iterations takes 1 / (1 - load) as long). A stage
not placed yet has no measurement: its load is predicted (`predicted_load`) as the owner's
measured busy fraction (`InstanceView.busy`, grown by the hops the move adds) times the stage's
share of a step (`cost.stage_load`, the ceiling: its share were the owner busy all the time);
the host reports the prediction until it has measured the stage for a window. A shed or a
replica goes only to a host whose own busy instances still fit one decode round each within
their tightest TPOT SLO, so contended; a shed's stage also only where the moved layers' stages
then take at most `max_host_load`, and where the requests the host already admitted still meet
their deadlines with the stage's work (`evaluate.keeps_promises`). The shedding instance's own node
is checked the same way with the hops the shed adds (its round, SLINFER's case 3, and its
admitted requests' deadlines), not the shedding instance alone. (A replica yields: it is
dropped once the host's own requests run late, so the host does not count it.)

One plan per instance per call, and none for an instance with a move under way (`busy`): each
plan changes the views the next one is decided on. Every plan keeps the nodes' memory safe by
construction: the host reserves the bytes (a hold in its ledger, parked in its reservation
station until they fit) before the owner moves anything, and the owner's entry only shrinks once
its layers have left (`NodeScheduler.set_layout`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.cost import (HopCost, avg_context, budget_room, decode_step_s, free_bytes,
                              kv_demand, kv_for_layers, layer_weight_bytes, layout_replication,
                              layout_spec, plan_layer_move, round_fits, stage_load,
                              stage_share_bytes, tightest_tpot)
from shared.core.evaluate import keeps_promises
from shared.core.modules import (Device, eviction_order, layers_to_shed, relative_hop_cost,
                                 scale_up, speedup)
from shared.core.perf_model import Profile
from shared.core.types import (InstanceLayout, InstanceStatus, InstanceView, LayerRun, ModelSpec,
                               NodeView, RequestView)


class ModuleAction(str, enum.Enum):
    SHED = "shed"  # move layers [start, end) of the instance to a stage on host_node
    REPLICATE = "replicate"  # a replica of layers [start, end) on host_node
    DROP_REPLICA = "drop_replica"  # stop using the replica at `address` on host_node
    TAKE = "take"  # run layers [start, end), moved to `address` on host_node, here again


@dataclass(frozen=True)
class ModuleSettings:
    """The knobs of module scaling (the placer reads them once, services/placer/settings.py)."""

    # One activation transfer between two nodes' processes: its latency and the link's
    # bandwidth (~1 ms measured on loopback with passive OpenMP threads, bench/modules.py).
    hop_latency_s: float = 1e-3
    link_bytes_per_s: float = 1.25e9
    shed: bool = True
    replicate: bool = True
    # A spike: the predicted decode step (with the core's overestimate) exceeds this fraction
    # of the batch's tightest TPOT SLO. Passed: the step without replicas is below `relief`.
    spike: float = 1.0
    relief: float = 0.6
    spikes: bool = True  # watch TPOT spikes (and their passing); False: demand-driven only
    # Replicas (on demand) may go to empty nodes too; False: only to idle fragments, nodes that
    # already hold an instance or host replicas (CoCoServe re-uses idle capacity).
    empty_hosts: bool = True
    # Shed layers come back once their node has room for them with this fraction of its
    # memory still free afterwards (a take must not bring back the pressure that shed them).
    take: bool = True
    take_headroom: float = 0.1
    # The caller keeps a shed's layers where they went at least this long (`stay`).
    settle_s: float = 10.0
    # The most of a host's compute the stages it holds may take (measured or predicted).
    max_host_load: float = 0.5

    def __post_init__(self) -> None:
        if self.hop_latency_s < 0 or self.link_bytes_per_s <= 0:
            raise ValueError("hop_latency_s must be >= 0 and link_bytes_per_s > 0")
        if not 0 < self.relief < self.spike:
            raise ValueError("need 0 < relief < spike")
        if not 0 <= self.take_headroom < 1 or self.settle_s < 0 or \
                not 0 < self.max_host_load < 1:
            raise ValueError("need 0 <= take_headroom < 1, settle_s >= 0 and "
                             "0 < max_host_load < 1")


@dataclass(frozen=True)
class MemoryPressure:
    """A node that lacked `deficit_bytes` for a request it was asked to take."""

    node_id: str
    deficit_bytes: int


@dataclass(frozen=True)
class ModulePlan:
    action: ModuleAction
    instance_id: str
    owner_node: str  # where the instance runs
    host_node: str  # where its layers go (or the replica to drop is)
    start: int
    end: int
    host_bytes: int = 0  # what the host holds for the stage (its weights and K/V pool)
    owner_bytes_after: int = 0  # the instance's bytes on its node after the move
    address: str = ""  # DROP_REPLICA, TAKE: the stage's address
    why: str = ""
    # SHED: the share of the host's compute the stage is predicted to take (`predicted_load`),
    # which the host reports in its view until it has measured the stage; a replica yields to
    # the host's own work and reports none.
    load: float = 0.0

    def layout_after(self, inst: InstanceView, address: str, settings: ModuleSettings
                     ) -> InstanceLayout:
        """The instance's layout once this plan is carried out (`address`: the new stage's)."""
        layout = inst.layout or new_layout(inst.model, settings)
        if self.action in (ModuleAction.DROP_REPLICA, ModuleAction.TAKE):
            replica = self.action is ModuleAction.DROP_REPLICA
            runs = tuple(r for r in layout.runs
                         if not (r.replica is replica and r.address == self.address
                                 and (replica or (r.start, r.end) == (self.start, self.end))))
        else:
            full = layout.model
            weights = (self.end - self.start) * layer_weight_bytes(full, full.layers,
                                                                   full.head_bytes)
            runs = (*layout.runs, LayerRun(self.start, self.end, self.host_node, address,
                                           replica=self.action is ModuleAction.REPLICATE,
                                           kv_bytes=max(0, self.host_bytes - weights)))
        return replace(layout, runs=runs)


def new_layout(spec: ModelSpec, settings: ModuleSettings) -> InstanceLayout:
    return InstanceLayout(spec, (), settings.hop_latency_s, settings.link_bytes_per_s)


def movable(spec: ModelSpec) -> bool:
    return spec.layers > 1 and spec.token_bytes > 0 and 0 <= spec.head_bytes < spec.weight_bytes


def memory_deficit(node: NodeView, model: ModelSpec, request: RequestView) -> int:
    """Bytes `node` lacks for a new instance of `model` holding `request` (its optimistic
    budget; <= 0: none)."""
    need = model.weight_bytes + kv_demand(model, [request])
    return need - budget_room(node)


def plan_module_scaling(ctx: DecisionContext, pressures: list[MemoryPressure],
                        settings: ModuleSettings, busy: frozenset[str] = frozenset(),
                        demand: list[RequestView] = (),
                        overloaded: list[str] = (),
                        stay: frozenset[str] = frozenset()) -> list[ModulePlan]:
    """The module-scaling plans for this view of the cluster (module docstring). More inputs
    a caller may have: `demand`, requests that placement could serve only with a new
    instance or not at all (CoCoServe scales such a model up by replicating layers of its
    instance onto idle nodes first); `overloaded`, hosts whose own requests ran late (the
    replicas they host go, cheapest first, and layers shed there come back where their node
    has room); `stay`, instances whose shed layers are not taken back now."""
    nodes = ctx.nodes
    plans: list[ModulePlan] = []
    taken: set[str] = set(busy)  # instances with a plan (one decision each)
    free = _Room({n.node_id: free_bytes(n) for n in nodes},  # what earlier plans leave on each node
                 {n.node_id: n.stage_load for n in nodes})
    for node_id in overloaded:
        node = next((n for n in nodes if n.node_id == node_id), None)
        if node is not None:
            plans += _drop_hosted(node, ctx, math.inf, settings, taken)
    for pressure in pressures:
        node = next((n for n in nodes if n.node_id == pressure.node_id), None)
        if node is not None and pressure.deficit_bytes > 0 and settings.shed:
            plans += _relieve(node, ctx, pressure.deficit_bytes, settings, taken, free)
    if settings.replicate:
        for model in dict.fromkeys(r.model for r in demand):
            plans += _demand_plans(model, ctx, settings, free, taken)
    if settings.replicate and settings.spikes:
        for node in nodes:
            for inst in node.instances:
                if inst.instance_id in taken:
                    continue
                plan = _spike_plan(node, inst, ctx, settings, free) or \
                    _passed_plan(node, inst, ctx, settings)
                if plan is not None:
                    plans.append(plan)
                    taken.add(inst.instance_id)
    if settings.take:
        pressed = {p.node_id for p in pressures if p.deficit_bytes > 0}
        plans += _take_plans(nodes, pressed, set(overloaded), settings, taken | stay, free)
    return plans


@dataclass
class _Room:
    """What the plans made so far leave on each node: free bytes, and the stage load it has."""

    free: dict[str, int]
    load: dict[str, float]

    def __getitem__(self, node_id: str) -> int:
        return self.free[node_id]

    def take(self, node_id: str, nbytes: int, load: float = 0.0) -> None:
        self.free[node_id] -= nbytes
        self.load[node_id] += load

    def copy(self) -> _Room:
        return _Room(dict(self.free), dict(self.load))


def predicted_load(inst: InstanceView, profile: Profile, after: InstanceLayout,
                   config: CoreConfig, now: float) -> float:
    """The share of its host's compute the newest run of `after` (the instance's layout with
    it) is predicted to take: the stage's share of a step (`cost.stage_load`) times the share
    of time the owner will be stepping, its measured busy fraction grown by the hops (the same
    steps, each `after`'s step over the current one longer). An owner measured for less than a
    window (`InstanceView.busy`): the ceiling, as if it stepped all the time, since a few
    iterations tell little of its load; the host measures the stage once it runs and reports
    that instead, so a prediction errs only until then."""
    ceiling = stage_load(profile, after, after.runs[-1])
    meter = inst.busy
    if meter is None or meter.observed_s(now) < meter.window_s:
        return ceiling
    before_s = decode_step_s(inst, inst.layout, profile, config)
    after_s = decode_step_s(inst, after, profile, config)
    grown = after_s / before_s if before_s > 0 else 1.0
    return ceiling * min(1.0, meter.fraction(now) * grown)


def _host_fits(host: NodeView, load: float, ctx: DecisionContext, settings: ModuleSettings,
               room: _Room, replica: bool = False) -> bool:
    """May a stage that takes `load` of `host`'s compute go there? Its own busy instances
    still fit one decode round each (as its shadow validation predicts them, contended by its
    stages and this one) within their tightest TPOT SLO; and a moved run's stage (one the
    instance cannot run without) leaves its moved stages at most `max_host_load`. A replica
    yields to the host's own work (it goes when the host's requests run late), so it is not
    counted in the host's load afterwards, nor capped."""
    total = room.load[host.node_id] + load
    if not replica and total > settings.max_host_load:
        return False
    return round_fits(host, total, ctx.perf, ctx.config)


def _keeps_promises(node: NodeView, instances: list[InstanceView], load: float,
                    ctx: DecisionContext) -> bool:
    """`evaluate.keeps_promises` at the context's time: the requests `node` admitted still meet
    their deadlines, and its busy instances their round, with `instances` and `load`."""
    return keeps_promises(node, instances, load, ctx.perf, ctx.config, ctx.now)


# -- memory pressure ---------------------------------------------------------------------------


def _relieve(node: NodeView, ctx: DecisionContext, deficit: int, settings: ModuleSettings,
             taken: set[str], free: _Room) -> list[ModulePlan]:
    """Module reduction on a pressured node: drop the replicas it hosts, cheapest first; if
    that is not enough, shed layers of one of its own instances."""
    plans = _drop_hosted(node, ctx, deficit, settings, taken)
    deficit -= sum(p.host_bytes for p in plans)
    if deficit > 0:
        shed = _shed_plan(node, ctx, deficit, settings, taken, free)
        if shed is not None:
            plans.append(shed)
    return plans


def _drop_hosted(node: NodeView, ctx: DecisionContext, deficit: int, settings: ModuleSettings,
                 taken: set[str]) -> list[ModulePlan]:
    plans: list[ModulePlan] = []
    for owner in ctx.nodes:
        for inst in owner.instances:
            if inst.layout is None or inst.instance_id in taken or deficit <= 0:
                continue
            mine = [r for r in inst.layout.runs if r.replica and r.node_id == node.node_id]
            if not mine:
                continue
            profile = ctx.profile(inst.model.name, owner.hardware)
            hop_c = _hop_c(inst, profile, settings) if profile is not None else 1.0
            order = eviction_order(layout_replication(inst.layout), hop_c)
            device = next(d for d, _ in order if d.startswith(f"{node.node_id}/"))
            run = next(r for r in mine if device == f"{r.node_id}/{r.address}")
            freed = stage_share_bytes(inst, run.end - run.start)
            plans.append(ModulePlan(ModuleAction.DROP_REPLICA, inst.instance_id, owner.node_id,
                                    node.node_id, run.start, run.end, host_bytes=freed,
                                    address=run.address, why="memory pressure on its host"))
            taken.add(inst.instance_id)
            deficit -= freed
    return plans


def _shed_plan(node: NodeView, ctx: DecisionContext, deficit: int, settings: ModuleSettings,
               taken: set[str], free: _Room) -> ModulePlan | None:
    """The instance on `node` that frees `deficit` by shedding the fewest layers (its last
    local ones) to the node with the most free memory that takes them and whose own requests
    still meet their TPOT with the stage's work (`_host_fits`), and still meets its requests'
    TPOT with the hops that adds."""
    config, now = ctx.config, ctx.now
    best: tuple[tuple, ModulePlan] | None = None
    for inst in node.instances:
        full = inst.layout.model if inst.layout is not None else inst.model
        if inst.instance_id in taken or inst.status is not InstanceStatus.READY or \
                not movable(full) or _replicated(inst):
            continue
        here = inst.layout.local_layers() if inst.layout is not None else full.layers
        k = layers_to_shed(full, inst.kv_bytes, full.layers, here, full.head_bytes, deficit)
        if not k:
            continue
        profile = ctx.profile(inst.model.name, node.hardware)
        if profile is None:
            continue
        move = plan_layer_move(full, inst.kv_bytes, 0, full.layers, here, k, full.head_bytes)
        plan = ModulePlan(ModuleAction.SHED, inst.instance_id, node.node_id, "",
                          here - k, here, host_bytes=move.dest_bytes,
                          owner_bytes_after=move.source_bytes_after,
                          why=f"memory pressure: {deficit} bytes short")
        after = plan.layout_after(inst, "", settings)
        if not _meets_tpot(inst, after, node, ctx) or not _keeps_promises(
                node, [replace(i, layout=after) if i is inst else i for i in node.instances],
                node.stage_load, ctx):
            continue  # its own batch, or its node's round or admitted requests, would suffer
        load = predicted_load(inst, profile, after, config, now)
        hosts = [n for n in ctx.nodes if n.node_id != node.node_id
                 and n.hardware is node.hardware
                 and not n.draining and free[n.node_id] >= move.dest_bytes
                 and _host_fits(n, load, ctx, settings, free)
                 and _keeps_promises(n, n.instances, free.load[n.node_id] + load, ctx)]
        if not hosts:
            continue
        host = max(hosts, key=lambda n: (free[n.node_id], n.node_id))
        plan = replace(plan, host_node=host.node_id, load=load)
        rank = (k, -move.dest_bytes, inst.instance_id)
        if best is None or rank < best[0]:
            best = (rank, plan)
    if best is None:
        return None
    plan = best[1]
    free.take(plan.host_node, plan.host_bytes, plan.load)
    taken.add(plan.instance_id)
    return plan


def _replicated(inst: InstanceView) -> bool:
    return inst.layout is not None and any(r.replica for r in inst.layout.runs)


# -- demand: requests for a model that no instance of it could take -------------------------


def _demand_plans(model: str, ctx: DecisionContext, settings: ModuleSettings, free: _Room,
                  taken: set[str]) -> list[ModulePlan]:
    """Algorithm 1 for the model's busiest instance that is alone of its model on its node:
    replicas of the layers `scale_up` picks, on the idle nodes with room (one range each), if
    they raise the modelled speedup."""
    candidates = []
    for node in ctx.nodes:
        mine = [i for i in node.instances if i.model.name == model]
        if len(mine) == 1 and mine[0].instance_id not in taken and \
                mine[0].status is InstanceStatus.READY and movable(_full(mine[0])) and \
                not (mine[0].layout and any(not r.replica for r in mine[0].layout.runs)):
            candidates.append((node, mine[0]))
    for node, inst in sorted(candidates, key=lambda c: (-c[1].batch_size, c[0].node_id)):
        profile = ctx.profile(model, node.hardware)
        if profile is None:
            continue
        plans = _replicas_for(node, inst, ctx, profile, settings, free, one_host=False,
                              why=f"demand for {model}")
        if plans:
            taken.add(inst.instance_id)
            return plans
    return []


def _replicas_for(node: NodeView, inst: InstanceView, ctx: DecisionContext, profile: Profile,
                  settings: ModuleSettings, free: _Room, one_host: bool,
                  why: str) -> list[ModulePlan]:
    nodes = ctx.nodes
    full = _full(inst)
    per_layer = stage_share_bytes(inst, 1)
    hosting = {r.node_id for n in nodes for i in n.instances if i.layout for r in i.layout.runs}
    spots = []
    for other in nodes:
        if other.node_id == node.node_id or other.hardware is not node.hardware or \
                other.draining or any(i.requests for i in other.instances) or \
                free[other.node_id] < per_layer or _hosts_for(inst, other.node_id):
            continue
        empty = not other.instances and other.node_id not in hosting
        if empty and not settings.empty_hosts:
            continue
        spots.append((empty, -free[other.node_id], other.node_id))
    devices = [Device(n, min(full.layers, free[n] // per_layer)) for _, _, n in sorted(spots)]
    if one_host:
        devices = devices[:1]
    if not devices:
        return []
    hop_c = _hop_c(inst, profile, settings)
    base = layout_replication(inst.layout) if inst.layout else \
        layout_replication(new_layout(full, settings))
    grown = scale_up(base, devices, hop_c)
    if speedup(grown, hop_c) <= speedup(base, hop_c) + 1e-9:
        return []
    plans, layout = [], inst.layout
    by_id = {n.node_id: n for n in nodes}
    for device in devices:
        held = grown.on.get(device.name, set()) - base.on.get(device.name, set())
        if not held:
            continue
        start, end = _fit_range(layout, *_longest_run(held))
        plan = ModulePlan(ModuleAction.REPLICATE, inst.instance_id, node.node_id, device.name,
                          start, end, host_bytes=stage_share_bytes(inst, end - start), why=why)
        if plan.host_bytes > free[device.name]:
            continue
        after = plan.layout_after(inst if layout is None else replace(inst, layout=layout),
                                  device.name, settings)
        load = predicted_load(inst, profile, after, ctx.config, ctx.now)
        if not _host_fits(by_id[device.name], load, ctx, settings, free, replica=True):
            continue
        free.take(device.name, plan.host_bytes)
        layout = after
        plans.append(plan)
    return plans


def _full(inst: InstanceView) -> ModelSpec:
    return inst.layout.model if inst.layout is not None else inst.model


# -- load spikes -------------------------------------------------------------------------------


def _meets_tpot(inst: InstanceView, layout: InstanceLayout, node: NodeView,
                ctx: DecisionContext) -> bool:
    profile = ctx.profile(inst.model.name, node.hardware)
    return profile is not None and (
        not inst.requests
        or decode_step_s(inst, layout, profile, ctx.config) <= tightest_tpot(inst))


def _spike_plan(node: NodeView, inst: InstanceView, ctx: DecisionContext,
                settings: ModuleSettings, free: _Room) -> ModulePlan | None:
    full, config = _full(inst), ctx.config
    profile = ctx.profile(full.name, node.hardware)
    if profile is None or inst.status is not InstanceStatus.READY or not movable(full) or \
            not inst.requests or (inst.layout is not None
                                  and any(not r.replica for r in inst.layout.runs)):
        return None  # (a split instance's layers are not all here: none to replicate)
    now_s = decode_step_s(inst, inst.layout, profile, config)
    if now_s <= settings.spike * tightest_tpot(inst):
        return None
    trial = free.copy()
    plans = _replicas_for(node, inst, ctx, profile, settings, trial, one_host=True,
                          why=f"TPOT spike: step {now_s:.3f} s for {inst.batch_size} requests")
    if not plans:
        return None
    plan = plans[0]
    if decode_step_s(inst, plan.layout_after(inst, "?", settings), profile, config) >= now_s:
        return None  # the profile's small batches cost about as much: no gain
    free.take(plan.host_node, plan.host_bytes, plan.load)
    return plan


def _passed_plan(node: NodeView, inst: InstanceView, ctx: DecisionContext,
                 settings: ModuleSettings) -> ModulePlan | None:
    if not _replicated(inst):
        return None
    config = ctx.config
    profile = ctx.profile(inst.model.name, node.hardware)
    if profile is None:
        return None
    unreplicated = replace(inst.layout, runs=tuple(r for r in inst.layout.runs if not r.replica))
    if inst.requests and decode_step_s(inst, unreplicated, profile, config) > \
            settings.relief * tightest_tpot(inst):
        return None
    order = eviction_order(layout_replication(inst.layout), _hop_c(inst, profile, settings))
    device = order[0][0]
    run = next(r for r in inst.layout.runs if r.replica and f"{r.node_id}/{r.address}" == device)
    return ModulePlan(ModuleAction.DROP_REPLICA, inst.instance_id, node.node_id, run.node_id,
                      run.start, run.end, host_bytes=stage_share_bytes(inst, run.end - run.start),
                      address=run.address, why="the spike passed")


# -- room again: shed layers come back --------------------------------------------------------


def _take_plans(nodes: list[NodeView], pressed: set[str], overloaded: set[str],
                settings: ModuleSettings, keep: set[str], free: _Room) -> list[ModulePlan]:
    plans = []
    for node in nodes:
        if node.node_id in pressed or node.draining:
            continue
        for inst in node.instances:
            plan = _take_plan(node, inst, overloaded, settings, keep, free)
            if plan is not None:
                plans.append(plan)
                keep.add(inst.instance_id)
    return plans


def _take_plan(node: NodeView, inst: InstanceView, overloaded: set[str],
               settings: ModuleSettings, keep: set[str], free: _Room) -> ModulePlan | None:
    """The moved run next to the instance's own layers comes back if its node has room for
    its bytes (as `NodeScheduler.set_layout` will count them) with `take_headroom` of its
    memory left over; none needed where the run's host is overloaded."""
    if inst.layout is None or inst.instance_id in keep or inst.status is not InstanceStatus.READY:
        return None
    moved = [r for r in inst.layout.runs if not r.replica]
    if not moved:
        return None
    run = min(moved, key=lambda r: r.start)
    after = replace(inst.layout, runs=tuple(r for r in inst.layout.runs if r != run))
    here, back = inst.layout.local_layers(), after.local_layers()
    spec = layout_spec(after) if back < after.model.layers else after.model
    owner_after = spec.weight_bytes + kv_for_layers(inst.kv_bytes, here, back)
    need = owner_after - (inst.model.weight_bytes + inst.kv_bytes)
    headroom = 0 if run.node_id in overloaded else settings.take_headroom * node.memory_bytes
    if free[node.node_id] - need < headroom:
        return None
    free.take(node.node_id, need)
    why = "its host is overloaded" if run.node_id in overloaded else "room again on its node"
    return ModulePlan(ModuleAction.TAKE, inst.instance_id, node.node_id, run.node_id, run.start,
                      run.end, host_bytes=stage_share_bytes(inst, run.end - run.start),
                      owner_bytes_after=owner_after, address=run.address, why=why)


def _hosts_for(inst: InstanceView, node_id: str) -> bool:
    return inst.layout is not None and any(r.node_id == node_id for r in inst.layout.runs)


def _longest_run(held: set[int]) -> tuple[int, int]:
    best = (0, 0)
    for i in sorted(held):
        if i - 1 in held:
            continue
        j = i
        while j + 1 in held:
            j += 1
        if j + 1 - i > best[1] - best[0]:
            best = (i, j + 1)
    return best


def _fit_range(layout: InstanceLayout | None, start: int, end: int) -> tuple[int, int]:
    """A replica's range must equal an existing replicated range or overlap none (the engine
    splits a batch per range): the existing range it overlaps, else its own."""
    if layout is None:
        return start, end
    for run in layout.runs:
        if run.replica and run.start < end and start < run.end:
            return run.start, run.end
    return start, end


def _hop_c(inst: InstanceView, profile: Profile, settings: ModuleSettings) -> float:
    """The speedup model's C for the instance now (a hop over one layer's share of a step)."""
    layout = inst.layout or new_layout(inst.model, settings)
    hop = HopCost(layout.hop_latency_s, layout.hop_bytes_per_s, layout.model.token_bytes)
    return relative_hop_cost(profile, hop, layout.model.layers, max(1, inst.batch_size),
                             avg_context(inst))

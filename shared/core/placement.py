"""Where a request goes (SLINFER §V): the placer's one decision function.

Order: an existing instance (CPU nodes first, only CPUs with a matrix accelerator whose profile
meets the SLO; then GPUs; among one model's instances the largest batch first) -> proactive
preemption of strictly smaller neighbours -> a new instance (CPU first; nodes whose startup meets
the TTFT SLO first; then bin-packing) -> queue, or drop once queueing alone would break the TTFT
SLO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.core.admission import Admission, AdmitReason
from shared.core.consolidation import Migration, plan_preemption, route_candidates
from shared.core.context import DecisionContext
from shared.core.cost import budget_room, kv_demand
from shared.core.evaluate import node_check, slo_check
from shared.core.lora import admission_through
from shared.core.readiness import cold_start_ready_at, load_seconds
from shared.core.startup import StartupChoice, choose_startup, with_startup
from shared.core.types import (AdapterSpec, Hardware, ModelSpec, NodeView, RequestView,
                               first_token_due, token_deadline)


class PlaceAction(str, enum.Enum):
    ROUTE = "route"  # join an existing instance
    PREEMPT_AND_ROUTE = "preempt_and_route"  # unload smaller neighbours, then join / create
    NEW_INSTANCE = "new_instance"  # cold-start an instance for this request
    QUEUE = "queue"  # nothing fits now; try again when the cluster changes
    DROP = "drop"  # waiting any longer would break the TTFT SLO by itself


@dataclass(frozen=True)
class Attempt:
    node_id: str
    instance_id: str | None  # None: a new instance on that node
    reason: AdmitReason
    # New-instance candidates only: why the node came where it did in the order.
    startup_s: float | None = None  # load wait + load time (ServerlessLLM's startup estimate)
    free_bytes: int | None = None  # the node's optimistic free memory before this instance


@dataclass(frozen=True)
class PlacementPlan:
    action: PlaceAction
    node_id: str | None = None  # where the request goes
    instance_id: str | None = None  # None with a node: create a new instance there
    admission: Admission | None = None  # the admission the placer expects the node to confirm
    preempt: tuple[str, ...] = ()  # instances on node_id to unload first
    migrations: tuple[Migration, ...] = ()  # where the preempted requests go
    attempts: tuple[Attempt, ...] = ()  # every candidate tried, with the core's answer
    # NEW_INSTANCE: how the instance gets its weights (λScale §5): from the node's own tiers,
    # or by a multicast from the nodes that hold the model (the placer starts it).
    startup: StartupChoice | None = None
    # Preemption only: carried out by live migration (the node keeps the victims until their
    # requests moved, `handover_s` estimated) or stop-and-resume, and why (`Preemption.why`).
    live: bool = False
    handover_s: float = 0.0
    preempt_why: str = ""


@dataclass(frozen=True)
class NewInstanceSpot:
    """One node as a home for a new instance, with what orders it (see `new_instance_order`)."""

    node: NodeView  # as the admission sees it: with the model arriving if `startup` multicasts
    startup_s: float  # until the instance can run: a parked load's wait + the load itself
    meets_ttft: bool  # that startup plus the prefill still meets the TTFT SLO
    free_bytes: int  # optimistic budget left on the node now
    startup: StartupChoice | None = None  # own tiers or multicast, whichever is quicker


def new_instance_order(request: RequestView, model: ModelSpec, eligible: list[NodeView],
                       ctx: DecisionContext,
                       adapter: AdapterSpec | None = None) -> list[NewInstanceSpot]:
    """Where a new instance goes first: CPU nodes first (§V); then nodes whose startup still lets
    the first token meet the TTFT SLO (the load itself is covered by the cold-start grace, a wait
    for memory is not); then bin-packing (§V): the node with the least free memory first, so used
    nodes fill up and empty ones stay empty (and can be given back). The shadow validation that
    follows decides whether the packed node can take the interference. Each node's load is
    the quicker of its own tiers and a multicast from the nodes of `ctx` holding the model
    (`shared.core.startup`). A request through `adapter` loads it too."""
    spots = []
    now, config = ctx.now, ctx.config
    need = model.weight_bytes + kv_demand(model, [request]) + (adapter.bytes if adapter else 0)
    for node in eligible:
        profile = ctx.profile(model.name, node.hardware)
        if profile is None:
            continue
        choice = choose_startup(node, model, profile, ctx)
        node = with_startup(node, model.name, choice)
        load = load_seconds(node, model, profile)  # the grace; the wait for I/O or memory is not
        startup = cold_start_ready_at(node, need, load, now) - now
        first_token = now + startup + profile.prefill_through(request.context_len(), request.lora_rank) * (1 + config.overestimate)
        grace = max(request.grace_s, load)
        deadline = token_deadline(first_token_due(request.arrival, grace, request.slo.ttft_s),
                                  request.slo.tpot_s, request.generated)
        spots.append(NewInstanceSpot(node, startup, first_token <= deadline,
                                     budget_room(node), choice))
    if not config.pack_new_instances:  # ablation: soonest start (the node's iteration included)
        return sorted(spots, key=lambda s: (s.node.hardware is not Hardware.CPU,
                                            s.startup_s + max(0.0, s.node.busy_until - now),
                                            s.node.node_id))
    return sorted(spots, key=lambda s: (s.node.hardware is not Hardware.CPU, not s.meets_ttft,
                                        s.free_bytes, s.node.node_id))


def place(request: RequestView, model: ModelSpec, ctx: DecisionContext,
          adapter: AdapterSpec | None = None) -> PlacementPlan:
    """`ctx`: the cluster now (its `models`: the specs of the requests a preemption would move;
    `model` is added). `adapter`: the LoRA adapter the request runs through on an instance of
    `model` (its backbone). Every candidate is judged as its node's admission will judge it
    (`lora.admission_through`): the adapter's bytes where the instance lacks it, its load's wait,
    the idle adapters the node would offload for it."""
    ctx = ctx.with_model(model)
    nodes, perf, now, config = ctx.nodes, ctx.perf, ctx.now, ctx.config
    attempts: list[Attempt] = []
    eligible: list[NodeView] = []
    slo_by_hw = {hw: slo_check(perf.get(model.name, hw), request, config)
                 for hw in {n.hardware for n in nodes}}
    for node in nodes:
        reason = node_check(node, config) or slo_by_hw[node.hardware]
        if reason is None:
            eligible.append(node)
        else:
            attempts.append(Attempt(node.node_id, None, reason))

    cands = route_candidates(eligible, model.name)
    for node, inst in cands:
        adm = admission_through(node, inst.instance_id, request, model, adapter, perf, now, config)
        attempts.append(Attempt(node.node_id, inst.instance_id, adm.reason))
        if adm.ok:
            return PlacementPlan(PlaceAction.ROUTE, node.node_id, inst.instance_id, adm,
                                 attempts=tuple(attempts))

    if config.enable_consolidation:
        failed = {(a.node_id, a.instance_id): a.reason for a in attempts}  # each candidate's answer
        for node, inst in cands:
            pre = plan_preemption(node, inst, request, model, ctx,
                                  failed[node.node_id, inst.instance_id], adapter)
            if pre is not None:
                return PlacementPlan(PlaceAction.PREEMPT_AND_ROUTE, node.node_id, inst.instance_id,
                                     pre.admission, pre.victims, pre.migrations, tuple(attempts),
                                     live=pre.live, handover_s=pre.handover_s,
                                     preempt_why=pre.why)

    # A new instance preempts nobody: it has no batch, and only strictly smaller ones may go.
    # It may land beside an instance of the model that just refused the request. That copy
    # shares the node's compute and passes only by the cold start's TTFT grace (§IX-A); leaving
    # such nodes out was tried (branch burst-nodup) and cut both ways in the simulator: 64x7B
    # SLO 0.982 -> 0.985, but a 13B registry burst dropped 17 instead of 3 of 61 requests the
    # copies had served inside their load grace. So it stays allowed.
    spots = new_instance_order(request, model, eligible, ctx, adapter)
    refused: list[tuple[NewInstanceSpot, AdmitReason]] = []
    for spot in spots:
        adm = admission_through(spot.node, None, request, model, adapter, perf, now, config)
        attempts.append(Attempt(spot.node.node_id, None, adm.reason, spot.startup_s, spot.free_bytes))
        if adm.ok:
            return PlacementPlan(PlaceAction.NEW_INSTANCE, spot.node.node_id, None, adm,
                                 attempts=tuple(attempts), startup=spot.startup)
        refused.append((spot, adm.reason))
    if config.enable_consolidation and config.prewarm:
        # Pre-warming on: a new instance may unload idle instances only the policy keeps
        # (`shared.core.prewarm.gives_way`), in the same order of nodes.
        for spot, reason in refused:
            pre = plan_preemption(spot.node, None, request, model, ctx, reason, adapter)
            if pre is not None:
                return PlacementPlan(PlaceAction.PREEMPT_AND_ROUTE, spot.node.node_id, None,
                                     pre.admission, pre.victims, pre.migrations, tuple(attempts),
                                     live=pre.live, handover_s=pre.handover_s,
                                     preempt_why=pre.why)

    if not nodes:  # no node has reported yet (a stack starting up): wait for one
        late = now > request.deadline()
        return PlacementPlan(PlaceAction.DROP if late else PlaceAction.QUEUE)
    drop = queueing_breaks_ttft(request, eligible, model, ctx)
    return PlacementPlan(PlaceAction.DROP if drop else PlaceAction.QUEUE, attempts=tuple(attempts))


def queueing_breaks_ttft(request: RequestView, eligible: list[NodeView], model: ModelSpec,
                         ctx: DecisionContext) -> bool:
    """True when no eligible node could give the request its next token in time even if it
    started now, each judged with its own hardware's numbers and the shadow's 10% margin: on an
    instance of the model already on a node of that kind (the request's own grace), or by a cold
    start there (its load as grace, §IX-A; by multicast from `ctx`'s nodes where that is
    quicker)."""
    now, config = ctx.now, ctx.config
    warm = {n.hardware for n in eligible
            if any(i.model.name == model.name and i.accepts for i in n.instances)}
    no_grace = request.deadline() - request.grace_s
    for node in eligible:
        p = ctx.profile(model.name, node.hardware)
        if p is None:
            continue
        prefill = p.prefill_through(request.context_len(), request.lora_rank) * (1 + config.overestimate)
        if node.hardware in warm and now + prefill <= request.deadline():
            return False
        load = choose_startup(node, model, p, ctx).load_s
        if now + load + prefill <= no_grace + max(request.grace_s, load):
            return False
    return True

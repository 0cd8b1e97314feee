"""Where a request goes (SLINFER §V): the placer's one decision function.

Order: an existing instance (CPU nodes first, only CPUs with a matrix accelerator whose profile
meets the SLO; then GPUs; among one model's instances the largest batch first) -> proactive
preemption of smaller neighbours -> a new instance on the node with the best startup time (CPU
first) -> queue, or drop once queueing alone would break the TTFT SLO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.core.admission import Admission, AdmitReason
from shared.core.config import CoreConfig
from shared.core.consolidation import Migration, binpack_order, plan_preemption
from shared.core.evaluate import evaluate, node_check, slo_check
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, InstanceStatus, ModelSpec, NodeView, RequestView


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


@dataclass(frozen=True)
class PlacementPlan:
    action: PlaceAction
    node_id: str | None = None  # where the request goes
    instance_id: str | None = None  # None with a node: create a new instance there
    admission: Admission | None = None  # the admission the placer expects the node to confirm
    preempt: tuple[str, ...] = ()  # instances on node_id to unload first
    migrations: tuple[Migration, ...] = ()  # where the preempted requests go
    attempts: tuple[Attempt, ...] = ()  # every candidate tried, with the core's answer


def startup_s(node: NodeView, model: ModelSpec, perf: PerfModel, now: float) -> float:
    """ServerlessLLM-style startup estimate: wait for the node's current iteration + load time."""
    profile = perf.get(model.name, node.hardware)
    load = profile.load_s if profile else float("inf")
    return max(0.0, node.busy_until - now) + load


def place(request: RequestView, model: ModelSpec, nodes: list[NodeView], perf: PerfModel,
          now: float, config: CoreConfig, models: dict[str, ModelSpec] | None = None) -> PlacementPlan:
    models = {**(models or {}), model.name: model}
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

    cands = binpack_order([(n, i) for n in eligible for i in n.instances
                           if i.model.name == model.name and i.status is not InstanceStatus.UNLOADING])
    for node, inst in cands:
        adm = evaluate(node, inst.instance_id, request, model, perf, now, config)
        attempts.append(Attempt(node.node_id, inst.instance_id, adm.reason))
        if adm.ok:
            return PlacementPlan(PlaceAction.ROUTE, node.node_id, inst.instance_id, adm,
                                 attempts=tuple(attempts))

    if config.enable_consolidation:
        failed = {(a.node_id, a.instance_id): a.reason for a in attempts}  # each candidate's answer
        for node, inst in cands:
            pre = plan_preemption(node, inst, request, model, nodes, models, perf, now, config,
                                  failed[node.node_id, inst.instance_id])
            if pre is not None:
                return PlacementPlan(PlaceAction.PREEMPT_AND_ROUTE, node.node_id, inst.instance_id,
                                     pre.admission, pre.victims, pre.migrations, tuple(attempts))

    by_startup = sorted(eligible, key=lambda n: (n.hardware is not Hardware.CPU,
                                                 startup_s(n, model, perf, now), n.node_id))
    for node in by_startup:
        adm = evaluate(node, None, request, model, perf, now, config)
        attempts.append(Attempt(node.node_id, None, adm.reason))
        if adm.ok:
            return PlacementPlan(PlaceAction.NEW_INSTANCE, node.node_id, None, adm,
                                 attempts=tuple(attempts))
    if config.enable_consolidation:
        failed = {(a.node_id, a.instance_id): a.reason for a in attempts}
        for node in by_startup:
            pre = plan_preemption(node, None, request, model, nodes, models, perf, now, config,
                                  failed[node.node_id, None])
            if pre is not None:
                return PlacementPlan(PlaceAction.PREEMPT_AND_ROUTE, node.node_id, None,
                                     pre.admission, pre.victims, pre.migrations, tuple(attempts))

    if not nodes:  # no node has reported yet (a stack starting up): wait for one
        late = now > request.arrival + request.slo.ttft_s + request.grace_s
        return PlacementPlan(PlaceAction.DROP if late else PlaceAction.QUEUE)
    action = PlaceAction.DROP if queueing_breaks_ttft(request, eligible, model, perf, now) else PlaceAction.QUEUE
    return PlacementPlan(action, attempts=tuple(attempts))


def queueing_breaks_ttft(request: RequestView, eligible: list[NodeView], model: ModelSpec,
                         perf: PerfModel, now: float) -> bool:
    """True when even the fastest eligible hardware, starting now (with a cold start's grace),
    would deliver the first token after the deadline."""
    best = float("inf")
    for node in eligible:
        p = perf.get(model.name, node.hardware)
        if p is not None:
            best = min(best, p.prefill_s(request.context_len()))
    grace = max((p.load_s for n in eligible if (p := perf.get(model.name, n.hardware))), default=0.0)
    return now + best > request.arrival + request.slo.ttft_s + max(request.grace_s, grace)

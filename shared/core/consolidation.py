"""Efficiency-oriented consolidation (SLINFER §VIII).

- Reactive bin-packing: among a model's instances, try the one with the largest batch first, so
  small fragmented instances drain and can be reclaimed (`binpack_order`).
- Proactive preemption: when an instance cannot grow because of its neighbours, it may preempt
  neighbours with a strictly smaller batch than its own (the new request not counted, so equal
  instances never preempt each other and a new instance preempts nobody), smallest first, and
  only if every preempted request shadow-validates on another node (`plan_preemption`).
- Keep-alive: idle instances are reclaimed after their keep-alive (`idle_instances`); a pinned
  instance is neither reclaimed nor preempted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from shared.core.admission import Admission, AdmitReason
from shared.core.context import DecisionContext
from shared.core.evaluate import evaluate, handing_over, with_request, without_instances
from shared.core.keepalive import expired
from shared.core.lora import admission_through
from shared.core.prewarm import spare_instances
from shared.core.readiness import first_run_at, handover_ready_at
from shared.core.types import (AdapterSpec, Hardware, InstanceStatus, InstanceView, ModelSpec,
                               NodeView, RequestView)


def binpack_order(candidates: list[tuple[NodeView, InstanceView]]) -> list[tuple[NodeView, InstanceView]]:
    """CPU nodes first (§V), then the largest batch (§VIII-B); ids break ties deterministically."""
    return sorted(candidates, key=lambda c: (c[0].hardware is not Hardware.CPU,
                                             -c[1].batch_size, c[0].node_id, c[1].instance_id))


def route_candidates(nodes: Iterable[NodeView], model: str) -> list[tuple[NodeView, InstanceView]]:
    """The instances of `model` on `nodes` a request may join, in the order a route tries them
    (`binpack_order`): `place`, a preemption's migration destinations and the warm fast path."""
    return binpack_order([(n, i) for n in nodes for i in n.instances
                          if i.model.name == model and i.accepts])


def idle_instances(node: NodeView, now: float, keep_alive_s: float) -> list[InstanceView]:
    """Ready instances without requests whose keep-alive has expired by `now`: each its own
    window (`shared.core.keepalive.window`; `keep_alive_s`: the default for those without one).
    A pinned instance, or one with a negative window, never expires."""
    return [i for i in node.instances if expired(i, now, keep_alive_s)]


@dataclass(frozen=True)
class Migration:
    request_id: str
    from_instance: str  # preempted instance it leaves
    to_node: str
    to_instance: str  # an existing instance of its model that passed shadow validation


@dataclass(frozen=True)
class Preemption:
    node_id: str
    victims: tuple[str, ...]  # instance ids to unload, smallest batch first
    admission: Admission  # the preemptor's admission once the victims are gone
    migrations: tuple[Migration, ...]  # where each preempted request goes
    # Live (ServerlessLLM §5): the victims' requests move while they keep decoding and the
    # newcomer waits for the handover; False: stop-and-resume (victims unloaded at once).
    live: bool = False
    handover_s: float = 0.0  # the estimated handover (live, or the one that was turned down)
    why: str = ""  # how the plan chose live or stop-and-resume, from the estimate


def preemption_victims(node: NodeView, preemptor: InstanceView | None,
                       spare: frozenset[str] = frozenset()) -> list[InstanceView]:
    """Neighbours with a strictly smaller batch than the preemptor has now (§VIII-A). A pinned
    instance is no victim: its model asked for it to stay warm. `spare`: idle instances only the
    pre-warming policy keeps (`shared.core.prewarm.spare_instances`), victims of anyone, a new
    instance included."""
    own_batch = preemptor.batch_size if preemptor else 0
    own_id = preemptor.instance_id if preemptor else None
    victims = [i for i in node.instances if i.instance_id != own_id and i.accepts
               and (i.batch_size < own_batch or i.instance_id in spare) and not i.pinned]
    return sorted(victims, key=lambda i: (i.batch_size, i.last_active, i.instance_id))


def relocate(requests: list[tuple[str, RequestView]], exclude_node: str,
             ctx: DecisionContext) -> list[Migration] | None:
    """Find an existing instance on another node of `ctx` for every request, or None if one
    cannot move. Each placed request is added to the working views so two never count the same
    room."""
    views = {n.node_id: n for n in ctx.nodes if n.node_id != exclude_node}
    plan: list[Migration] = []
    for from_instance, req in requests:
        moved = replace(req, prefilled=False)  # recomputes its KV cache at the destination
        spot = _first_fit(moved, views, ctx.models[req.model], ctx)
        if spot is None:
            return None
        node_id, inst_id, admission = spot
        views[node_id] = with_request(views[node_id], inst_id, moved, admission)
        plan.append(Migration(req.request_id, from_instance, node_id, inst_id))
    return plan


def _first_fit(req: RequestView, views: dict[str, NodeView], model: ModelSpec,
               ctx: DecisionContext) -> tuple[str, str, Admission] | None:
    for node, inst in route_candidates(views.values(), model.name):
        adm = evaluate(node, inst.instance_id, req, model, ctx.perf, ctx.now, ctx.config)
        if adm.ok:
            return node.node_id, inst.instance_id, adm
    return None


# Why an admission failed, and whether unloading neighbours can change that answer: freeing
# memory or the node (sharing disabled) can; only neighbours with requests change the timeline.
_MEMORY_BOUND = frozenset({AdmitReason.MEMORY, AdmitReason.NOT_SHARED})
_TIME_BOUND = frozenset({AdmitReason.TPOT_BUDGET, AdmitReason.TTFT_MISS, AdmitReason.HEADROOM})
_PREEMPTION_MAY_HELP = _MEMORY_BOUND | _TIME_BOUND


def plan_preemption(node: NodeView, preemptor: InstanceView | None, request: RequestView,
                    model: ModelSpec, ctx: DecisionContext,
                    failed: AdmitReason | None = None,
                    adapter: AdapterSpec | None = None) -> Preemption | None:
    """Smallest victims first until the preemptor admits the request; then every victim's requests
    must validate elsewhere (on `ctx`'s other nodes; `ctx.models` has their specs), or there is
    no preemption at all.

    `failed` is the answer the request got on this node without preemption, when the caller has
    it: trials that cannot change it are skipped (an idle victim frees memory, not time).
    `adapter`: the LoRA adapter the request runs through; the trials judge it as the node's
    re-check will (`lora.admission_through`).
    """
    if failed is not None and failed not in _PREEMPTION_MAY_HELP:
        return None
    chosen: list[InstanceView] = []
    target_id = preemptor.instance_id if preemptor else None
    spare = spare_instances(node, ctx.now, ctx.config)
    for victim in preemption_victims(node, preemptor, spare):
        chosen.append(victim)
        if failed in _TIME_BOUND and not victim.requests:  # smallest first: all chosen are idle
            continue
        trial = without_instances(node, {v.instance_id for v in chosen})
        admission = admission_through(trial, target_id, request, model, adapter, ctx.perf,
                                      ctx.now, ctx.config)
        if admission.ok:
            break
    else:
        return None
    displaced = [(v.instance_id, r) for v in chosen for r in v.requests]
    moves = relocate(displaced, node.node_id, ctx)
    if moves is None:
        return None
    victims = tuple(v.instance_id for v in chosen)
    if not ctx.config.live_preemption or not displaced:
        return Preemption(node.node_id, victims, admission, tuple(moves))
    return _live_or_not(node, chosen, target_id, request, model, displaced, moves, ctx,
                        admission, adapter)


def handover_seconds(displaced: list[tuple[str, RequestView]], moves: list[Migration],
                     ctx: DecisionContext) -> float:
    """How long a live preemption's requests take to move (ServerlessLLM §6's migration time
    a·(t_in + t_out) + b from the destination's profile, per request): each destination first
    finishes what holds its instance (the rest of a load) or the node (the iteration running),
    then recomputes its migrants' KV caches one after another; destinations work in parallel.
    The catch-up rounds are short and overlap the source's decoding: the intercept b covers
    them and the commit."""
    views = {n.node_id: n for n in ctx.nodes}
    per_node: dict[str, float] = {}
    for (_, req), move in zip(displaced, moves):
        node = views[move.to_node]
        profile = ctx.profile(req.model, node.hardware)
        inst = node.instance(move.to_instance)
        if node.node_id not in per_node:
            start = first_run_at(node, inst, ctx.now)
            per_node[node.node_id] = start - ctx.now
        per_node[node.node_id] += profile.migration_s(req.context_len()) if profile else 0.0
    return max(per_node.values(), default=0.0)


def _live_or_not(node: NodeView, chosen: list[InstanceView], target_id: str | None,
                 request: RequestView, model: ModelSpec, displaced: list[tuple[str, RequestView]],
                 moves: list[Migration], ctx: DecisionContext,
                 stop_and_resume: Admission, adapter: AdapterSpec | None = None) -> Preemption:
    """Live when the newcomer still passes waiting for the handover, with the victims' work on
    the node until then; else stop-and-resume, which frees the node at once."""
    victims = tuple(v.instance_id for v in chosen)
    handover = handover_seconds(displaced, moves, ctx)
    if any(v.status is not InstanceStatus.READY for v in chosen if v.requests):
        return Preemption(node.node_id, victims, stop_and_resume, tuple(moves), False, handover,
                          "stop-and-resume: a victim is still loading")
    fixed = sorted({r.model for _, r in displaced if not ctx.models[r.model].live_migration})
    if fixed:
        return Preemption(node.node_id, victims, stop_and_resume, tuple(moves), False, handover,
                          f"stop-and-resume: the engine of {', '.join(fixed)} cannot migrate live")
    leaves_at = ctx.now + handover
    trial = handing_over(node, set(victims), leaves_at)
    live = admission_through(trial, target_id, request, model, adapter, ctx.perf, ctx.now,
                             ctx.config, handover_ready_at(leaves_at))
    if live.ok:
        return Preemption(node.node_id, victims, live, tuple(moves), True, handover,
                          f"live: the newcomer waits ~{handover:.3f} s for the handover")
    return Preemption(node.node_id, victims, stop_and_resume, tuple(moves), False, handover,
                      f"stop-and-resume: waiting ~{handover:.3f} s for a live handover gives "
                      f"{live.reason.value}")

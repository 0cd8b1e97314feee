"""Burst scale-out (λScale §3, §7.5): a model whose demand outgrows the instance being started
gets the instances that demand needs started together, so that one multicast feeds them all
(k -> N, `shared.core.multicast`) and its destinations can form execute-while-load pipelines,
instead of one instance per placement, each started only once the previous one is full.

The decision, at a placement that starts a new instance of model M (`place` said NEW_INSTANCE):
- per instance, c: the most requests one of M's instances holds among those that have just
  refused this request as full (the shadow validation's refusals: its first token or another
  request's would be late, or a decode round would break the TPOT): what an instance takes
  within the SLO, as the validation measured it. None refused so (no instance of M yet, or
  refusals for memory only): no burst (nothing measured; a single arrival is no burst, and a
  node out of memory is not a model out of instances).
- demand: M's arrivals within the last `burst_window_s` (this request's included), as a rate,
  times the startup of the new instance (the requests that arrive while it starts and that the
  full instances will not take), plus M's requests queued at the placer.
- start ceil(demand / c) instances now, this request's among them, at most `burst_max`, when
  the new instance starts within `burst_max_startup_s` (λScale's regime: by multicast or from a
  local copy; instances that read a slow tier would all be late anyway, and share it); the extra
  ones on nodes that serve no instance of M yet, whose startup is within that bound too (λScale scales out onto more GPUs: M's instances
  on a node have just refused this request, and another instance there would share their GPU),
  one per node, in `new_instance_order`'s order where a new instance for a request like this one
  is admitted (`evaluate`), each empty until requests join it.
- one multicast: the placed instance and the extra ones that receive the model by multicast
  join one group (the placer sends it to all of them at once), and the schedule the node
  workers run over that group is what each waits for. So each spot is chosen with the group so
  far counted as receivers on their way, and once the group is known, every spot is priced
  again at its position in it (`choose_startup`'s `group`: a later joiner can delay an earlier
  one by a step) and re-validated; one that no longer passes leaves the group (and the rest
  are priced again). The placed instance was admitted before the burst was planned: its grace
  is its arrival in the group without the burst (`BurstPlan.receivers` lists the group).

Behind `CoreConfig.burst_scaleout` (off by default). Pure: views and numbers in, a `BurstPlan`
out; the simulator and the placer service (services/placer/burst.py, START_INSTANCE to the
node) start the extra instances (`NodeScheduler.start_instance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.core.admission import Admission, AdmitReason
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.evaluate import evaluate, node_check, slo_check
from shared.core.placement import PlaceAction, PlacementPlan, new_instance_order
from shared.core.startup import StartupChoice, StartupMethod, choose_startup, with_startup
from shared.core.types import ModelSpec, NodeView, RequestView


@dataclass(frozen=True)
class BurstSize:
    instances: int  # to start now, the placed request's included (1: no burst)
    demand: float  # requests expected to need a new instance while it starts
    per_instance: int  # what one instance of the model takes (0: none to measure)


@dataclass(frozen=True)
class BurstSpot:
    node_id: str
    admission: Admission  # a new instance there, validated with the placed request as stand-in
    # how it gets its weights (`new_instance_order`'s choice): the placer adds a multicast one's
    # node to the multicast of the placed request's instance (same model, same sources)
    startup: StartupChoice | None = None


@dataclass(frozen=True)
class BurstPlan:
    size: BurstSize
    spots: tuple[BurstSpot, ...] = ()  # the extra instances (fewer than asked when nodes lack room)
    # the multicast's receivers this burst adds to, in joining order: the placed instance's node
    # (when it receives by multicast), then the spots that do
    receivers: tuple[str, ...] = ()


# Refusals that say an instance has no room for the request's work within the SLO (the shadow
# validation's cases); a refusal for memory or a stale view says nothing about its capacity.
FULL = frozenset({AdmitReason.TTFT_MISS, AdmitReason.HEADROOM, AdmitReason.TPOT_BUDGET,
                  AdmitReason.HORIZON})


def per_instance(plan: PlacementPlan, nodes: Sequence[NodeView]) -> int:
    """The most requests one of the instances that refused the request as full holds (0: none
    did: no measure of what an instance takes)."""
    full = {a.instance_id for a in plan.attempts if a.instance_id is not None and a.reason in FULL}
    return max((len(i.requests) for n in nodes for i in n.instances if i.instance_id in full),
               default=0)


def recent_rate(arrivals: Sequence[float], now: float, window_s: float) -> float:
    """Arrivals per second within (now - window_s, now]."""
    return sum(1 for t in arrivals if now - window_s < t <= now) / window_s


def burst_size(per: int, rate: float, startup_s: float, queued: int, config: CoreConfig) -> BurstSize:
    """How many instances to start at once (module doc): ceil(demand / per), within 1..burst_max."""
    if rate < 0 or startup_s < 0 or queued < 0 or per < 0:
        raise ValueError("rate, startup_s, queued and per must be >= 0")
    demand = rate * startup_s + queued
    if per == 0:
        return BurstSize(1, demand, 0)
    return BurstSize(max(1, min(config.burst_max, math.ceil(demand / per))), demand, per)


def plan_burst(plan: PlacementPlan, request: RequestView, model: ModelSpec,
               ctx: DecisionContext, arrivals: Sequence[float], queued: int = 0) -> BurstPlan:
    """The burst that goes with `plan` (`place`'s answer for `request`, on the same views):
    no extra instance unless the plan starts one and `config.burst_scaleout` is on. `arrivals`:
    the model's recent arrival times (the placer keeps them); `queued`: its requests waiting
    at the placer besides this one."""
    nodes, perf, now, config = ctx.nodes, ctx.perf, ctx.now, ctx.config
    if not config.burst_scaleout or plan.action is not PlaceAction.NEW_INSTANCE:
        return BurstPlan(BurstSize(1, 0.0, 0))
    startup = next((a.startup_s for a in reversed(plan.attempts)
                    if a.node_id == plan.node_id and a.instance_id is None
                    and a.startup_s is not None), 0.0)
    if startup > config.burst_max_startup_s:
        return BurstPlan(BurstSize(1, 0.0, 0))
    size = burst_size(per_instance(plan, nodes),
                      recent_rate(arrivals, now, config.burst_window_s), startup, queued, config)
    if size.instances <= 1:
        return BurstPlan(size)
    eligible = [n for n in nodes if n.node_id != plan.node_id
                and not any(i.model.name == model.name for i in n.instances)
                and node_check(n, config) is None
                and slo_check(perf.get(model.name, n.hardware), request, config) is None]
    views = ctx.with_nodes(_with_placed(nodes, plan, model))
    spots = _choose_spots(request, model, eligible, views, size.instances - 1)
    spots = _priced_in_group(request, model, spots, views)
    placed = (plan.node_id,) if _multicasts(plan.startup) else ()
    return BurstPlan(size, spots, placed + tuple(s.node_id for s in spots
                                                   if _multicasts(s.startup)))


def _multicasts(startup: StartupChoice | None) -> bool:
    return startup is not None and startup.method is not StartupMethod.TIER


def _with_placed(nodes: list[NodeView], plan: PlacementPlan, model: ModelSpec) -> list[NodeView]:
    """The views with the placed instance's multicast under way (its node may not show it yet:
    the placer commits it after the burst is planned, or its reply predates the arrival)."""
    if not _multicasts(plan.startup):
        return list(nodes)
    return [with_startup(n, model.name, plan.startup)
            if n.node_id == plan.node_id and n.storage is not None
            and model.name not in n.storage.arriving else n for n in nodes]


def _choose_spots(request: RequestView, model: ModelSpec, eligible: list[NodeView],
                  ctx: DecisionContext, want: int) -> list[BurstSpot]:
    """Up to `want` spots in `new_instance_order`'s order, each priced with the placed instance
    (on its way in `ctx`'s views) and the spots before it on their way (it joins the same
    multicast after them)."""
    spots: list[BurstSpot] = []
    for first in new_instance_order(request, model, eligible, ctx):
        if len(spots) == want:
            break
        spot = new_instance_order(request, model, [_original(first.node, eligible)], ctx)[0]
        if spot.startup_s > ctx.config.burst_max_startup_s:
            continue
        adm = evaluate(spot.node, None, request, model, ctx.perf, ctx.now, ctx.config)
        if adm.ok:
            spots.append(BurstSpot(spot.node.node_id, adm, spot.startup))
            ctx = ctx.with_nodes([spot.node if n.node_id == spot.node.node_id else n
                                  for n in ctx.nodes])
    return spots


def _original(node: NodeView, eligible: list[NodeView]) -> NodeView:
    return next(n for n in eligible if n.node_id == node.node_id)


def _priced_in_group(request: RequestView, model: ModelSpec, spots: list[BurstSpot],
                     views: DecisionContext) -> tuple[BurstSpot, ...]:
    """Each multicast spot priced at its position in the whole group and validated again; a
    spot that no longer passes leaves (one that now loads from its own tiers leaves the group),
    and the others are priced again, until the group stays as it is."""
    perf, now, config = views.perf, views.now, views.config
    ids = {s.node_id for s in spots}
    # the group's receivers before the spots
    base = views.with_nodes([n for n in views.nodes if n.node_id not in ids])
    before = [n for n in base.nodes if n.storage is not None and model.name in n.storage.arriving]
    originals = {n.node_id: n for n in views.nodes if n.node_id in ids}  # without their own arrival
    for _ in range(len(spots) + 1):
        group = [s.node_id for s in spots if _multicasts(s.startup)]
        priced: list[BurstSpot] = []
        for spot in spots:
            if spot.node_id not in group:
                priced.append(spot)
                continue
            node = originals[spot.node_id]
            position = (len(before) + group.index(spot.node_id), len(before) + len(group))
            choice = choose_startup(node, model, perf.get(model.name, node.hardware), base,
                                    group=position)
            adm = evaluate(with_startup(node, model.name, choice), None, request, model, perf,
                           now, config)
            if adm.ok:
                priced.append(BurstSpot(spot.node_id, adm, choice))
        stable = [p.node_id for p in priced] == [s.node_id for s in spots] and \
            [p.node_id for p in priced if _multicasts(p.startup)] == group
        spots = priced
        if stable:
            break
    return tuple(spots)

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
  are priced again).
- the placed instance first: the burst is planned before the placed request's instance is
  committed, and that instance is priced as the group's first receiver too (`place` priced it
  as a lone multicast; the group's schedule can bring it the model a step or two later), so
  the node admits it with its real arrival and grace (`BurstPlan.placed`). Where its own tiers
  beat its place in the group it loads from them and leaves the group; where it would not
  pass there, the group's last extra instance leaves the burst: the request comes first.
  `BurstPlan.receivers` lists the group in joining order.

Behind `CoreConfig.burst_scaleout` (off by default). Pure: views and numbers in, a `BurstPlan`
out; the simulator and the placer service (services/placer/burst.py, START_INSTANCE to the
node) commit the placed instance as `BurstPlan.placed` says, then start the extra instances
(`NodeScheduler.start_instance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.core.admission import Admission, AdmitReason
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.evaluate import evaluate, node_check, slo_check
from shared.core.lora import admission_through
from shared.core.placement import PlaceAction, PlacementPlan, new_instance_order
from shared.core.startup import (StartupChoice, StartupMethod, choose_startup,
                                 with_helper_stages, with_startup)
from shared.core.types import AdapterSpec, ModelSpec, NodeView, RequestView


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
    # A NEW_INSTANCE plan's own instance as it is to be committed: its startup priced at its
    # place in the group, its admission validated with it (the plan's own without a group)
    placed: BurstSpot | None = None


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
               ctx: DecisionContext, arrivals: Sequence[float], queued: int = 0,
               adapter: AdapterSpec | None = None) -> BurstPlan:
    """The burst that goes with `plan` (`place`'s answer for `request` on `ctx`, before the
    placed instance is committed): no extra instance unless the plan starts one and
    `config.burst_scaleout` is on. `arrivals`: the model's recent arrival times (the placer
    keeps them); `queued`: its requests waiting at the placer besides this one; `adapter`: the
    request's LoRA adapter, as `place` had it."""
    nodes, perf, now, config = ctx.nodes, ctx.perf, ctx.now, ctx.config
    if plan.action is not PlaceAction.NEW_INSTANCE:
        return BurstPlan(BurstSize(1, 0.0, 0))
    own = BurstSpot(plan.node_id, plan.admission, plan.startup)
    if not config.burst_scaleout:
        return BurstPlan(BurstSize(1, 0.0, 0), placed=own)
    startup = next((a.startup_s for a in reversed(plan.attempts)
                    if a.node_id == plan.node_id and a.instance_id is None
                    and a.startup_s is not None), 0.0)
    if startup > config.burst_max_startup_s:
        return BurstPlan(BurstSize(1, 0.0, 0), placed=own)
    size = burst_size(per_instance(plan, nodes),
                      recent_rate(arrivals, now, config.burst_window_s), startup, queued, config)
    if size.instances <= 1:
        return BurstPlan(size, placed=own)
    eligible = [n for n in nodes if n.node_id != plan.node_id
                and not any(i.model.name == model.name for i in n.instances)
                and node_check(n, config) is None
                and slo_check(perf.get(model.name, n.hardware), request, config) is None]
    views = ctx.with_nodes(_with_placed(nodes, own, model))
    spots = _choose_spots(request, model, eligible, views, size.instances - 1)
    placed, priced = _priced_in_group(request, model, own, spots, ctx, adapter)
    return BurstPlan(size, priced, tuple(s.node_id for s in (placed, *priced)
                                         if _multicasts(s.startup)), placed)


def _multicasts(startup: StartupChoice | None) -> bool:
    return startup is not None and startup.method is not StartupMethod.TIER


def _with_placed(nodes: list[NodeView], placed: BurstSpot, model: ModelSpec) -> list[NodeView]:
    """The views with the placed instance's multicast under way and its pipeline's helpers
    holding their stages (the placer commits it after the burst is planned)."""
    if not _multicasts(placed.startup):
        return list(nodes)
    views = [with_startup(n, model.name, placed.startup)
             if n.node_id == placed.node_id and n.storage is not None
             and model.name not in n.storage.arriving else n for n in nodes]
    return with_helper_stages(views, model, placed.startup)


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


def _priced_in_group(request: RequestView, model: ModelSpec, placed: BurstSpot,
                     spots: list[BurstSpot], ctx: DecisionContext,
                     adapter: AdapterSpec | None) -> tuple[BurstSpot, tuple[BurstSpot, ...]]:
    """The placed instance and each multicast spot priced at its position in the whole group
    (the placed one first: the placer commits it, then starts the spots) and validated again,
    on `ctx`'s views without the burst. A spot that no longer passes leaves (one that now loads
    from its own tiers leaves the group); the placed instance leaves the group for its own
    tiers where they now beat its place in it, and where it would not pass at its place the
    group's last spot leaves the burst instead (rare: the spots passed with this request as
    stand-in at later places). Priced again until the group stays as it is (each round that
    changes it drops a spot or the placed instance from it: it ends)."""
    ids = {s.node_id for s in spots}
    others = [n for n in ctx.nodes if n.node_id not in ids]  # the views without the spots
    originals = {n.node_id: n for n in ctx.nodes}  # without an arrival of the burst's
    # the receivers on their way before the group (earlier placements' multicasts)
    before = len([n for n in others if n.node_id != placed.node_id and n.storage is not None
                  and model.name in n.storage.arriving])
    in_group = _multicasts(placed.startup)
    first = placed
    for _ in range(len(spots) + 2):
        group = [s.node_id for s in spots if _multicasts(s.startup)]
        was = in_group
        if in_group:
            first = placed if not group else _priced(
                originals[placed.node_id], (before, before + 1 + len(group)), request, model,
                ctx.with_nodes(others), adapter)
            if not first.admission.ok:  # the request comes first
                spots = [s for s in spots if s.node_id != group[-1]]
                first = placed
                continue
            in_group = _multicasts(first.startup)  # (its own tiers won: it leaves the group)
        lead = before + (1 if in_group else 0)
        base = ctx.with_nodes(_with_placed(others, first, model))
        priced: list[BurstSpot] = []
        for spot in spots:
            if spot.node_id not in group:
                priced.append(spot)
                continue
            position = (lead + group.index(spot.node_id), lead + len(group))
            node = originals[spot.node_id]
            choice = choose_startup(node, model, ctx.profile(model.name, node.hardware), base,
                                    group=position)
            adm = evaluate(with_startup(node, model.name, choice), None, request, model,
                           ctx.perf, ctx.now, ctx.config)
            if adm.ok:
                priced.append(BurstSpot(spot.node_id, adm, choice))
        stable = in_group == was and [p.node_id for p in priced] == [s.node_id for s in spots] \
            and [p.node_id for p in priced if _multicasts(p.startup)] == group
        spots = priced
        if stable:
            break
    return first, tuple(spots)


def _priced(node: NodeView, position: tuple[int, int], request: RequestView, model: ModelSpec,
            ctx: DecisionContext, adapter: AdapterSpec | None) -> BurstSpot:
    """The placed request's new instance on `node` as the receiver at `position` of the group,
    admitted as `place` admits it (`lora.admission_through`)."""
    choice = choose_startup(node, model, ctx.profile(model.name, node.hardware), ctx,
                            group=position)
    adm = admission_through(with_startup(node, model.name, choice), None, request, model, adapter,
                            ctx.perf, ctx.now, ctx.config)
    return BurstSpot(node.node_id, adm, choice)

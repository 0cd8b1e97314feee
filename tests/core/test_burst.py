"""Burst scale-out (shared/core/burst.py): how many instances a burst starts at once, where, and
the node's start of an instance with no request yet."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.admission import AdmitReason
from shared.core.burst import (BurstSize, BurstSpot, burst_size, per_instance, plan_burst,
                               recent_rate)
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.placement import Attempt, PlaceAction, PlacementPlan, place
from shared.core.startup import StartupMethod
from shared.core.types import Hardware, InstanceStatus, StorageView
from tests.core.factories import GB, flat_profile, model, node, perf_for, request

ON = CoreConfig(burst_scaleout=True)


def test_demand_is_the_recent_rate_over_the_startup_plus_the_queue():
    assert recent_rate([0.1, 0.5, 0.9, 1.0], now=1.0, window_s=1.0) == 4.0
    assert recent_rate([0.0, 0.5], now=1.0, window_s=1.0) == 1.0  # (now - window, now]
    size = burst_size(per=5, rate=20.0, startup_s=1.1, queued=3, config=ON)
    assert size == BurstSize(math.ceil((22 + 3) / 5), pytest.approx(25.0), 5)


def test_no_instance_to_measure_means_no_burst_and_the_cap_holds():
    assert burst_size(0, 100.0, 2.0, 10, ON).instances == 1
    assert burst_size(1, 100.0, 2.0, 0, ON).instances == ON.burst_max
    assert burst_size(10, 1.0, 1.0, 0, ON).instances == 1  # one instance covers it
    with pytest.raises(ValueError):
        burst_size(1, -1.0, 1.0, 0, ON)
    with pytest.raises(ValueError):
        CoreConfig(burst_max=0)
    with pytest.raises(ValueError):
        CoreConfig(burst_window_s=0.0)


@settings(max_examples=300, deadline=None)
@given(per=st.integers(0, 60), rate=st.floats(0, 200), startup=st.floats(0, 20),
       queued=st.integers(0, 100), cap=st.integers(1, 16), more=st.floats(0, 50))
def test_a_burst_is_the_fewest_instances_that_cover_the_demand_within_the_cap(
        per, rate, startup, queued, cap, more):
    config = CoreConfig(burst_scaleout=True, burst_max=cap)
    size = burst_size(per, rate, startup, queued, config)
    assert 1 <= size.instances <= cap
    if per:
        # covers the demand unless capped, and one instance fewer would not
        assert size.instances * per >= min(size.demand, cap * per) - 1e-9
        assert size.instances == 1 or (size.instances - 1) * per < size.demand
    assert burst_size(per, rate + more, startup, queued, config).instances >= size.instances


def _cluster(config: CoreConfig, nodes: int = 4, full: int = 3):
    """Node n0 holds a loading instance of m with `full` requests; a request more misses its
    TTFT there (each prefill 0.3 s, TTFT SLO 1 s), so `place` starts a new instance."""
    spec = model("m", weight_gb=10.0)
    perf = perf_for(flat_profile("m", Hardware.GPU, prefill_s=0.3, load_s=1.0))
    scheds = [node(f"n{i}", perf=perf, config=config) for i in range(nodes)]
    for i in range(full):
        assert scheds[0].admit(request(f"q{i}"), scheds[0].node.instances[0].instance_id
                               if i else None, spec, 0.0).admission.ok
    return spec, perf, scheds


def test_a_burst_starts_the_instances_its_arrivals_need_on_other_nodes():
    spec, perf, scheds = _cluster(ON)
    views = [s.node for s in scheds]
    new = request("r", arrival=0.5)
    plan = place(new, spec, DecisionContext(views, perf, 0.5, ON))
    assert plan.action is PlaceAction.NEW_INSTANCE  # (packed beside the full one on n0)
    arrivals = [0.5 - 0.1 * i for i in range(8)]  # 8 in the last second: 8/s over a 1 s startup
    burst = plan_burst(plan, new, spec, DecisionContext(views, perf, 0.5, ON), arrivals)
    assert burst.size.per_instance == 3 and burst.size.instances == math.ceil(8 * 1.0 / 3)
    nodes = [s.node_id for s in burst.spots]
    assert len(nodes) == burst.size.instances - 1 == len(set(nodes))
    assert plan.node_id not in nodes and "n0" not in nodes  # n0 serves m already
    assert all(s.admission.ok for s in burst.spots)


def test_nodes_bound_a_burst_and_it_is_off_by_default_and_for_other_plans():
    spec, perf, scheds = _cluster(ON, nodes=2)
    views = [s.node for s in scheds]
    new = request("r", arrival=0.5)
    plan = place(new, spec, DecisionContext(views, perf, 0.5, ON))
    arrivals = [0.5] * 40
    burst = plan_burst(plan, new, spec, DecisionContext(views, perf, 0.5, ON), arrivals)
    assert burst.size.instances == ON.burst_max  # 40/s over a 1 s startup, 3 per instance
    # n0 serves m already (its instance refused): the one other node, unless the plan took it
    assert [s.node_id for s in burst.spots] == ([] if plan.node_id == "n1" else ["n1"])
    off = plan_burst(plan, new, spec, DecisionContext(views, perf, 0.5, CoreConfig()), arrivals)
    assert off.size.instances == 1 and not off.spots
    routed = PlacementPlan(PlaceAction.ROUTE, "n0", views[0].instances[0].instance_id)
    at = DecisionContext(views, perf, 0.5, ON)
    assert plan_burst(routed, new, spec, at, arrivals).spots == ()


def test_a_node_starts_an_empty_instance_that_later_requests_join():
    spec, perf, scheds = _cluster(ON, nodes=2, full=0)
    sched = scheds[1]
    result = sched.start_instance(request("like"), spec, 0.0)
    assert result.admission.ok and result.start_ops
    inst = sched.node.instance(result.instance_id)
    assert inst.status is InstanceStatus.LOADING and inst.requests == []
    assert sched.node.budget_bytes >= spec.weight_bytes
    joined = sched.admit(request("r"), result.instance_id, spec, 0.1)
    assert joined.admission.ok and [r.request_id for r in inst.requests] == ["r"]
    assert joined.admission.grace_s == pytest.approx(0.9)  # what is left of the load


def test_an_empty_instance_keeps_alive_from_when_it_is_ready_not_from_its_start():
    spec, perf, scheds = _cluster(ON, nodes=2, full=0)
    sched = scheds[1]
    result = sched.start_instance(request("like"), spec, 0.0)
    load_done = 5.0 * ON.keep_alive_s  # a load longer than the keep-alive
    for op in result.start_ops:
        sched.memop_done(op, load_done)
    inst = sched.node.instance(result.instance_id)
    assert inst.status is InstanceStatus.READY
    assert sched.reclaim_idle(load_done + 0.5 * ON.keep_alive_s) == []  # a request may join
    assert sched.next_reclaim_at() == pytest.approx(load_done + ON.keep_alive_s)
    assert [op.instance_id for op in sched.reclaim_idle(load_done + ON.keep_alive_s)] \
        == [result.instance_id]


def test_a_node_without_room_refuses_an_empty_instance():
    spec = model("m", weight_gb=100.0)
    perf = perf_for(flat_profile("m", Hardware.GPU))
    result = node("n0", perf=perf, config=ON).start_instance(request("like"), spec, 0.0)
    assert result.admission.reason is AdmitReason.MEMORY and result.instance_id is None


def test_a_slow_start_is_no_burst_and_slow_nodes_are_left_out():
    spec, perf, scheds = _cluster(ON)
    views = [s.node for s in scheds]
    new = request("r", arrival=0.5)
    plan = place(new, spec, DecisionContext(views, perf, 0.5, ON))
    arrivals = [0.5] * 40
    slow = CoreConfig(burst_scaleout=True, burst_max_startup_s=0.5)  # every load takes 1 s
    slow_ctx, on_ctx = DecisionContext(views, perf, 0.5, slow), DecisionContext(views, perf, 0.5, ON)
    assert plan_burst(plan, new, spec, slow_ctx, arrivals).size.instances == 1
    assert plan_burst(plan, new, spec, on_ctx, arrivals).size.instances > 1


def test_only_instances_refused_as_full_measure_what_an_instance_takes():
    spec, perf, scheds = _cluster(ON)
    views = [s.node for s in scheds]
    iid = views[0].instances[0].instance_id
    full = PlacementPlan(PlaceAction.NEW_INSTANCE, "n1", attempts=(
        Attempt("n0", iid, AdmitReason.HEADROOM),))
    out_of_memory = PlacementPlan(PlaceAction.NEW_INSTANCE, "n1", attempts=(
        Attempt("n0", iid, AdmitReason.MEMORY),))
    assert per_instance(full, views) == 3 and per_instance(out_of_memory, views) == 0


def test_each_extra_instance_carries_its_startup_a_multicast_from_the_placed_ones_sources():
    """The placer joins the burst's extra instances to the placed instance's multicast: a spot
    says how it gets its weights, and with one DRAM holder every spot receives from it."""
    spec = model("m", weight_gb=10.0)
    perf = perf_for(replace(flat_profile("m", Hardware.GPU, prefill_s=0.3, load_s=30.0),
                            engine_init_s=0.2))
    scheds = [node(f"n{i}", perf=perf, config=ON) for i in range(5)]
    tiers = {"dram": 20 * GB, "registry": 0.5 * GB}  # the registry: 20 s; a 100 Gb/s multicast: ~1 s
    for s in scheds:
        s.node.storage = StorageView(tiers, {}, multicast_bytes_per_s=12.5 * GB)
    scheds[4].node.storage.holds["m"] = "dram"  # the holder: no room for an instance
    scheds[4].node.memory_bytes = scheds[4].node.budget_bytes
    for i in range(3):
        assert scheds[0].admit(request(f"q{i}"), scheds[0].node.instances[0].instance_id
                               if i else None, spec, 0.0).admission.ok
    views = [s.node for s in scheds]
    new = request("r", arrival=0.5)
    plan = place(new, spec, DecisionContext(views, perf, 0.5, ON))
    assert plan.action is PlaceAction.NEW_INSTANCE and plan.startup.method is StartupMethod.MULTICAST
    burst = plan_burst(plan, new, spec, DecisionContext(views, perf, 0.5, ON), [0.5] * 40)
    assert len(burst.spots) == 2  # n1..n3 but the plan's node; n0 serves m, n4 has no room
    assert plan.node_id not in {s.node_id for s in burst.spots}
    assert all(s.startup.method is StartupMethod.MULTICAST and s.startup.sources == ("n4",)
               for s in burst.spots)
    assert plan.startup.sources == ("n4",)


def _burst_cluster(spec, perf, nodes: int):
    """n0 serves m with 3 requests (full for the next), n1.. are empty, the last holds m in its
    DRAM tier with no room for an instance: every new instance receives m from it."""
    scheds = [node(f"n{i}", perf=perf, config=ON) for i in range(nodes)]
    tiers = {"dram": 20 * GB, "registry": 0.5 * GB}
    for s in scheds:
        s.node.storage = StorageView(tiers, {}, multicast_bytes_per_s=12.5 * GB)
    scheds[-1].node.storage.holds["m"] = "dram"
    scheds[-1].node.memory_bytes = scheds[-1].node.budget_bytes
    for i in range(3):
        assert scheds[0].admit(request(f"q{i}"), scheds[0].node.instances[0].instance_id
                               if i else None, spec, 0.0).admission.ok
    return scheds


def test_a_bursts_instances_are_priced_at_their_arrival_in_the_groups_real_schedule():
    """One multicast feeds the placed instance and the burst's: the k-way schedule over all of
    them is what the nodes run, so each extra instance's planned arrival (its grace) is its step
    in that group's schedule, not the schedule it would have alone."""
    from shared.core.multicast import step_seconds, whole_steps

    spec = model("m", weight_gb=10.0)
    perf = perf_for(replace(flat_profile("m", Hardware.GPU, prefill_s=0.3, load_s=30.0),
                            engine_init_s=0.2))
    scheds = _burst_cluster(spec, perf, 6)
    views = [s.node for s in scheds]
    new = request("r", arrival=0.5, ttft=3.0)
    plan = place(new, spec, DecisionContext(views, perf, 0.5, ON))
    assert plan.action is PlaceAction.NEW_INSTANCE
    assert plan.startup.method is StartupMethod.MULTICAST
    burst = plan_burst(plan, new, spec, DecisionContext(views, perf, 0.5, ON), [0.5] * 40)
    assert len(burst.spots) == 3  # n1..n4 but the plan's node
    step = step_seconds(spec.weight_bytes, ON.multicast_blocks, 12.5 * GB)
    group = whole_steps(5, 1, ON.multicast_blocks)  # the holder -> the placed + 3 extra
    for position, spot in enumerate(burst.spots, start=1):
        assert spot.startup.method is StartupMethod.MULTICAST
        assert spot.startup.arrive_s == pytest.approx(ON.multicast_setup_s
                                                      + group[1 + position] * step), position
        assert spot.admission.grace_s == pytest.approx(spot.startup.load_s)
    assert burst.receivers == (plan.node_id, *(s.node_id for s in burst.spots))


def _group_burst(placed_tier_bytes_per_s: float | None = None):
    """`_burst_cluster` with 6 nodes: the placed instance lands on n1, the burst adds n2..n4, all
    receiving m from n5 (a 10 GB model, 100 Gb/s: a step is 0.05 s). With a rate, n1 also holds
    m on a local disk that fast."""
    spec = model("m", weight_gb=10.0)
    perf = perf_for(replace(flat_profile("m", Hardware.GPU, prefill_s=0.3, load_s=30.0),
                            engine_init_s=0.2))
    scheds = _burst_cluster(spec, perf, 6)
    if placed_tier_bytes_per_s is not None:
        storage = scheds[1].node.storage
        scheds[1].node.storage = replace(storage, holds={"m": "disk"}, bytes_per_s={
            **storage.bytes_per_s, "disk": placed_tier_bytes_per_s})
    views = [s.node for s in scheds]
    new = request("r", arrival=0.5, ttft=3.0)
    ctx = DecisionContext(views, perf, 0.5, ON)
    plan = place(new, spec, ctx)
    assert plan.action is PlaceAction.NEW_INSTANCE and plan.node_id == "n1"
    assert plan.startup.method is StartupMethod.MULTICAST
    return spec, plan, plan_burst(plan, new, spec, ctx, [0.5] * 40)


def test_the_placed_requests_instance_is_priced_at_its_arrival_in_the_group_it_starts():
    """`place` prices the placed request's instance as a lone multicast (16 steps for one
    receiver); the burst makes it the first of four receivers of one multicast, whose schedule
    brings it the model a step later. The burst is planned before the instance is committed, and
    the startup it gives the placed instance (what the placer sends with its ADMIT) is its
    arrival in the group, its admission's grace that arrival's load."""
    from shared.core.multicast import step_seconds, whole_steps

    spec, plan, burst = _group_burst()
    step = step_seconds(spec.weight_bytes, ON.multicast_blocks, 12.5 * GB)
    alone, group = whole_steps(2, 1, ON.multicast_blocks), whole_steps(5, 1, ON.multicast_blocks)
    assert plan.startup.arrive_s == pytest.approx(ON.multicast_setup_s + alone[1] * step)
    assert [s.node_id for s in burst.spots] == ["n2", "n3", "n4"]
    placed = burst.placed
    assert placed.node_id == plan.node_id and placed.startup.method is StartupMethod.MULTICAST
    assert placed.startup.arrive_s == pytest.approx(ON.multicast_setup_s + group[1] * step)
    assert placed.startup.arrive_s > plan.startup.arrive_s
    assert placed.admission.ok and placed.admission.grace_s == pytest.approx(placed.startup.load_s)
    assert burst.receivers == ("n1", "n2", "n3", "n4")


def test_a_placed_instance_whose_own_tier_beats_its_place_in_the_group_loads_from_it():
    """n1's disk (1.375 s for the model, 1.575 s with the engine's start) loses to a lone
    multicast (1.55 s), which `place` chose, but beats its arrival as the first of four (1.6 s):
    it loads from its disk, leaves the group, and the three extra instances are priced as a
    group of three."""
    from shared.core.multicast import step_seconds, whole_steps

    spec, plan, burst = _group_burst(placed_tier_bytes_per_s=10 * GB / 1.375)
    assert plan.startup.load_s == pytest.approx(1.55) and plan.startup.tier_s == pytest.approx(1.575)
    placed = burst.placed
    assert placed.startup.method is StartupMethod.TIER
    assert placed.startup.load_s == pytest.approx(1.575) and placed.admission.ok
    assert burst.receivers == ("n2", "n3", "n4")
    step = step_seconds(spec.weight_bytes, ON.multicast_blocks, 12.5 * GB)
    three = whole_steps(4, 1, ON.multicast_blocks)
    for position, spot in enumerate(burst.spots):
        assert spot.startup.arrive_s == pytest.approx(ON.multicast_setup_s
                                                      + three[1 + position] * step), position


def test_without_extra_instances_in_its_multicast_the_placed_instance_keeps_its_plan():
    spec, perf, scheds = _cluster(ON, nodes=2)
    views = [s.node for s in scheds]
    new = request("r", arrival=0.5)
    ctx = DecisionContext(views, perf, 0.5, ON)
    plan = place(new, spec, ctx)
    burst = plan_burst(plan, new, spec, ctx, [0.5] * 40)
    assert burst.placed == BurstSpot(plan.node_id, plan.admission, plan.startup)
    off = plan_burst(plan, new, spec, DecisionContext(views, perf, 0.5, CoreConfig()), [0.5] * 40)
    assert off.placed == burst.placed

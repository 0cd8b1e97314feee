"""Predictive pre-warming (`shared.core.prewarm`, Shahrad et al. ATC'20's hybrid histogram
policy): the idle-time histogram, the policy's windows, the tracker, and the plan that starts
instances only where a node has memory to spare."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.lora import preload_room
from shared.core.placement import PlaceAction, place
from shared.core.prewarm import (IdleHistogram, IdleTracker, PrewarmConfig, Windows, fits,
                                 gives_way, keep_alive_spec, plan_prewarms, policy,
                                 spare_instances, stand_in)
from shared.core.types import Hardware, InstanceStatus

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request

# 10-second bins over 4 minutes: hand-worked percentiles stay small numbers
CFG = PrewarmConfig(bin_s=10.0, bins=24, min_samples=5)


def _hist(*idle_s: float, config: PrewarmConfig = CFG) -> IdleHistogram:
    hist = IdleHistogram.empty(config)
    for s in idle_s:
        hist.add(s, config)
    return hist


# --- the histogram ----------------------------------------------------------------------------
def test_idle_times_fall_in_their_bins_and_beyond_the_range_apart():
    hist = _hist(0.0, 9.99, 10.0, 239.9, 240.0, 1e6)
    assert hist.counts[0] == 2 and hist.counts[1] == 1 and hist.counts[23] == 1
    assert hist.beyond == 2 and hist.in_range == 4 and hist.total == 6


def test_percentile_bins_count_only_idle_times_in_range():
    hist = _hist(*[5.0] * 19, 235.0)
    assert hist.percentile_bin(5) == 0
    assert hist.percentile_bin(95) == 0  # 19 of 20 in the first bin
    assert hist.percentile_bin(99) == 23


def test_the_coefficient_of_variation_is_high_for_a_concentrated_histogram():
    assert _hist().cv() == 0.0
    assert _hist(*[10.0 * i + 1 for i in range(24)]).cv() == 0.0  # one per bin: even
    assert _hist(*[55.0] * 10).cv() == pytest.approx(23 ** 0.5)  # all in one of 24 bins


# --- the policy -------------------------------------------------------------------------------
def test_a_representative_histogram_gives_head_and_tail_with_their_margins():
    # every idle time in [100, 110): head = 100 s (lower edge), tail = 110 s (upper edge)
    w = policy(_hist(*[100.0 + i * 0.5 for i in range(20)]), CFG, fixed_keep_alive_s=1.0)
    assert w.source == "histogram" and w.predicted
    assert w.prewarm_s == pytest.approx(90.0)  # 10% earlier
    assert w.keep_alive_s == pytest.approx(110 * 1.1 - 90.0)  # until 10% past the tail


def test_calls_that_follow_at_once_keep_the_instance_for_the_tail_with_no_prewarm():
    w = policy(_hist(*[1.0] * 20, 25.0), CFG, fixed_keep_alive_s=1.0)
    assert w.predicted and w.prewarm_s == 0.0
    assert w.keep_alive_s == pytest.approx(30.0 * 1.1)  # the 99th percentile's bin, [20, 30)


def test_too_few_idle_times_keep_the_fixed_window():
    assert policy(_hist(100.0, 100.0, 100.0, 100.0), CFG, 1.0) == Windows(0.0, 1.0, "fixed")


def test_evenly_spread_idle_times_keep_the_fixed_window():
    even = _hist(*[10.0 * i + 1 for i in range(24)] * 2)
    assert even.cv() < CFG.cv_min
    assert policy(even, CFG, 1.0) == Windows(0.0, 1.0, "fixed")


def test_idle_times_mostly_beyond_the_range_keep_the_fixed_window():
    """The paper forecasts these with ARIMA; here they keep the fixed window."""
    w = policy(_hist(*[100.0] * 4, *[1000.0] * 5), CFG, 1.0)
    assert w == Windows(0.0, 1.0, "beyond_range") and not w.predicted
    # a minority beyond the range does not: the in-range ones decide
    assert policy(_hist(*[100.0] * 8, 1000.0), CFG, 1.0).predicted


def test_the_config_refuses_nonsense():
    with pytest.raises(ValueError):
        PrewarmConfig(bin_s=0)
    with pytest.raises(ValueError):
        PrewarmConfig(head_pct=50, tail_pct=10)
    with pytest.raises(ValueError):
        PrewarmConfig(beyond_max=2)


# --- the tracker ------------------------------------------------------------------------------
def test_an_idle_time_runs_from_the_last_call_in_flight_ending_to_the_next_call():
    t = IdleTracker(CFG)
    assert not t.started("m", 0.0)  # never idle before: no idle time
    t.started("m", 1.0)
    assert not t.ended("m", 2.0)  # one still in flight
    assert t.ended("m", 3.0)
    assert t.started("m", 58.0)  # idle 55 s
    assert t.models["m"].hist.counts[5] == 1 and t.models["m"].hist.total == 1


def _trained(idle_s: float = 100.0, n: int = 20, config: PrewarmConfig = CFG,
             name: str = "m", now: float = 0.0) -> tuple[IdleTracker, float]:
    """A tracker that saw `n` idle times of `idle_s`, the model idle since the returned time."""
    t = IdleTracker(config)
    for _ in range(n + 1):
        t.started(name, now)
        t.ended(name, now + 1.0)
        now += 1.0 + idle_s
    return t, now - idle_s


def test_a_prewarm_is_due_once_per_idle_period_and_never_while_a_call_runs():
    t, idle_since = _trained()
    at = t.prewarm_at("m", 1.0)
    assert at == pytest.approx(idle_since + 90.0)
    t.mark_prewarmed("m")
    assert t.prewarm_at("m", 1.0) is None  # planned already in this idle period
    t.started("m", idle_since + 100.0)
    assert t.prewarm_at("m", 1.0) is None  # a call in flight
    t.ended("m", idle_since + 101.0)
    assert t.prewarm_at("m", 1.0) == pytest.approx(idle_since + 101.0 + 90.0)


def test_the_keep_alive_follows_the_policy_only_where_nothing_else_set_it():
    spec = model("m")
    soon = Windows(0.0, 33.0, "histogram")
    assert keep_alive_spec(spec, soon).keep_alive_s == 33.0
    assert keep_alive_spec(spec, Windows(0.0, 1.0, "fixed")) is spec
    # a pre-warm brings it back: the instance that served keeps the fixed window
    assert keep_alive_spec(spec, Windows(90.0, 31.0, "histogram")) is spec
    registered = replace(spec, keep_alive_s=300.0)
    assert keep_alive_spec(registered, soon) is registered


# --- the plan ---------------------------------------------------------------------------------
PERF = perf_for(*(flat_profile(f"s{i}", Hardware.GPU) for i in range(4)),
                flat_profile("m", Hardware.GPU))


def _serving_node(node_id: str, memory_gb: float, serving: list[tuple[float, int]],
                  config: CoreConfig = CoreConfig(), at: float = 0.0):
    """A node with one ready instance per (weights in GB, input tokens) serving one request
    that arrived at `at`."""
    sched = node(node_id, Hardware.GPU, memory_gb, PERF, config)
    for i, (weight_gb, tokens) in enumerate(serving):
        loaded(sched, None, request(f"{node_id}r{i}", f"s{i}", tokens, at, max_tokens=64),
               model(f"s{i}", weight_gb, kv_per_token=1 << 20), at)
    return sched


def test_a_due_model_with_no_instance_is_planned_on_the_node_with_most_room():
    t, idle_since = _trained()
    now = idle_since + 95.0
    small = _serving_node("a", 20, [(8.0, 100)], at=now)
    big = _serving_node("b", 40, [(8.0, 100)], at=now)
    plans = plan_prewarms(t, {"m": model("m", 4.0)}, [small.view(), big.view()], PERF, now,
                          CoreConfig())
    assert [(p.model, p.node_id, p.at) for p in plans] == [("m", "b", now)]
    assert plans[0].keep_alive_s == pytest.approx(110 * 1.1 - 90.0)
    assert plan_prewarms(t, {"m": model("m", 4.0)}, [big.view()], PERF, now, CoreConfig()) == []


def test_nothing_is_planned_before_its_time_nor_for_a_model_with_an_instance():
    t, idle_since = _trained()
    sched = _serving_node("a", 40, [])
    specs = {"m": model("m", 4.0)}
    assert plan_prewarms(t, specs, [sched.view()], PERF, idle_since + 80.0, CoreConfig()) == []
    loaded(sched, None, request("r", "m"), specs["m"])  # still loaded somewhere
    assert plan_prewarms(t, specs, [sched.view()], PERF, idle_since + 95.0, CoreConfig()) == []


def test_no_prewarm_on_a_full_or_draining_node():
    t, idle_since = _trained()
    full = _serving_node("a", 12, [(8.0, 100)], at=idle_since)  # 4 GB of weights leave no room for the growth
    assert not fits(full.view(), model("m", 4.0), PERF, idle_since, CoreConfig())
    draining = _serving_node("b", 80, [])
    draining.node.draining = True
    assert plan_prewarms(t, {"m": model("m", 4.0)}, [full.view(), draining.view()], PERF,
                         idle_since + 95.0, CoreConfig()) == []


def test_the_stand_in_asks_for_the_smallest_kv_pool():
    r = stand_in(model("m"), 5.0)
    assert r.input_len == 1 and r.max_tokens == 1 and r.arrival == 5.0 and r.model == "m"


# --- properties -------------------------------------------------------------------------------
serving_sets = st.lists(st.tuples(st.floats(0.5, 12.0), st.integers(1, 900)), max_size=3)


@given(memory_gb=st.floats(4.0, 48.0), serving=serving_sets, weight_gb=st.floats(0.5, 16.0),
       watermark=st.sampled_from([0.0, 0.25, 0.5]), late_s=st.floats(0.0, 30.0))
@settings(max_examples=150, deadline=None)
def test_a_prewarm_stays_within_the_ledger_and_displaces_no_serving_instance(
        memory_gb, serving, weight_gb, watermark, late_s):
    config = CoreConfig(watermark=watermark, prewarm=True)
    t, idle_since = _trained()
    now = idle_since + 90.0 + late_s
    try:
        sched = _serving_node("a", memory_gb, serving, config, at=now)
    except AssertionError:  # the serving instances themselves do not fit: not a case
        return
    spec = model("m", weight_gb)
    before = {i.instance_id: (i.status, i.kv_bytes, [r.request_id for r in i.requests])
              for i in sched.node.instances}
    view = sched.view()
    room = preload_room(view, watermark)
    plans = plan_prewarms(t, {"m": spec}, [view], PERF, now, config)
    if not plans:
        return
    # planned only into the room the serving instances' next KV growth leaves
    assert spec.weight_bytes <= room
    result = sched.start_instance(stand_in(spec, now), spec, now)
    assert result.admission.ok and not result.evicted and not result.migrating
    assert sched.ledger.budget <= sched.ledger.capacity
    assert sched.ledger.pessimistic <= sched.ledger.capacity
    after = {i.instance_id: (i.status, i.kv_bytes, [r.request_id for r in i.requests])
             for i in sched.node.instances if i.instance_id in before}
    assert after == before  # every serving instance untouched
    new = sched.node.instance(result.instance_id)
    assert new.status is InstanceStatus.LOADING and not new.requests
    assert all(op.instance_id == result.instance_id for op in result.start_ops)


@given(idle=st.lists(st.floats(0.0, 400.0), max_size=40), fixed=st.floats(0.0, 5.0))
@settings(max_examples=200, deadline=None)
def test_the_policy_falls_back_to_the_fixed_window_or_covers_the_tail(idle, fixed):
    w = policy(_hist(*idle), CFG, fixed)
    if not w.predicted:
        assert w.prewarm_s == 0.0 and w.keep_alive_s == fixed
        return
    in_range = sorted(s for s in idle if s < CFG.range_s)
    head = in_range[max(1, math.ceil(0.05 * len(in_range))) - 1]
    tail = in_range[max(1, math.ceil(0.99 * len(in_range))) - 1]
    assert 0.0 <= w.prewarm_s <= head  # warm before the 5th-percentile call
    assert w.prewarm_s + w.keep_alive_s > tail  # and still warm at the 99th-percentile one


# --- what the policy keeps gives way -------------------------------------------------------------
def _idle_node(config: CoreConfig, memory_gb: float = 20.0):
    """A node holding one idle, ready instance of s0 (10 GB) started at t=0 with no call (a
    pre-warm), and the 12 GB model m that needs its memory."""
    sched = node("a", Hardware.GPU, memory_gb, PERF, config)
    kept = model("s0", 10.0)
    res = sched.start_instance(stand_in(kept, 0.0), kept, 0.0)
    pending = list(res.start_ops)
    while pending:
        pending.extend(sched.memop_done(pending.pop(0), 0.0))
    return sched, res.instance_id, model("m", 12.0)


def test_an_idle_instance_only_the_policy_keeps_gives_way_to_a_new_instance():
    config = CoreConfig(prewarm=True)
    sched, kept, spec = _idle_node(config)
    ctx = DecisionContext([sched.view()], PERF, 5.0, config)
    plan = place(request("r", "m", arrival=5.0), spec, ctx)
    assert plan.action is PlaceAction.PREEMPT_AND_ROUTE and plan.instance_id is None
    assert plan.preempt == (kept,) and not plan.migrations
    result = sched.preempt_and_admit(list(plan.preempt), request("r", "m", arrival=5.0), None,
                                     spec, 5.0)
    assert result.admission.ok and not result.evicted
    assert sched.node.instance(kept).status is InstanceStatus.UNLOADING
    assert sched.ledger.budget <= sched.ledger.capacity


def test_nothing_gives_way_with_prewarming_off_within_the_fixed_window_or_when_serving():
    off, _, spec = _idle_node(CoreConfig())
    plan = place(request("r", "m", arrival=5.0), spec,
                 DecisionContext([off.view()], PERF, 5.0, CoreConfig()))
    assert plan.action in (PlaceAction.QUEUE, PlaceAction.DROP)  # SLINFER: a new one preempts nobody
    config = CoreConfig(prewarm=True)
    sched, kept, _ = _idle_node(config)
    inst = sched.node.instance(kept)
    assert not gives_way(inst, 0.5, config)  # within the fixed 1 s keep-alive
    assert gives_way(inst, 1.0, config) and not gives_way(inst, 1.0, CoreConfig())
    inst.pinned = True
    assert not gives_way(inst, 5.0, config)
    inst.pinned = False
    inst.requests.append(request("q", "s0"))
    assert not gives_way(inst, 5.0, config) and spare_instances(sched.node, 5.0, config) == set()

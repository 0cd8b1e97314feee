"""The measured busy fraction (`shared.core.busy.BusyMeter`): a window, its decay, and what the
node scheduler measures with it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.busy import BusyMeter
from shared.core.types import Hardware

from .factories import GB, loaded, node, perf_for, request
from .test_module_scaling import proportional, spec


def duty(meter: BusyMeter, start: float, periods: int, period_s: float,
         busy_s: float) -> BusyMeter:
    """Busy the first `busy_s` of each period."""
    for k in range(periods):
        t = start + k * period_s
        meter = meter.observe(t, t + busy_s)
    return meter


def test_a_steady_duty_cycle_reads_as_its_share_from_the_first_periods_on():
    meter = BusyMeter.start(10.0, 0.0)
    early = duty(meter, 0.0, 3, 1.0, 0.3)  # 3 s observed, under a window
    assert early.fraction(3.0) == pytest.approx(0.3, abs=0.03)  # no ramp from 0
    steady = duty(meter, 0.0, 100, 1.0, 0.3)
    assert steady.fraction(100.0) == pytest.approx(0.3, abs=0.02)
    assert steady.observed_s(100.0) == 100.0


def test_idle_time_decays_it_with_the_window_as_time_constant():
    busy = BusyMeter.start(10.0, 0.0).observe(0.0, 100.0)  # busy ten windows long
    assert busy.fraction(100.0) == pytest.approx(1.0)
    # idle one window: e^-1 of the weight is the busy past, the rest the idle window
    assert busy.fraction(110.0) == pytest.approx(math.exp(-1), rel=1e-3)
    assert busy.fraction(150.0) < 0.01  # five windows idle: ~0
    # the meter is not changed by reading it
    assert busy.fraction(100.0) == pytest.approx(1.0)


def test_work_a_few_windows_ago_weighs_less_than_work_now():
    old = BusyMeter.start(5.0, 0.0).observe(0.0, 1.0)  # a 1 s burst at the start
    recent = BusyMeter.start(5.0, 0.0).observe(29.0, 30.0)  # the same burst just now
    assert old.fraction(30.0) < 0.01 < recent.fraction(30.0)
    assert recent.fraction(30.0) == pytest.approx(1 - math.exp(-1 / 5), rel=1e-2)


def test_a_sampled_busy_counter_reads_like_the_intervals_it_counts():
    """A host samples its stage's forward seconds: the delta over each sampling period."""
    exact = duty(BusyMeter.start(10.0, 0.0), 0.0, 60, 0.5, 0.1)  # busy 20% in 0.1 s bursts
    sampled = BusyMeter.start(10.0, 0.0)
    for k in range(15):  # every 2 s: 0.4 s of forwards counted
        sampled = sampled.observe(2.0 * k, 2.0 * (k + 1), busy_s=0.4)
    assert sampled.fraction(30.0) == pytest.approx(exact.fraction(30.0), abs=0.02)
    assert sampled.fraction(30.0) == pytest.approx(0.2, abs=0.01)


def test_overlapping_and_future_observations():
    meter = BusyMeter.start(10.0, 0.0).observe(0.0, 2.0)
    again = meter.observe(1.0, 2.0)  # already counted: nothing changes
    assert again == meter
    half = meter.observe(1.0, 3.0)  # the part after 2.0 only
    assert half.at == 3.0 and half.fraction(3.0) == pytest.approx(1.0)
    ahead = meter.observe(5.0, 6.0)  # queued work ahead of now counts as done
    assert ahead.fraction(4.0) == ahead.fraction(6.0)
    with pytest.raises(ValueError):
        BusyMeter.start(0.0, 0.0)


@settings(max_examples=200, deadline=None)
@given(window=st.floats(0.1, 100.0),
       spans=st.lists(st.tuples(st.floats(0.0, 50.0), st.floats(0.0, 20.0),
                                st.floats(0.0, 1.0)), max_size=30),
       later=st.floats(0.0, 100.0))
def test_the_fraction_stays_a_share(window, spans, later):
    meter = BusyMeter.start(window, 0.0)
    t = 0.0
    for gap, length, share in spans:
        start = t + gap
        meter = meter.observe(start, start + length, busy_s=share * length)
        t = start + length
        assert 0.0 <= meter.fraction(t) <= 1.0
    assert 0.0 <= meter.fraction(t + later) <= 1.0
    assert meter.fraction(t + later) <= meter.fraction(t) + 1e-12  # idle only lowers it


def test_the_node_scheduler_measures_each_instances_busy_fraction():
    perf = perf_for(proportional())
    sched = node("a", Hardware.CPU, 8.0, perf)
    iid = loaded(sched, None, request("r1", ttft=5.0), spec())
    inst = sched.node.instance(iid)
    assert inst.busy is None  # nothing ran yet
    t = 0.0
    for _ in range(50):  # an iteration, then as long idle: busy half the time
        plan = sched.step(t)
        assert plan.iteration is not None
        sched.finish_iteration(plan.iteration, t + 0.2)
        t += 0.4
    busy = sched.view().instance(iid).busy
    assert busy.window_s == sched.config.busy_window_s
    assert busy.fraction(t) == pytest.approx(0.5, abs=0.05)


def test_a_hosts_measured_stage_load_replaces_the_planned_one():
    perf = perf_for(proportional())
    host = node("b", Hardware.CPU, 8.0, perf)
    host.hold("x/layers/6:8", GB // 4, 0.0, load=0.25)
    host.hold("y/layers/0:2", GB // 4, 0.0, load=0.2)
    assert host.view().stage_load == pytest.approx(0.45)
    host.stage_measured("x/layers/6:8", 0.04)
    assert host.view().stage_load == pytest.approx(0.24)
    host.stage_measured("z/layers/0:1", 0.5)  # not held here: ignored
    assert host.view().stage_load == pytest.approx(0.24)
    host.hold("x/layers/6:8", GB // 2, 0.0)  # the bytes follow the stage; its load stays
    assert host.view().stage_load == pytest.approx(0.24)
    host.hold("x/layers/6:8", 0, 0.0)
    assert host.view().stage_load == pytest.approx(0.2)

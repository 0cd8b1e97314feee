"""shared/core/cost.py answers what an instance costs in one place; where another module still
computes the same quantity its own way, these tests tie the two together."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.core.config import CoreConfig
from shared.core.cost import (contended, contention, kv_for_layers, multicast_step_s,
                              pipeline_helper_loads, round_fits)
from shared.core.multicast import multicast_seconds, whole_steps
from shared.core.types import Hardware, HostedRange, PipelineMode

from .factories import GB, SPLIT_SPEC, flat_profile, loaded, model, node, perf_for, request


@given(st.floats(0.0, 0.99), st.floats(0.0, 1.0))
def test_contention_is_what_contended_applies_to_the_validation(load, overestimate):
    config = CoreConfig(overestimate=overestimate)
    assert 1 + contended(config, load).overestimate == \
        pytest.approx((1 + overestimate) * contention(load))


def test_a_node_whose_stages_take_all_its_compute_can_promise_nothing():
    assert contention(1.0) == math.inf and contention(0.0) == 1.0
    assert contended(CoreConfig(), 1.0).overestimate == math.inf


@given(st.integers(0, 10**12), st.integers(1, 80), st.integers(1, 80))
def test_a_layout_change_keeps_every_block_of_the_pool(kv, before, after):
    got = kv_for_layers(kv, before, after)
    assert got * before >= kv * after > (got - 1) * before


@given(st.integers(1, 64), st.integers(2, 40), st.floats(1e8, 1e11), st.floats(0.0, 0.01))
def test_a_multicasts_time_is_its_steps_times_one_step(blocks, n, link, latency):
    model_bytes = 8 * GB
    assert multicast_seconds(model_bytes, blocks, n, link, latency) == pytest.approx(
        max(whole_steps(n, 1, blocks)) * multicast_step_s(model_bytes, blocks, link, latency))


def test_a_helper_takes_the_share_of_the_layers_it_runs():
    holder = PipelineMode(2, 1e-3, 1e9, 8192, 1.0, ("g0",))
    assert pipeline_helper_loads(SPLIT_SPEC, holder) == {"g0": 31 / 32}
    receivers = PipelineMode(4, 1e-3, 1e9, 8192, 1.0, ("g1", "g2"), ranges=(
        HostedRange("g1", 0, 8), HostedRange("g2", 8, 12), HostedRange("g1", 20, 24)))
    assert pipeline_helper_loads(SPLIT_SPEC, receivers) == {"g1": 12 / 32, "g2": 4 / 32}


def test_a_round_fits_while_the_busy_instances_meet_their_tpot_with_the_load():
    perf = perf_for(flat_profile("o", Hardware.GPU, decode_s=0.02))
    sched = node("n", Hardware.GPU, 80, perf)
    config = CoreConfig()
    assert round_fits(sched.view(), 0.99, None, config)  # nothing to serve: any load
    loaded(sched, None, request("r", model_name="o", tpot=0.025), model("o"))
    view = sched.view()
    assert round_fits(view, 0.0, perf, config)  # 0.022 s against 0.025 s
    assert not round_fits(view, 0.2, perf, config)  # 0.0275 s
    assert not round_fits(view, 0.0, None, config)  # no profiles: no promise
    assert not round_fits(view, 1.0, perf, config)

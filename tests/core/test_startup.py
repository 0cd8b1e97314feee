"""Startup-time-aware placement (ServerlessLLM §6): a node's tiers decide how long a cold start
takes there (q + n/b), and the placer prefers the node whose startup meets the TTFT SLO."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.readiness import cold_start_ready_at, load_seconds
from shared.core.placement import PlaceAction, place
from shared.core.types import Hardware, StorageView

from tests.core.factories import GB, flat_profile, linear_profile, model, node, perf_for, request

TIERS = {"dram": 20 * GB, "disk": 4 * GB, "registry": 1 * GB}  # bytes/s


def test_startup_is_q_plus_n_over_b_of_the_tier_holding_the_checkpoint():
    spec = model("m", weight_gb=8)
    profile = replace(flat_profile("m", Hardware.GPU, load_s=9.9), engine_init_s=0.5)
    n = node("g0", Hardware.GPU, 80, perf_for(profile)).node
    assert load_seconds(n, spec, profile) == 9.9  # no tiers reported: the measured load
    n.storage = StorageView(TIERS, {"m": "dram"})
    assert load_seconds(n, spec, profile) == pytest.approx(8 / 20 + 0.5)
    n.storage = StorageView(TIERS, {"m": "disk"}, pending_s=1.5)
    assert load_seconds(n, spec, profile) == pytest.approx(8 / 4 + 0.5)  # n/b: the grace
    load = load_seconds(n, spec, profile)
    assert cold_start_ready_at(n, spec.weight_bytes, load, 10.0) == pytest.approx(10 + 1.5 + 2.5)  # q + n/b
    n.storage = StorageView(TIERS, {})  # nowhere on the node: from the registry
    assert load_seconds(n, spec, profile) == pytest.approx(8 / 1 + 0.5)
    # An engine that reads its own files (OpenVINO, vLLM) never goes through the tiers.
    assert load_seconds(n, replace(spec, tiered=False), profile) == 9.9


def test_a_cold_start_goes_where_the_checkpoint_is_fast_enough_for_the_ttft():
    spec = model("m", weight_gb=8)
    perf = perf_for(flat_profile("m", Hardware.GPU, prefill_s=0.1, load_s=1.0))
    near, far = node("g0", Hardware.GPU, 80, perf), node("g1", Hardware.GPU, 80, perf)
    near.node.storage = StorageView(TIERS, {"m": "dram"})
    far.node.storage = StorageView(TIERS, {}, pending_s=3.0)  # registry read behind other loads
    # Packing alone would pick g1 (it is the fuller node), but its startup breaks the TTFT.
    far.node.budget_bytes = 40 * GB
    plan = place(request("x", ttft=1.0), spec,
                 DecisionContext([far.view(), near.view()], perf, 0.0, CoreConfig()))
    assert plan.action is PlaceAction.NEW_INSTANCE and plan.node_id == "g0"
    by_node = {a.node_id: a.startup_s for a in plan.attempts if a.startup_s is not None}
    assert by_node["g0"] == pytest.approx(0.4)


def test_migration_time_is_the_line_through_the_prefill_table():
    profile = linear_profile("m", Hardware.CPU, per_token_prefill=1e-3)
    assert profile.migration_s(1000) == pytest.approx(1.0, rel=1e-6)
    assert profile.migration_s(3000) == pytest.approx(3 * profile.migration_s(1000), rel=1e-6)


def test_only_models_the_loader_serves_are_tiered():
    from shared.cluster import model_spec
    from shared.schemas import ModelRecord

    def spec(engine: str):
        return model_spec(ModelRecord("m", "/m", weight_bytes=GB, kv_bytes_per_token=1, engine=engine))
    assert spec("torch").tiered and spec("auto").tiered
    assert not spec("openvino").tiered and not spec("vllm").tiered

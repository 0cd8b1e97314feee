"""Pre-loading as the placer, the node and the simulator carry it out (shared/core/preload.py):
what comes before and after the knapsacks of shared/core/lora.py."""

from __future__ import annotations

from dataclasses import replace

from shared.core.lora import CallRates, NodePreload
from shared.core.perf_model import PerfModel
from shared.core.preload import (PRELOAD_INTERVAL_S, Preloadable, accept_cluster_plan,
                                 checkpoint_steps, cluster_artifacts, cluster_preload,
                                 node_preload, plan_fresh, plan_valid_s, ready_backbones)
from shared.core.types import (Hardware, InstanceStatus, InstanceView, ModelSpec, NodeView,
                               StorageView)

from tests.core.factories import flat_profile

GB = 10**9
KNOWN = {"bb": Preloadable("bb", 2 * GB), "other": Preloadable("other", 2 * GB),
         "hot": Preloadable("hot", 50 * 10**6, "bb"), "warm": Preloadable("warm", 50 * 10**6, "bb")}


def _instance(iid: str, backbone: str, status=InstanceStatus.READY, adapters=None):
    return InstanceView(iid, ModelSpec(backbone, 2 * GB, 1024, 1024, 64.0), "", status=status,
                        adapters=dict(adapters or {}))


def _node(node_id: str, instances=(), free_gb: float = 10.0, dram_gb: float = 0.0,
          hardware=Hardware.GPU) -> NodeView:
    memory = 80 * GB
    return NodeView(node_id, hardware, memory, instances=list(instances),
                    budget_bytes=memory - int(free_gb * GB),
                    storage=StorageView({}, dram_bytes=int(dram_gb * GB)))


def _perf() -> PerfModel:
    perf = PerfModel()
    for name, hw, load_s in (("bb", Hardware.GPU, 1.0), ("bb", Hardware.CPU, 3.0),
                             ("other", Hardware.GPU, 1.0)):
        perf.add(flat_profile(name, hw, load_s=load_s))
    return perf


def _rates(calls: dict[str, int], at: float = 0.0) -> CallRates:
    rates = CallRates()
    for name, n in calls.items():
        for _ in range(n):
            rates.note(name, None, at)
    return rates


def test_a_cluster_plan_is_followed_for_three_intervals():
    assert plan_valid_s(PRELOAD_INTERVAL_S) == 3 * PRELOAD_INTERVAL_S
    assert plan_fresh(10.0, 15.0, 25.0) and not plan_fresh(10.0, 15.0, 25.1)


def test_the_cluster_weighs_a_backbone_by_its_slowest_load_and_an_adapter_by_its_bytes():
    nodes = [_node("g"), _node("c", hardware=Hardware.CPU)]
    backbones, adapters = cluster_artifacts(["bb", "hot", "unknown"], KNOWN,
                                            _rates({"bb": 4, "hot": 2}), nodes, _perf(), 1.0)
    assert [(b.name, b.load_s, b.rate) for b in backbones] == [("bb", 3.0, 4.0)]
    assert [(a.name, a.backbone, a.load_s) for a in adapters] == [("hot", "bb", 0.1)]


def test_a_draining_node_gets_no_preloading():
    nodes = [_node("a", [_instance("i1", "bb")], free_gb=1.0),
             replace(_node("b", [_instance("j1", "bb")], free_gb=50.0), draining=True)]
    plans = cluster_preload(["bb", "hot"], KNOWN, _rates({"bb": 3, "hot": 3}), nodes, _perf(), 1.0)
    assert set(plans) == {"a"} and plans["a"].adapters == (("i1", "hot"),)


def test_ready_backbones_take_the_lowest_ready_instance_whose_engine_runs():
    node = _node("a", [_instance("i2", "bb"), _instance("i1", "bb"),
                       _instance("i0", "bb", InstanceStatus.LOADING), _instance("k", "other")])
    assert ready_backbones(node) == {"bb": "i1", "other": "k"}
    assert ready_backbones(node, lambda iid: iid != "i1") == {"bb": "i2", "other": "k"}


def test_a_node_plans_from_its_own_rates_over_what_it_knows():
    node = _node("a", [_instance("i1", "bb", adapters={"warm": 50 * 10**6})], dram_gb=2.5)
    rates = _rates({"bb": 5, "hot": 3, "other": 1})
    plan = node_preload(node, [KNOWN["bb"], KNOWN["other"]], [KNOWN["hot"], KNOWN["warm"]],
                        rates.rate, _perf(), 1.0, 2_500_000_000, 10 * GB, ready_backbones(node))
    # One 2 GB checkpoint fits the tier: the hotter backbone's; "warm" is attached already.
    assert plan == NodePreload(("bb",), (("i1", "hot"),))


def test_a_node_carries_out_only_what_of_the_placers_plan_it_can():
    node = _node("a", [_instance("i1", "bb"), _instance("j1", "other"),
                       _instance("i0", "bb", InstanceStatus.LOADING)])
    sent = NodePreload(("bb", "hot", "unregistered"),
                       (("i1", "hot"), ("j1", "warm"), ("i0", "warm"), ("gone", "hot"),
                        ("i1", "unregistered")))
    chosen = accept_cluster_plan(sent, node, {"i1", "j1"}, KNOWN)
    # an adapter is no checkpoint; "warm" is no adapter of "other"; i0 is not ready; "gone" is
    assert chosen == NodePreload(("bb",), (("i1", "hot"),))


def test_one_checkpoint_is_read_per_turn_and_none_ahead_of_a_cold_start():
    tiers = {"a": "dram", "b": "disk", "c": "registry", "d": None, "e": "dram"}
    plan = ("a", "b", "c", "d", "e")
    assert checkpoint_steps(plan, tiers.get, io_busy=False) == \
        (("a", False), ("b", True), ("e", False))
    assert checkpoint_steps(plan, tiers.get, io_busy=True) == (("a", False), ("e", False))

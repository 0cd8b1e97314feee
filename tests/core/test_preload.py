"""Pre-loading as the placer, the node and the simulator carry it out (shared/core/preload.py):
what comes before and after the knapsacks of shared/core/lora.py."""

from __future__ import annotations

from dataclasses import replace

from shared.core.lora import CallRates, NodePreload, preload_room
from shared.core.memory import MemOpKind
from shared.core.perf_model import PerfModel
from shared.core.preload import (PRELOAD_INTERVAL_S, PRESSURE_HOLD_S, Preloadable,
                                 PressureWatch, accept_cluster_plan, adapters_to_attach,
                                 checkpoint_steps, cluster_artifacts, cluster_preload,
                                 node_preload, plan_fresh, plan_valid_s, ready_backbones)
from shared.core.types import (AdapterSpec, Hardware, InstanceStatus, InstanceView, ModelSpec,
                               NodeView, StorageView)

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request

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
    plans = cluster_preload(["bb", "hot"], KNOWN, _rates({"bb": 3, "hot": 3}), nodes, _perf(), 1.0,
                            0.25)
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
                        rates.rate, _perf(), 1.0, 2_500_000_000, ready_backbones(node), 0.25)
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


# --- what a node may pre-load now (issue 22 follow-up: pre-loading churned and slowed TTFT) ---
MB = 10**6


def _serving(kv_gb: float, requests: int, free_gb: float) -> NodeView:
    """A node whose one backbone instance holds `requests` of 800 tokens (KV 1 MB a token)."""
    spec = ModelSpec("bb", 2 * GB, MB, 1024, 64.0)
    inst = InstanceView("i1", spec, "a", kv_bytes=int(kv_gb * GB),
                        requests=[request(f"r{k}", "bb", input_len=736) for k in range(requests)])
    return _node("a", [inst], free_gb=free_gb)


def test_the_room_a_node_preloads_into_keeps_its_instances_next_kv_scale_up():
    # A join of a request like the two it holds (800 MB) that outgrows the 2 GB cache scales it
    # to (1 + w) x (2 GB + 800 MB): those 1.5 GB stay free.
    assert preload_room(_serving(2.0, 2, free_gb=3.0), watermark=0.25) == int(1.5 * GB)
    assert preload_room(_serving(2.0, 2, free_gb=1.0), watermark=0.25) == 0
    assert preload_room(_node("b", free_gb=3.0), watermark=0.25) == 3 * GB  # nothing to grow


def _adapter_rates(*names: str) -> CallRates:
    rates = CallRates()
    for name in names:
        rates.note("m", name, 0.0)
    return rates


def test_a_preloaded_adapter_never_takes_the_memory_the_next_join_grows_into():
    """Pre-loads used to fill the node's whole free budget, so the next join whose KV cache had to
    grow offloaded them first (an UNLOAD its growth waited for) and the next turn pre-loaded them
    again: the churn the LoRA runs showed."""
    spec = model("m", weight_gb=4, kv_per_token=MB, max_context=1024)
    names = [f"a{k}" for k in range(8)]
    known = [Preloadable(n, 100 * MB, "m") for n in names]
    for memory_gb, preloads in ((6.0, 0), (8.0, 8)):
        sched = node(memory_gb=memory_gb, perf=perf_for(flat_profile("m", Hardware.GPU)))
        iid = loaded(sched, None, request("p", input_len=600, ttft=5.0), spec)
        watch = PressureWatch()
        for turn in range(8):  # one adapter a turn onto the serving instance
            now = 1.0 + 0.1 * turn
            view = sched.view()
            plan = node_preload(view, [Preloadable("m", spec.weight_bytes)], known,
                                _adapter_rates(*names).rate, sched.perf, now, 0,
                                ready_backbones(view), sched.config.watermark)
            for inst_id, name in adapters_to_attach(plan, view, {a.name: a.bytes for a in known},
                                                    sched.config.watermark, now, watch):
                ops = sched.preload_adapter(inst_id, AdapterSpec(name, 100 * MB), now)
                watch.attached(inst_id, name)
                while ops:  # loaded before the next turn
                    ops.extend(sched.memop_done(ops.pop(0), now + 0.05))
        assert len(sched.node.instance(iid).adapters) == preloads
        join = sched.admit(request("q", input_len=900, ttft=5.0, max_tokens=100), iid, spec, 2.0)
        assert join.admission.ok and join.admission.kv_target_bytes is not None  # it grew
        assert not [op for op in join.start_ops if op.kind is MemOpKind.UNLOAD]
        assert len(sched.node.instance(iid).adapters) == preloads


def test_an_adapter_whose_load_would_queue_on_the_nodes_io_is_not_preloaded_now():
    """Its load would hold the instance up for the whole queue (a cold start's registry read),
    where a request asking for it later may find the I/O free."""
    node_view = _node("a", [_instance("i1", "bb")], free_gb=10.0)
    plan = NodePreload((), (("i1", "hot"),))
    sizes = {"hot": 50 * MB}
    assert adapters_to_attach(plan, node_view, sizes, 0.25, 1.0, PressureWatch()) == \
        (("i1", "hot"),)
    busy = replace(node_view, storage=replace(node_view.storage, pending_s=2.0))
    assert adapters_to_attach(plan, busy, sizes, 0.25, 1.0, PressureWatch()) == ()


def test_what_a_node_attaches_stays_within_its_room_in_the_plans_order():
    node_view = _node("a", [_instance("i1", "bb")], free_gb=0.12)
    plan = NodePreload((), (("i1", "hot"), ("i1", "warm"), ("i1", "cool")))
    sizes = {"hot": 50 * MB, "warm": 80 * MB, "cool": 50 * MB}
    assert adapters_to_attach(plan, node_view, sizes, 0.25, 1.0, PressureWatch()) == \
        (("i1", "hot"), ("i1", "cool"))


def test_a_node_that_gave_up_adapters_for_memory_preloads_none_for_a_while():
    """Offloaded under pressure, an adapter used to be pre-loaded again at the next turn, five
    seconds later, and offloaded again (the LoRA runs re-pre-loaded most of their offloads)."""
    held = _node("a", [_instance("i1", "bb", adapters={"hot": 50 * MB})])
    plan, sizes = NodePreload((), (("i1", "warm"),)), {"warm": 50 * MB}
    watch = PressureWatch()
    assert adapters_to_attach(plan, held, sizes, 0.25, 0.0, watch) == (("i1", "warm"),)
    watch.attached("i1", "warm")
    offloaded = _node("a", [_instance("i1", "bb", adapters={"hot": 50 * MB})])  # "warm" went
    assert adapters_to_attach(plan, offloaded, sizes, 0.25, 5.0, watch) == ()
    assert adapters_to_attach(plan, offloaded, sizes, 0.25, 5.0 + PRESSURE_HOLD_S - 0.1,
                              watch) == ()
    assert adapters_to_attach(plan, offloaded, sizes, 0.25, 5.0 + PRESSURE_HOLD_S,
                              watch) == (("i1", "warm"),)


def test_adapters_that_left_with_their_instance_are_no_memory_pressure():
    watch = PressureWatch()
    plan, sizes = NodePreload((), (("i2", "warm"),)), {"warm": 50 * MB}
    adapters_to_attach(plan, _node("a", [_instance("i1", "bb", adapters={"hot": 50 * MB}),
                                         _instance("i2", "bb")]), sizes, 0.25, 0.0, watch)
    unloading = _instance("i1", "bb", InstanceStatus.UNLOADING)
    assert adapters_to_attach(plan, _node("a", [unloading, _instance("i2", "bb")]), sizes, 0.25,
                              5.0, watch) == (("i2", "warm"),)
    assert adapters_to_attach(plan, _node("a", [_instance("i2", "bb")]), sizes, 0.25, 10.0,
                              watch) == (("i2", "warm"),)


def test_an_instance_serving_requests_gets_one_preloaded_adapter_per_turn():
    """Each pre-load passed `may_hold` alone, but a turn's loads onto one instance queue after one
    another on the node's I/O: a turn pre-loaded 11 adapters onto one serving CPU instance in a
    tiered run, holding its batch ~0.35 s, and a token came late."""
    serving = _instance("i1", "bb")
    serving.requests.append(request("r0", "bb", input_len=100))
    node_view = _node("a", [serving, _instance("i2", "bb")], free_gb=10.0)
    plan = NodePreload((), (("i1", "hot"), ("i1", "warm"), ("i2", "cool"), ("i2", "cold")))
    sizes = dict.fromkeys(("hot", "warm", "cool", "cold"), 50 * MB)
    assert adapters_to_attach(plan, node_view, sizes, 0.25, 1.0, PressureWatch()) == \
        (("i1", "hot"), ("i2", "cool"), ("i2", "cold"))

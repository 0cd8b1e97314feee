"""ServerlessLoRA's decisions (pure): pre-loading as a greedy knapsack with the backbone-first
precedence, offloading the least valuable artifacts but never what requests use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.lora import Artifact, adapter_load_bytes, offload_order, preload_plan
from shared.core.types import Hardware, InstanceView, ModelSpec, NodeView, StorageView

GB = 10**9
BB = Artifact("llama-8b", 16 * GB, 2.0, rate=0.0)


def adapter(name: str, rate: float, backbone: str = "llama-8b") -> Artifact:
    return Artifact(name, 50 * 10**6, 0.3, rate, backbone=backbone)


def test_an_adapter_on_a_node_with_its_backbone_costs_only_itself():
    a = adapter("a", 1.0)
    assert adapter_load_bytes(a, BB, {"llama-8b"}) == a.bytes
    assert adapter_load_bytes(a, BB, set()) == a.bytes + BB.bytes


def test_preloading_puts_the_backbone_before_its_adapters_and_the_hot_ones_first():
    arts = [BB, adapter("hot", 5.0), adapter("warm", 0.5), adapter("cold", 0.0)]
    plan = preload_plan(arts, {"n0": 16 * GB + 60 * 10**6})
    assert plan["n0"] == ["llama-8b", "hot"]  # room for the backbone and one adapter


def test_an_adapter_never_lands_where_its_backbone_is_not():
    arts = [BB, adapter("a", 2.0), Artifact("qwen-7b", 14 * GB, 2.0, 0.0), adapter("b", 1.0, "qwen-7b")]
    plan = preload_plan(arts, {"n0": 17 * GB, "n1": 15 * GB})
    for node, names in plan.items():
        for name in names:
            art = next(a for a in arts if a.name == name)
            if art.backbone:
                assert art.backbone in names
    assert plan == {"n0": ["llama-8b", "a"], "n1": ["qwen-7b", "b"]}


@given(rates=st.lists(st.floats(0, 10), min_size=1, max_size=12),
       room=st.lists(st.integers(0, 40), min_size=1, max_size=3))
@settings(max_examples=200, deadline=None)
def test_a_plan_respects_memory_and_precedence(rates, room):
    arts = [BB] + [adapter(f"a{i}", r) for i, r in enumerate(rates)]
    free = {f"n{i}": g * GB for i, g in enumerate(room)}
    plan = preload_plan(arts, free)
    sizes = {a.name: a.bytes for a in arts}
    for node, names in plan.items():
        assert sum(sizes[n] for n in names) <= free[node]
        assert all(n == "llama-8b" or "llama-8b" in names for n in names)


def test_offloading_spares_what_requests_use_and_takes_backbones_last():
    resident = [BB, adapter("busy", 3.0), adapter("idle-hot", 2.0), adapter("idle-cold", 0.1),
                Artifact("qwen-7b", 14 * GB, 2.0, 0.05), adapter("q", 0.05, "qwen-7b")]
    order = offload_order(resident, in_flight={"busy"})
    assert "busy" not in order and "llama-8b" not in order  # in use, and what it runs on
    assert order.index("idle-cold") < order.index("idle-hot")
    assert order.index("q") < order.index("qwen-7b")  # the adapter before its backbone


# --- one node's pre-loading (plan_node_preload) -------------------------------------------------

def _backbone(name: str, rate: float, gb: float = 2.0) -> Artifact:
    return Artifact(name, int(gb * GB), 1.0, rate)


def test_a_node_keeps_the_hottest_backbones_checkpoints_and_the_coldest_go_first():
    from shared.core.lora import plan_node_preload

    hot, warm, cold = _backbone("hot", 2.0), _backbone("warm", 0.5), _backbone("cold", 0.1)
    uncalled = _backbone("uncalled", 0.0)
    plan = plan_node_preload([cold, hot, uncalled, warm], [], 5 * GB, {}, {}, 0)
    # Room for two of the three called ones: the two worth most, touched least valuable first.
    assert plan.checkpoints == ("warm", "hot") and plan.adapters == ()
    # Rates change: "cold" is now the hot one and displaces the one that cooled most.
    later = [Artifact("cold", cold.bytes, 1.0, 3.0), Artifact("hot", hot.bytes, 1.0, 0.05), warm]
    assert plan_node_preload(later, [], 5 * GB, {}, {}, 0).checkpoints == ("warm", "cold")


def test_a_backbone_is_worth_the_calls_of_its_adapters():
    from shared.core.lora import plan_node_preload

    plain, tuned = _backbone("plain", 0.5), _backbone("tuned", 0.0)
    # Even at rate 0 of its own, a backbone whose adapters are called is worth their calls.
    hot_adapter = adapter("a", 4.0, backbone="tuned")
    plan = plan_node_preload([plain, tuned], [hot_adapter], 2 * GB, {}, {}, 0)
    assert plan.checkpoints == ("tuned",)


def test_adapters_are_attached_only_to_a_backbone_instance_the_node_holds_within_its_budget():
    from shared.core.lora import plan_node_preload

    bb = _backbone("llama-8b", 1.0)
    other = _backbone("qwen", 1.0)
    arts = [adapter("hot", 5.0), adapter("warm", 1.0), adapter("cold", 0.0),
            adapter("elsewhere", 9.0, backbone="qwen"), adapter("on", 3.0)]
    plan = plan_node_preload([bb, other], arts, 0, {"llama-8b": "i1"}, {"i1": {"on"}},
                             free_bytes=110 * 10**6)
    # qwen has no instance here; "on" is attached already; "cold" is never called; room for two.
    assert plan.adapters == (("i1", "hot"), ("i1", "warm"))
    # Room for one, nothing attached yet: the most called adapter.
    assert plan_node_preload([bb], arts, 0, {"llama-8b": "i1"}, {}, 60 * 10**6).adapters == \
        (("i1", "hot"),)


# --- the cluster's pre-loading (plan_cluster_preload: the placer's Pre-Loading Scheduler) --------

def _node(node_id: str, dram_gb: float, holds: dict[str, str] | None = None,
          instances: list[InstanceView] = (), free_gb: float = 0.0):
    memory = 100 * GB
    return NodeView(node_id, Hardware.CPU, memory, instances=list(instances),
                    storage=StorageView({}, holds=dict(holds or {}), dram_bytes=int(dram_gb * GB)),
                    budget_bytes=memory - int(free_gb * GB))


def _instance(iid: str, backbone: str, adapters: dict[str, int] | None = None) -> InstanceView:
    return InstanceView(iid, ModelSpec(backbone, 2 * GB, 1024, 1024, 64.0), "", adapters=dict(adapters or {}))


def test_the_cluster_spreads_hot_checkpoints_over_the_nodes_dram_tiers():
    from shared.core.lora import plan_cluster_preload

    a, b = _node("a", 4.5), _node("b", 4.5)
    hot, warm, cool = _backbone("hot", 3.0), _backbone("warm", 2.0), _backbone("cool", 1.0)
    plan = plan_cluster_preload([a, b], [cool, warm, hot, _backbone("uncalled", 0.0)], [], 0.25)
    # Two 2 GB checkpoints per 4.5 GB tier: all three called ones find a place, each once,
    # where one node alone (plan_node_preload) would keep two and lose the third.
    placed = [c for p in plan.values() for c in p.checkpoints]
    assert sorted(placed) == ["cool", "hot", "warm"]
    # A node whose tier already holds a checkpoint keeps it there (no read) when it has room.
    plan = plan_cluster_preload([_node("a", 4.5), _node("b", 4.5, holds={"cool": "dram"})],
                                [cool, warm, hot], [], 0.25)
    assert "cool" in plan["b"].checkpoints


def test_the_cluster_plan_attaches_adapters_where_their_backbone_runs_and_only_called_ones():
    from shared.core.lora import plan_cluster_preload

    bb = _backbone("llama-8b", 0.0)
    a = _node("a", 0.0, instances=[_instance("i1", "llama-8b", {"on": 50 * 10**6})], free_gb=1.0)
    b = _node("b", 0.0, free_gb=50.0)  # room, but no instance of the backbone
    arts = [adapter("hot", 5.0), adapter("cold", 0.0), adapter("on", 3.0),
            adapter("elsewhere", 9.0, backbone="qwen")]
    plan = plan_cluster_preload([a, b], [bb], arts, 0.25)
    assert plan["a"].adapters == (("i1", "hot"),) and plan["b"].adapters == ()


def test_the_cluster_plan_attaches_no_adapter_beside_another_backbone_with_more_room():
    """A node that runs another backbone and has the most room is no place for an adapter: the
    plan used to put the adapter's backbone there on paper, the adapter after it, and then found
    no instance there to attach it to (a KeyError the placer logged as a failed turn; the
    simulator's LoRA runs met it first)."""
    from shared.core.lora import plan_cluster_preload

    bb, qwen = _backbone("llama-8b", 1.0), _backbone("qwen", 1.0)
    a = _node("a", 0.0, instances=[_instance("i1", "llama-8b")], free_gb=5.0)
    b = _node("b", 0.0, instances=[_instance("j1", "qwen")], free_gb=50.0)
    plan = plan_cluster_preload([a, b], [bb, qwen], [adapter("hot", 5.0)], 0.25)
    assert plan["a"].adapters == (("i1", "hot"),) and plan["b"].adapters == ()


def test_the_cluster_plan_leaves_each_nodes_next_kv_scale_up_free():
    """The plan used to count a node's whole free budget as room: the node with the most of it
    got the adapter, then offloaded it for the next join that grew a KV cache."""
    from shared.core.lora import plan_cluster_preload

    spec = ModelSpec("llama-8b", 2 * GB, 10**6, 1024, 64.0)
    big_cache = InstanceView("i1", spec, "", kv_bytes=4 * GB)  # its next scale-up: 1 GB at w 0.25
    a = _node("a", 0.0, instances=[big_cache], free_gb=1.0)
    b = _node("b", 0.0, instances=[_instance("j1", "llama-8b")], free_gb=0.5)
    plan = plan_cluster_preload([a, b], [_backbone("llama-8b", 1.0)], [adapter("hot", 5.0)], 0.25)
    assert plan["a"].adapters == () and plan["b"].adapters == (("j1", "hot"),)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.5, 6.0)), min_size=1, max_size=8),
       st.lists(st.floats(0.0, 10.0), min_size=1, max_size=4))
def test_a_cluster_plan_never_overfills_a_tier_nor_places_a_checkpoint_twice(arts, tiers):
    from shared.core.lora import plan_cluster_preload

    backbones = [Artifact(f"b{i}", int(gb * GB), 1.0, rate) for i, (rate, gb) in enumerate(arts)]
    nodes = [_node(f"n{i}", gb) for i, gb in enumerate(tiers)]
    plan = plan_cluster_preload(nodes, backbones, [], 0.25)
    size = {b.name: b.bytes for b in backbones}
    placed = [c for p in plan.values() for c in p.checkpoints]
    assert len(placed) == len(set(placed))
    assert all(size[c] > 0 and next(b for b in backbones if b.name == c).rate > 0 for c in placed)
    for n in nodes:
        assert sum(size[c] for c in plan[n.node_id].checkpoints) <= n.storage.dram_bytes

"""Locality-driven startup (λScale §5): a new instance's startup estimate is the quicker of its
node's own tiers (q + n/b) and receiving the model by multicast from the nodes that hold it in
DRAM (setup + the binomial pipeline's steps + n/b_dram); the placer's new-instance choice and
the admission it expects the node to confirm both use it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.multicast import step_seconds, whole_steps
from shared.core.placement import PlaceAction, place
from shared.core.readiness import load_seconds
from shared.core.startup import StartupMethod, choose_startup, multicast_arrive_s, with_arrival
from shared.core.types import Hardware, StorageView

from tests.core.factories import GB, context, flat_profile, model, node, perf_for, request

LINK = 12.5 * GB  # 100 Gb/s
TIERS = {"dram": 20 * GB, "disk": 2 * GB, "registry": 0.5 * GB}
CFG = CoreConfig()
SPEC = model("m", weight_gb=8)
PROFILE = replace(flat_profile("m", Hardware.GPU, prefill_s=0.1, load_s=30.0), engine_init_s=0.5)
PERF = perf_for(PROFILE)


def gpu(node_id: str, holds: dict[str, str] | None = None, link: float = LINK,
        memory_gb: float = 80, arriving: dict[str, float] | None = None):
    view = node(node_id, Hardware.GPU, memory_gb, PERF).view()
    view.storage = StorageView(TIERS, holds or {}, multicast_bytes_per_s=link,
                               arriving=arriving or {})
    return view


def multicast_load(receivers: int, sources: int = 1) -> float:
    """The newest receiver's step in the k-way schedule, then its DRAM tier and engine."""
    steps = whole_steps(sources + receivers, sources, CFG.multicast_blocks)[-1]
    arrive = CFG.multicast_setup_s + steps * step_seconds(SPEC.weight_bytes, CFG.multicast_blocks,
                                                          LINK)
    return arrive + SPEC.weight_bytes / TIERS["dram"] + PROFILE.engine_init_s


def test_a_node_reading_from_the_registry_receives_by_multicast_from_a_dram_holder():
    holder, fresh = gpu("g0", {"m": "dram"}), gpu("g1")
    choice = choose_startup(fresh, SPEC, PROFILE, context([holder, fresh], CFG))
    assert choice.method is StartupMethod.MULTICAST and choice.sources == ("g0",)
    assert choice.tier_s == pytest.approx(8 / 0.5 + 0.5)  # n/b of the registry
    assert choice.load_s == pytest.approx(multicast_load(1))
    assert choice.load_s < choice.tier_s
    # With no holder, or multicast off, the node loads from its tiers.
    alone = choose_startup(fresh, SPEC, PROFILE, context([fresh], CFG))
    assert alone.method is StartupMethod.TIER and alone.load_s == alone.tier_s
    off = choose_startup(fresh, SPEC, PROFILE,
                         context([holder, fresh], replace(CFG, enable_multicast=False)))
    assert off.method is StartupMethod.TIER


def test_loading_from_its_own_tier_wins_when_it_is_quicker():
    holder = gpu("g0", {"m": "dram"})
    near = gpu("g1", {"m": "dram"})  # its own DRAM tier: n / 20 GB/s
    assert choose_startup(near, SPEC, PROFILE,
                          context([holder, near], CFG)).method is StartupMethod.TIER
    # A slow link (1 GB/s: 17 steps of 0.5 GB) loses to a 2 GB/s local disk.
    slow = [gpu("g0", {"m": "dram"}, link=1 * GB), gpu("g1", {"m": "disk"}, link=1 * GB)]
    choice = choose_startup(slow[1], SPEC, PROFILE, context(slow, CFG))
    assert choice.method is StartupMethod.TIER and choice.load_s == pytest.approx(8 / 2 + 0.5)
    forced = choose_startup(slow[1], SPEC, PROFILE,
                            context(slow, replace(CFG, force_multicast=True)))
    assert forced.method is StartupMethod.MULTICAST and forced.load_s > choice.tier_s


def test_nodes_without_an_endpoint_neither_send_nor_receive():
    mute_holder, fresh = gpu("g0", {"m": "dram"}, link=0), gpu("g1")
    assert choose_startup(fresh, SPEC, PROFILE, context([mute_holder, fresh], CFG)).method \
        is StartupMethod.TIER
    holder, deaf = gpu("g0", {"m": "dram"}), gpu("g1", link=0)
    assert choose_startup(deaf, SPEC, PROFILE,
                          context([holder, deaf], CFG)).method is StartupMethod.TIER
    # A holder whose copy is on disk only has nothing in host memory to send.
    disk_holder = gpu("g0", {"m": "disk"})
    assert choose_startup(fresh, SPEC, PROFILE, context([disk_holder, fresh], CFG)).method \
        is StartupMethod.TIER


def test_receivers_on_the_way_join_the_group_and_more_sources_split_it():
    holder = gpu("g0", {"m": "dram"})
    others = [gpu(f"g{i}", arriving={"m": 1.0}) for i in range(1, 8)]  # a burst under way
    fresh = gpu("g9")
    one = choose_startup(fresh, SPEC, PROFILE, context([holder, *others, fresh], CFG))
    assert one.load_s == pytest.approx(multicast_load(8))
    assert one.load_s > choose_startup(fresh, SPEC, PROFILE, context([holder, fresh], CFG)).load_s
    two = choose_startup(fresh, SPEC, PROFILE,
                         context([holder, gpu("g8", {"m": "dram"}), *others, fresh], CFG))
    assert two.sources == ("g0", "g8") and two.load_s == pytest.approx(multicast_load(8, 2))
    assert two.load_s < one.load_s
    # The slowest link among the sources and the receiver sets the pace.
    slow_holder = gpu("g0", {"m": "dram"}, link=LINK / 4)
    arrive = multicast_arrive_s(SPEC.weight_bytes, [slow_holder], fresh, 1, CFG)
    assert arrive == pytest.approx(CFG.multicast_setup_s + 16 * step_seconds(
        SPEC.weight_bytes, CFG.multicast_blocks, LINK / 4))


def test_a_node_the_model_is_already_arriving_at_loads_it_once_it_is_in():
    holder = gpu("g0", {"m": "dram"})
    coming = gpu("g1", arriving={"m": 2.0})
    choice = choose_startup(coming, SPEC, PROFILE, context([holder, coming], CFG))
    assert choice.method is StartupMethod.TIER  # no second multicast to the same node
    assert choice.load_s == pytest.approx(2.0 + 8 / 20 + 0.5)
    assert load_seconds(coming, SPEC, PROFILE) == choice.load_s
    # An arrival slower than the node's own tier does not slow the estimate down.
    late = with_arrival(gpu("g2", {"m": "disk"}), "m", 60.0)
    assert load_seconds(late, SPEC, PROFILE) == pytest.approx(8 / 2 + 0.5)


def test_a_burst_places_one_new_instance_per_node_each_by_multicast_with_its_grace():
    """Nodes that fit one instance each: every request of the burst gets its own node, each
    by multicast from the holder (which has no room for an instance itself), the estimate
    growing as the group does; the admission's grace is the multicast startup."""
    holder = gpu("h", {"m": "dram"}, memory_gb=4)  # too small for the 8 GB model
    fresh = [gpu(f"g{i}", memory_gb=9) for i in range(4)]
    nodes = [holder, *fresh]
    loads = []
    for i in range(4):
        r = request(f"r{i}", ttft=2.0)
        plan = place(r, SPEC, DecisionContext(nodes, PERF, 0.0, CFG))
        assert plan.action is PlaceAction.NEW_INSTANCE, plan.attempts
        assert plan.node_id != "h" and plan.startup.method is StartupMethod.MULTICAST
        assert plan.startup.sources == ("h",)
        assert plan.admission.grace_s == pytest.approx(plan.startup.load_s)
        loads.append(plan.startup.load_s)
        # The node as it reports itself once admitted: the instance holds its memory, the
        # model is on its way.
        nodes = [with_arrival(replace(n, budget_bytes=n.memory_bytes), "m", plan.startup.arrive_s)
                 if n.node_id == plan.node_id else n for n in nodes]
    assert loads == sorted(loads) and loads[-1] == pytest.approx(multicast_load(4))
    # Without the multicast every node reads the registry (16.5 s, all of it grace).
    plan = place(request("r", ttft=2.0), SPEC,
                 DecisionContext([holder, *fresh], PERF, 0.0,
                                 replace(CFG, enable_multicast=False)))
    assert plan.startup.method is StartupMethod.TIER
    assert plan.startup.load_s == pytest.approx(8 / 0.5 + 0.5)

"""Execute-while-load as a startup (λScale §4.3): a new instance receiving its model by multicast
may serve through an execution pipeline (its node runs the head and the layers it holds, a
node holding the model runs the rest) before its copy is whole. The core estimates when that
pipeline can serve from the k-way schedule (head-first block order), chooses it when it serves
sooner than the whole copy or the node's tiers, and validates the request against the
pipeline's profile (two activation hops per iteration) until the switch to local execution."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.cost import HopCost, instance_profile, pipeline_profile, stage_bytes
from shared.core.evaluate import evaluate
from shared.core.multicast import (Block, arrival_steps, binomial_steps, head_first, kway_orders,
                                   kway_schedule)
from shared.core.placement import PlaceAction, place
from shared.core.pipeline import holder_serve
from shared.core.readiness import load_seconds, new_instance_view
from shared.core.startup import StartupMethod, choose_startup, with_startup
from shared.core.types import Hardware

from tests.core.factories import (GB, SPLIT_PROFILE, SPLIT_SPEC, context, node, perf_for,
                                  request, tiered_gpu)

LINK = 12.5 * GB
CFG = CoreConfig(enable_pipeline=True)
# In the core's layout of SPEC the embeddings fill block 0 and the LM head block 15 (sent first),
# and block 1 holds layers 0-1: the first receiver serves after 3 steps, running those two.
SPEC, PROFILE = SPLIT_SPEC, SPLIT_PROFILE
PERF = perf_for(PROFILE)


def gpu(node_id: str, holds: dict[str, str] | None = None, memory_gb: float = 80,
        arriving: dict[str, float] | None = None):
    return tiered_gpu(node_id, LINK, holds, memory_gb, arriving)


def test_head_first_orders_send_the_heads_blocks_first_in_every_subgroup():
    blocks = [Block(i, "p0", 100 * i, 100 * (i + 1)) for i in range(8)]
    # Embeddings and LM head in the first 250 bytes, the final norm in the last 10.
    first = head_first(blocks, [("p0", 0, 250), ("p0", 790, 800)])
    assert first == (0, 1, 2, 7)
    orders = kway_orders(8, 2, first)
    assert [o[:4] for o in orders] == [[0, 1, 2, 7], [0, 1, 2, 7]]
    assert orders[0][4:] == [3, 4, 5, 6] and orders[1][4:] == [5, 6, 3, 4]  # chunks still shifted
    assert all(sorted(o) == list(range(8)) for o in orders)
    assert kway_orders(8, 2) == kway_orders(8, 2, ())  # Algorithm 1 unchanged without a head
    with pytest.raises(ValueError):
        kway_orders(8, 2, (0, 0))


def test_a_receiver_can_head_a_pipeline_long_before_its_copy_is_whole():
    def serve(sources: int, receivers: int) -> tuple[int, int]:
        return holder_serve(SPEC.weight_bytes, SPEC.layers, SPEC.head_bytes, 16,
                            sources + receivers, sources)

    # One source, one receiver: block j of the head-first order arrives in step j.
    assert serve(1, 1) == (3, 2)
    for sources, receivers in [(1, 4), (2, 4), (1, 8)]:
        got, _ = serve(sources, receivers)
        whole = max(max(s.values()) for s in arrival_steps(
            kway_schedule(sources + receivers, sources, 16)).values()) + 1
        assert 3 <= got < whole  # never before its 3 blocks came in, one a step
    # In a hypercube of 2^d nodes the newest receiver has its first blocks d - 1 steps later
    # (binomial: b + d - 1 steps for all b blocks).
    for d in (1, 2, 3, 4):
        assert serve(1, 2**d - 1)[0] == 3 + binomial_steps(2**d, 16) - 16


def test_a_receiver_serves_through_a_pipeline_sooner_than_its_copy_or_its_tiers():
    holder, fresh = gpu("g0", {"m": "dram"}), gpu("g1")
    choice = choose_startup(fresh, SPEC, PROFILE, context([holder, fresh], CFG))
    assert choice.method is StartupMethod.PIPELINE and choice.sources == ("g0",)
    mode = choice.pipeline
    assert mode.helpers == ("g0",) and mode.hops == 2 and mode.token_bytes == 8192
    step = 0.5 * GB / LINK
    assert choice.load_s == mode.until == pytest.approx(
        CFG.multicast_setup_s + 3 * step + CFG.pipeline_setup_s + PROFILE.engine_init_s)
    # The whole copy still arrives when the multicast says; the switch happens then.
    whole = CFG.multicast_setup_s + 16 * step
    assert choice.arrive_s == pytest.approx(whole)
    assert choice.load_s < whole + 8 / 20 + PROFILE.engine_init_s
    # Off, or a model whose shape is unknown: the whole copy (multicast) as before.
    off = choose_startup(fresh, SPEC, PROFILE,
                         context([holder, fresh], replace(CFG, enable_pipeline=False)))
    assert off.method is StartupMethod.MULTICAST and off.pipeline is None
    shapeless = replace(SPEC, layers=0)
    assert choose_startup(fresh, shapeless, PROFILE, context([holder, fresh], CFG)).method \
        is StartupMethod.MULTICAST


def test_a_pipeline_needs_a_holder_with_room_for_the_stage():
    need = stage_bytes(SPEC)
    assert 31 * 7 * GB // 32 < need < 8 * GB  # every layer but one, their K/V
    cramped = gpu("g0", {"m": "dram"}, memory_gb=need / GB * 0.99)
    fresh = gpu("g1")
    assert choose_startup(fresh, SPEC, PROFILE, context([cramped, fresh], CFG)).method \
        is StartupMethod.MULTICAST
    roomy = gpu("g2", {"m": "dram"}, memory_gb=need / GB * 1.01)
    choice = choose_startup(fresh, SPEC, PROFILE, context([cramped, roomy, fresh], CFG))
    assert choice.method is StartupMethod.PIPELINE and choice.pipeline.helpers == ("g2",)
    assert set(choice.sources) == {"g0", "g2"}  # both still send the model


def test_an_instance_in_a_pipeline_is_validated_with_the_pipelines_cost_until_its_switch():
    holder, fresh = gpu("g0", {"m": "dram"}), gpu("g1")
    choice = choose_startup(fresh, SPEC, PROFILE, context([holder, fresh], CFG))
    view = with_startup(fresh, "m", choice)
    assert view.storage.arriving["m"] == choice.arrive_s
    assert load_seconds(view, SPEC, PROFILE) == pytest.approx(choice.load_s)  # its grace
    inst = new_instance_view(view, SPEC, now=100.0)
    assert inst.pipeline is not None and inst.pipeline.until == pytest.approx(100 + choice.arrive_s)
    hop = HopCost(CFG.pipeline_hop_latency_s, LINK, 8192)
    piped = instance_profile(PERF, inst, Hardware.GPU)
    assert piped.decode_s(4, 100) == pytest.approx(pipeline_profile(PROFILE, 2, hop).decode_s(4, 100))
    assert piped.decode_s(4, 100) > PROFILE.decode_s(4, 100)
    assert instance_profile(PERF, replace(inst, pipeline=None), Hardware.GPU) is PROFILE
    # A TPOT the local instance meets but the pipeline's two hops do not: the pipeline startup
    # is refused, the same node loading its whole copy admits it.
    tight = replace(CFG, pipeline_hop_latency_s=0.05)
    slow = choose_startup(fresh, SPEC, PROFILE, context([holder, fresh], tight))
    assert slow.method is StartupMethod.PIPELINE  # the startup alone does not see the TPOT
    req = request("r", tpot=0.03)
    assert not evaluate(with_startup(fresh, "m", slow), None, req, SPEC, PERF, 0.0, tight).ok
    assert evaluate(fresh, None, req, SPEC, PERF, 0.0, tight).ok


def test_the_placer_plans_a_new_instance_through_a_pipeline_with_its_grace():
    holder = gpu("g0", {"m": "dram"}, memory_gb=7)  # room for a stage, not for an instance
    fresh = [gpu(f"g{i}") for i in (1, 2)]
    plan = place(request("x", ttft=1.0), SPEC, DecisionContext([holder, *fresh], PERF, 0.0, CFG))
    assert plan.action is PlaceAction.NEW_INSTANCE and plan.node_id == "g1"
    assert plan.startup.method is StartupMethod.PIPELINE
    assert plan.startup.pipeline.helpers == ("g0",)
    assert plan.admission.grace_s == pytest.approx(plan.startup.load_s)


def test_the_node_admits_the_instance_in_pipeline_mode_and_publishes_it():
    holder, fresh = gpu("g0", {"m": "dram"}), gpu("g1")
    choice = choose_startup(fresh, SPEC, PROFILE, context([holder, fresh], CFG))
    sched = node("g1", Hardware.GPU, 80, PERF)
    sched.node.storage = with_startup(fresh, "m", choice).storage  # the node's own re-check
    res = sched.admit(request("r", arrival=10.0), None, SPEC, 10.0)
    assert res.admission.ok
    inst = sched.node.instance(res.instance_id)
    assert inst.pipeline is not None and inst.pipeline.helpers == ("g0",)
    assert inst.pipeline.until == pytest.approx(10 + choice.arrive_s)
    # Its memory on this node is the whole instance's (what it holds after the switch).
    assert sched.node.budget_bytes == SPEC.weight_bytes + res.admission.kv_target_bytes

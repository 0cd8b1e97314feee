"""Wrong decisions of issue 22 that come from what an instance costs (shared/core/cost.py):
each test failed on the code before its fix."""

from __future__ import annotations

from dataclasses import replace

from shared.core.config import CoreConfig
from shared.core.calibration import DECODE, PREFILL, Calibrator, baseline_s, calibrated
from shared.core.cost import (contended, decode_round_s, instance_profile, kv_demand,
                              layer_weight_bytes, pipeline_helper_loads, plan_layer_move,
                              stage_bytes)
from shared.core.iteration import IterationChoice, IterationKind, predict_seconds
from shared.core.module_scaling import (MemoryPressure, ModuleAction, ModuleSettings,
                                        plan_module_scaling)
from shared.core.modules import stage_key
from shared.core.placement import place
from shared.core.startup import StartupMethod, choose_startup, with_startup
from shared.core.types import Hardware, InstanceLayout, LayerRun

from .factories import (GB, SPLIT_PROFILE, SPLIT_SPEC, context, flat_profile, loaded, model,
                        node, perf_for, request, tiered_gpu)
from .test_module_scaling import CONFIG, HEAD, LAYERS, SETTINGS, drain, proportional, spec


def _moved_kv(inst, moved: int) -> int:
    """The K/V the moved layers' stage holds: it mirrors the owner's block count, so its pool
    is the owner's token capacity times the moved layers' K/V per token."""
    full = inst.layout.model
    tokens = inst.kv_bytes // inst.model.kv_bytes_per_token
    return tokens * (full.kv_bytes_per_token * moved // full.layers)


# -- #1: a shed's moved layers grow K/V on the host outside the host's ledger -------------------


def test_a_split_instance_never_grows_kv_beyond_what_its_stages_host_reserved():
    """Issue 22 #1: shed 4 of 8 layers, then admit 11 requests. Before the fix the owner grew
    its pool for them (sized on its local share only), so the stage, which mirrors its block
    count, needed 4.72 GB of K/V on a host that reserved 0.63 GB."""
    perf = perf_for(proportional())
    owner = node("a", Hardware.CPU, 64, perf)
    host = node("b", Hardware.CPU, 64, perf)
    full = spec()
    iid = loaded(owner, None, request("r0", ttft=60.0, tpot=5.0), full)
    inst = owner.node.instance(iid)
    move = plan_layer_move(full, inst.kv_bytes, 0, LAYERS, LAYERS, 4, HEAD)
    reserved = move.dest_bytes - 4 * layer_weight_bytes(full, LAYERS, HEAD)
    ok, ops = host.hold(stage_key(iid, 4, 8), move.dest_bytes, 0.0)
    assert ok
    drain(host, ops)
    layout = InstanceLayout(full, (LayerRun(4, 8, "b", "b:1"),), 1e-4, 1e10)
    ok, ops = owner.set_layout(iid, layout, 0.0)
    assert ok
    drain(owner, ops)
    assert abs(reserved / GB - 0.63) < 0.01  # the figure
    newcomers = [request(f"r{k}", input_len=624, ttft=60.0, tpot=5.0) for k in range(1, 12)]
    # What the pool grown for all of them (at the watermark) would need on the moved layers.
    wanted = int(kv_demand(full, [*inst.requests, *newcomers]) * (1 + owner.config.watermark))
    assert abs(wanted * 4 // LAYERS / GB - 4.72) < 0.01  # the figure
    for k, newcomer in enumerate(newcomers, 1):
        res = owner.admit(newcomer, iid, full, 0.0)
        drain(owner, res.start_ops)
        assert _moved_kv(inst, 4) <= reserved, f"after {k} admissions"
    assert owner.ledger.allocated(iid) <= owner.node.memory_bytes



def test_a_split_instance_grows_up_to_what_its_stages_host_reserved_and_no_further():
    """A run that records its host's reservation (`LayerRun.kv_bytes`, the planner's
    `layout_after`) lets the owner's pool grow until the stage's mirror fills it, not beyond."""
    perf = perf_for(proportional())
    owner = node("a", Hardware.CPU, 64, perf)
    full = spec()
    iid = loaded(owner, None, request("r0", ttft=60.0, tpot=5.0), full)
    inst = owner.node.instance(iid)
    reserved = 2 * (inst.kv_bytes * 4 // LAYERS)  # room for twice the moved layers' pool
    layout = InstanceLayout(full, (LayerRun(4, 8, "b", "b:1", kv_bytes=reserved),), 1e-4, 1e10)
    drain(owner, owner.set_layout(iid, layout, 0.0)[1])
    grown = False
    for k in range(1, 12):
        before = inst.kv_bytes
        res = owner.admit(request(f"r{k}", input_len=624, ttft=60.0, tpot=5.0), iid, full, 0.0)
        drain(owner, res.start_ops)
        grown = grown or inst.kv_bytes > before
        assert _moved_kv(inst, 4) <= reserved, f"after {k} admissions"
    assert grown and inst.batch_size < 12


# -- #3: an execute-while-load helper's compute is counted nowhere ------------------------------


def _busy_holder(node_id: str = "g0", tpot: float = 0.025, holds: dict | None = None,
                 memory_gb: float = 80, link: float = 12.5 * GB):
    """A node holding the model `m` in its DRAM tier (or as `holds` says) and serving a batch of
    another model `o`: one decode round of 0.022 s (with the overestimate) against `tpot`."""
    other = flat_profile("o", Hardware.GPU, decode_s=0.02)
    perf = perf_for(SPLIT_PROFILE, other)
    sched = node(node_id, Hardware.GPU, memory_gb, perf)
    loaded(sched, None, request("busy", model_name="o", tpot=tpot), model("o"))
    view = sched.view()
    view.storage = tiered_gpu(node_id, link, {"m": "dram"} if holds is None else holds).storage
    return view, perf


def test_a_busy_holder_whose_round_would_break_its_tpot_with_the_stage_is_no_pipeline_helper():
    """Issue 22 #3: the holder's round is 0.022 s against a 0.025 s TPOT; running 31 of the
    model's 32 layers for the new instance takes 31/32 of its compute, its round would be
    0.70 s. Before the fix it was chosen as the pipeline's helper anyway (by free memory)."""
    cfg = CoreConfig(enable_pipeline=True)
    holder, perf = _busy_holder()
    busy = [i for i in holder.instances if i.requests]
    assert round(decode_round_s(holder, busy, perf, cfg), 3) == 0.022
    load = 31 / 32
    assert round(decode_round_s(holder, busy, perf, contended(cfg, load)), 2) == 0.70
    fresh = tiered_gpu("g1", 12.5 * GB)
    plan = place(request("new", tpot=1.0, ttft=30.0), SPLIT_SPEC,
                 context([holder, fresh], cfg, perf))
    assert plan.node_id == "g1" and plan.startup is not None
    assert plan.startup.method is not StartupMethod.PIPELINE, plan.startup
    # An idle holder helps, and the stage's share of its compute is what it counts.
    idle = replace(holder, instances=[])
    choice = choose_startup(fresh, SPLIT_SPEC, SPLIT_PROFILE,
                            context([idle, fresh], cfg, perf))
    assert choice.method is StartupMethod.PIPELINE
    assert pipeline_helper_loads(SPLIT_SPEC, choice.pipeline) == {"g0": load}


def test_a_busy_receiver_hosts_no_layers_of_another_receivers_pipeline():
    """Issue 22 #3, receiver pipelines: the receiver that joined first would host the layers the
    second lacks; when its own round (0.022 s) would break its 0.025 s TPOT with them, the
    second waits for its copy instead (before the fix: chosen by its free memory alone)."""
    link = 2.5 * GB
    cfg = CoreConfig(enable_pipeline=True, enable_receiver_pipelines=True)
    cramped = stage_bytes(SPLIT_SPEC) / GB * 0.5  # no source has room for a holder's stage
    sources = [tiered_gpu(s, link, {"m": "dram"}, memory_gb=cramped) for s in ("s0", "s1")]
    first, perf = _busy_holder("g1", holds={}, link=link)
    second = tiered_gpu("g2", link)
    nodes = [*sources, first, second]
    c1 = choose_startup(first, SPLIT_SPEC, SPLIT_PROFILE, context(nodes, cfg, perf))
    nodes[2] = with_startup(first, "m", c1)
    idle = replace(nodes[2], instances=[])
    helped = choose_startup(second, SPLIT_SPEC, SPLIT_PROFILE,
                            context([*sources, idle, second], cfg, perf))
    assert helped.method is StartupMethod.PIPELINE and helped.pipeline.helpers == ("g1",)
    assert 0 < pipeline_helper_loads(SPLIT_SPEC, helped.pipeline)["g1"] < 1
    c2 = choose_startup(second, SPLIT_SPEC, SPLIT_PROFILE, context(nodes, cfg, perf))
    assert c2.method is not StartupMethod.PIPELINE, c2


# -- #6: a CoCoServe shed is checked against the shedding instance alone -----------------------


def _serving(sched, name: str, batch: int, tpot: float = 0.25, ttft: float = 60.0) -> str:
    iid = None
    for k in range(batch):
        iid = loaded(sched, iid, request(f"{name}{k}", model_name=name, ttft=ttft, tpot=tpot),
                     spec(name=name))
    return iid


def test_a_shed_that_breaks_its_owner_nodes_decode_round_is_not_planned():
    """Issue 22 #6: two instances on the owner, five requests each, 0.02 s per request: a round
    of 0.220 s (with the overestimate) against a 0.25 s TPOT. Shedding either one's layers adds
    two hops (0.02 s each) to its step: 0.154 s alone (fine), but the node's round becomes
    0.264 s. Before the fix the shed was planned anyway."""
    perf = perf_for(proportional("m"), proportional("y"))
    owner = node("a", Hardware.CPU, 16, perf)
    host = node("b", Hardware.CPU, 16, perf)
    _serving(owner, "m", 5)
    _serving(owner, "y", 5)
    view = owner.view()
    busy = [i for i in view.instances if i.requests]
    assert round(decode_round_s(view, busy, perf, CONFIG), 3) == 0.220
    slow_hops = ModuleSettings(hop_latency_s=0.02, link_bytes_per_s=1e10)
    deficit = layer_weight_bytes(spec(), LAYERS, HEAD) // 2
    plans = plan_module_scaling(context([view, host.view()], CONFIG, perf),
                                [MemoryPressure("a", deficit)], slow_hops)
    assert plans == []
    # The same shed on an owner whose other instance is idle meets the round: planned.
    alone = replace(view, instances=[i for i in view.instances if i.model.name == "m"])
    [plan] = plan_module_scaling(context([alone, host.view()], CONFIG, perf),
                                 [MemoryPressure("a", deficit)], slow_hops)
    assert plan.action is ModuleAction.SHED


def test_a_shed_goes_to_no_host_whose_admitted_request_would_miss_its_ttft():
    """Issue 22 #6: the host already admitted a request whose prefill (0.4 s, 0.44 s with the
    overestimate) is due by 0.48 s; the stage's share of the host's compute (1/8) makes it
    0.503 s. The host's round (0.022 s against 0.25 s) still fits, so before the fix the shed
    went there anyway."""
    perf = perf_for(proportional("m"), proportional("y"))
    owner = node("a", Hardware.CPU, 16, perf)
    host = node("b", Hardware.CPU, 16, perf)
    _serving(owner, "m", 1)
    _serving(host, "y", 1)
    host_view = host.view()
    [inst] = host_view.instances
    waiting = replace(inst.requests[0], input_len=4000, grace_s=0.0, prefilled=False,
                      slo=replace(inst.requests[0].slo, ttft_s=0.48))
    inst.requests = [waiting]
    deficit = layer_weight_bytes(spec(), LAYERS, HEAD) // 2
    plans = plan_module_scaling(context([owner.view(), host_view], CONFIG, perf),
                                [MemoryPressure("a", deficit)], SETTINGS)
    assert plans == []
    # With a TTFT it meets with the stage's work too, the shed goes there.
    inst.requests = [replace(waiting, slo=replace(waiting.slo, ttft_s=0.6))]
    [plan] = plan_module_scaling(context([owner.view(), host_view], CONFIG, perf),
                                 [MemoryPressure("a", deficit)], SETTINGS)
    assert plan.host_node == "b" and plan.load == 1 / LAYERS


# -- #10: online calibration double-counts hops and host contention -----------------------------


def _decided_s(perf, cal, choice, inst, config, stage_load: float) -> float:
    """The iteration's time as the node's decisions see it once the calibration is in: the
    calibrated profile with the instance's hops (`instance_profile`), contended by the node's
    stage load, without the overestimate."""
    base = perf.get(inst.model.name, Hardware.CPU)
    fixed = perf_for(calibrated(base, cal.factor("m", PREFILL), cal.factor("m", DECODE)))
    profile = instance_profile(fixed, inst, Hardware.CPU)
    scale = (1 + contended(config, stage_load).overestimate) / (1 + config.overestimate)
    return predict_seconds(choice, inst, profile) * scale


def test_calibration_on_a_stage_host_learns_nothing_the_core_already_applies():
    """Issue 22 #10: a split instance (two hops an iteration) on a node whose hosted stages take
    half its compute runs exactly as the core's model says: its profile, plus the hops, over
    1 - 0.5. Before the fix the baseline left the hops and the contention out, so the node
    learnt a factor of about 1/(1-L) = 2 and its decisions then applied the contention again."""
    perf = perf_for(proportional())
    sched = node("a", Hardware.CPU, 16, perf)
    iid = _serving(sched, "m", 4)
    sched.set_layout(iid, InstanceLayout(spec(), (LayerRun(6, 8, "b", "b:1"),), 2e-3, 1e9), 0.0)
    inst = sched.node.instance(iid)
    load = 0.5
    choice = IterationChoice(iid, IterationKind.DECODE, tuple(r.request_id for r in inst.requests),
                             1.0)
    true_s = predict_seconds(choice, inst, instance_profile(perf, inst, Hardware.CPU)) / (1 - load)
    cal = Calibrator()
    base = perf.get("m", Hardware.CPU)
    for k in range(200):
        cal.observe("m", DECODE, baseline_s(choice, inst, base, load), true_s, now=float(k) / 10)
    assert cal.factor("m", DECODE) == 1.0
    decided = _decided_s(perf, cal, choice, inst, CONFIG, load)
    assert abs(decided / true_s - 1) < 1e-9

"""Decisions the core used to get wrong, each reproduced as the reviewer found it (issue: the
core's decisions made truthful). Every test failed on the earlier core."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.consolidation import preemption_victims
from shared.core.evaluate import evaluate
from shared.core.iteration import IterationKind
from shared.core.memory import MemOpKind, memop_seconds
from shared.core.placement import PlaceAction, place, queueing_breaks_ttft
from shared.core.shadow import shadow_validate
from shared.core.types import SLO, Hardware, InstanceStatus, InstanceView, RequestView, RunningIteration

from tests.core.factories import flat_profile, linear_profile, loaded, model, node, perf_for, request

CFG = CoreConfig()


# 1. Running out of the step budget used to mean ADMITTED --------------------------------------
def _crowded_node():
    """12 busy instances with 15 ms decodes (one request each, due soon) and an empty target."""
    spec = model("m")
    instances, profiles = [], {}
    for k in range(12):
        iid = f"busy{k}"
        instances.append(InstanceView(iid, spec, "n", requests=[
            RequestView(f"r{k}", "m", 100, 0.0, SLO(0.5, 0.25), generated=1, prefilled=True)]))
        profiles[iid] = flat_profile("m", Hardware.GPU, prefill_s=0.01, decode_s=0.015)
    instances.append(InstanceView("target", spec, "n"))
    profiles["target"] = flat_profile("m", Hardware.GPU, prefill_s=3.0, decode_s=0.015)
    newcomer = RequestView("new", "m", 1000, 0.0, SLO(8.0, 0.25))
    return instances, profiles, newcomer


def test_step_cap_never_admits_what_it_did_not_check():
    instances, profiles, newcomer = _crowded_node()
    capped = shadow_validate(instances, profiles, "target", newcomer, 0.0, 0.0, CoreConfig(shadow_max_steps=256))
    exact = shadow_validate(instances, profiles, "target", newcomer, 0.0, 0.0, CoreConfig(shadow_max_steps=100_000))
    assert exact is AdmitReason.TTFT_MISS  # the decodes push its 3.3 s prefill past 8 s
    assert capped is AdmitReason.HORIZON  # refused, and the decision says why


def test_default_step_budget_decides_the_crowded_example_exactly():
    instances, profiles, newcomer = _crowded_node()
    assert shadow_validate(instances, profiles, "target", newcomer, 0.0, 0.0, CFG) is AdmitReason.TTFT_MISS


def _cold_start_beside_a_fast_decoder(load_s: float):
    """A CPU node whose instance of model "a" decodes four requests in 3 ms steps, and a resumed
    request (a drain's migration) for model "b" that needs a new instance loading `load_s`."""
    fast = flat_profile("a", Hardware.CPU, prefill_s=0.02, decode_s=0.003)
    perf = perf_for(fast, replace(fast, model="b", load_s=load_s))
    sched = node("cpu0", Hardware.CPU, 64, perf)
    spec_a, spec_b = model("a", weight_gb=0.1, max_context=4096), model("b", weight_gb=0.1, max_context=4096)
    iid = loaded(sched, None, request("r0", "a", input_len=50, ttft=10, tpot=0.5), spec_a)
    for k in range(1, 4):
        assert sched.admit(request(f"r{k}", "a", input_len=50, ttft=10, tpot=0.5), iid, spec_a, 0.0).admission.ok
    resumed = replace(request("moved", "b", input_len=20, ttft=10, tpot=0.5, generated=5, max_tokens=1500),
                      prefilled=False)
    return sched.view(), resumed, spec_b, perf


def test_a_cold_start_beside_a_fast_decoder_is_decided_not_refused_for_its_length():
    """A 6 s load is 1,800 of the neighbour's 3.3 ms decode steps: counted against the 1,024
    steps meant for the newcomer's own future, it was refused HORIZON (a multihost drain's
    migration to a node with no instance). The steps before the newcomer's instance can run have
    their own, larger budget, and still bound the work."""
    view, resumed, spec, perf = _cold_start_beside_a_fast_decoder(load_s=6.0)
    assert evaluate(view, None, resumed, spec, perf, 0.0, CFG).reason is AdmitReason.ADMITTED
    short = CoreConfig(shadow_max_wait_steps=1_000)
    assert evaluate(view, None, resumed, spec, perf, 0.0, short).reason is AdmitReason.HORIZON


# 2. The iteration in flight was simulated a second time ---------------------------------------
def test_prefill_in_flight_is_credited_not_run_again():
    """During a 1 s CPU prefill a second request was refused (HEADROOM: the shadow ran that
    prefill again) and just after it, the same request was admitted."""
    perf = perf_for(linear_profile("m", Hardware.CPU, per_token_prefill=0.01, load_s=0.0))
    spec = model("m")
    sched = node("cpu0", Hardware.CPU, 64, perf)
    iid = loaded(sched, None, request("a", input_len=100, ttft=1.2, tpot=0.25), spec)
    plan = sched.step(0.0)
    assert plan.iteration.kind is IterationKind.PREFILL and sched.node.busy_until == 1.0
    b = request("b", input_len=16, arrival=0.1, ttft=2.3, tpot=0.25)
    during = evaluate(sched.view(), iid, b, spec, perf, 0.1, CFG)
    sched.finish_iteration(plan.iteration, 1.0)
    after = evaluate(sched.view(), iid, b, spec, perf, 1.0, CFG)
    assert after.reason is AdmitReason.ADMITTED
    assert during.reason is AdmitReason.ADMITTED
    assert sched.node.running is None


def test_a_token_in_flight_that_comes_late_is_not_blamed_on_the_newcomer():
    spec = model("m")
    prof = {"a": flat_profile("m", Hardware.GPU, prefill_s=0.05, decode_s=0.02)}
    late = RequestView("x", "m", 100, 0.0, SLO(0.3, 0.25), generated=0, prefilled=False)
    inst = InstanceView("a", spec, "n", requests=[late])
    running = RunningIteration("a", ("x",), True)
    newcomer = RequestView("new", "m", 100, 0.0, SLO(2.0, 0.25))
    # x's prefill ends at 0.5 s, after its 0.3 s deadline: lost either way.
    verdict = shadow_validate([inst], prof, "a", newcomer, 0.0, 0.5, CFG, running)
    assert verdict is AdmitReason.ADMITTED


# 3. Memory operations that block an instance ----------------------------------------------------
def _two_models_perf(load_s=1.0, scale_fixed=0.5):
    return perf_for(*(replace(flat_profile(m, Hardware.GPU, prefill_s=0.05, decode_s=0.02, load_s=load_s),
                              kv_scale_fixed_s=scale_fixed) for m in ("m", "o")))


def test_running_resize_blocks_the_instance_in_the_timeline():
    perf = _two_models_perf(scale_fixed=0.5)
    spec = model("m", weight_gb=1, kv_per_token=1024 * 1024, max_context=1024, avg_out=64)
    sched = node("g0", Hardware.GPU, 80, perf)
    iid = loaded(sched, None, request("a", ttft=5), spec)
    assert sched.admit(request("b", ttft=5, input_len=890), iid, spec, 0.0).start_ops == ()
    res = sched.admit(request("c", ttft=5, input_len=890), iid, spec, 0.0)  # needs more KV
    assert [op.kind for op in res.start_ops] == [MemOpKind.SCALE]
    inst = sched.node.instance(iid)
    resize_s = memop_seconds(res.start_ops[0], perf.get("m", Hardware.GPU), spec.weight_bytes)
    assert resize_s > 0.5 and inst.ready_at == resize_s  # nothing runs before the resize ends
    assert sched.step(0.1).iteration is None  # the node agrees with its timeline
    tight = request("c", ttft=0.3, input_len=10)
    assert evaluate(sched.view(), iid, tight, spec, perf, 0.1, CFG).reason is AdmitReason.TTFT_MISS
    sched.memop_done(res.start_ops[0], 0.3)  # done earlier than estimated: free at once
    assert sched.node.instance(iid).ready_at == 0.3


def test_a_join_that_grows_the_kv_pool_waits_for_the_resize_in_the_shadow():
    """The resize this very join starts blocks the instance: the shadow must see the newcomer's
    first token after it (and after whatever else the node runs meanwhile), not at once."""
    perf = _two_models_perf(scale_fixed=0.5)
    spec = model("m", weight_gb=1, kv_per_token=1024 * 1024, max_context=1024, avg_out=64)
    sched = node("g0", Hardware.GPU, 80, perf)
    iid = loaded(sched, None, request("a", ttft=5), spec)
    sched.admit(request("b", ttft=5, input_len=890), iid, spec, 0.0)
    grows = request("c", ttft=0.3, input_len=890)  # needs more KV: a resize of > 0.5 s
    assert evaluate(sched.view(), iid, grows, spec, perf, 0.0, CFG).reason is AdmitReason.TTFT_MISS
    roomy = request("c", ttft=5, input_len=890)
    admission = evaluate(sched.view(), iid, roomy, spec, perf, 0.0, CFG)
    assert admission.ok and admission.kv_target_bytes is not None
    fits = request("d", ttft=0.3, input_len=10)  # fits the pool as it is: no resize, no wait
    assert evaluate(sched.view(), iid, fits, spec, perf, 0.0, CFG).ok


def test_load_held_back_in_the_reservation_station_is_ready_only_after_the_wait():
    perf = _two_models_perf(load_s=1.0)
    big = model("o", weight_gb=45)
    spec = model("m", weight_gb=40)
    sched = node("g0", Hardware.GPU, 80, perf)
    old = loaded(sched, None, request("o1", model_name="o"), big)
    sched.node.instance(old).requests.clear()
    unload_ops = sched.reclaim_idle(10.0)  # the 40 GB instance is unloading (0.05 s)
    assert [op.kind for op in unload_ops] == [MemOpKind.UNLOAD]
    res = sched.admit(request("m1", arrival=10.0, ttft=5), None, spec, 10.0)
    assert res.admission.ok and res.start_ops == ()  # parked until the unload completes
    inst = sched.node.instance(res.instance_id)
    assert inst.ready_at == pytest.approx(10.0 + 0.05 + 1.0)  # not now + load_s
    assert res.admission.grace_s == pytest.approx(1.0)  # the load is grace, the wait is not


# 4. Preempt-and-admit is one step the node re-checks ------------------------------------------
def test_node_refusal_of_preempt_and_admit_leaves_victims_untouched():
    perf = _two_models_perf()
    spec, other = model("m", weight_gb=30), model("o", weight_gb=30)
    sched = node("g0", Hardware.GPU, 80, perf)
    big = loaded(sched, None, request("a", ttft=5), spec)
    loaded(sched, big, request("b", ttft=5), spec)
    victim = loaded(sched, None, request("v", model_name="o", ttft=5), other)
    impossible = request("x", ttft=0.01)  # cannot meet its TTFT anywhere
    res = sched.preempt_and_admit([victim], impossible, big, spec, 0.0)
    assert not res.admission.ok and res.evicted == ()
    assert sched.node.instance(victim).status is InstanceStatus.READY
    assert [r.request_id for r in sched.node.instance(victim).requests] == ["v"]


def test_preempt_and_admit_refuses_victims_that_are_not_smaller_any_more():
    perf = _two_models_perf()
    spec, other = model("m", weight_gb=30), model("o", weight_gb=30)
    sched = node("g0", Hardware.GPU, 80, perf)
    big = loaded(sched, None, request("a", ttft=5), spec)
    victim = loaded(sched, None, request("v", model_name="o", ttft=5), other)
    res = sched.preempt_and_admit([victim], request("x", ttft=5), big, spec, 0.0)
    assert res.admission.reason is AdmitReason.VICTIMS_CHANGED  # equal batches (1 and 1)
    assert sched.node.instance(victim).status is InstanceStatus.READY


def test_preempt_and_admit_hands_back_the_victims_requests():
    perf = _two_models_perf()
    spec, other = model("m", weight_gb=30), model("o", weight_gb=30)
    sched = node("g0", Hardware.GPU, 80, perf)
    big = loaded(sched, None, request("a", ttft=5), spec)
    loaded(sched, big, request("b", ttft=5), spec)
    victim = loaded(sched, None, request("v", model_name="o", ttft=5), other)
    res = sched.preempt_and_admit([victim], request("x", ttft=5), big, spec, 0.0)
    assert res.admission.ok and [r.request_id for r in res.evicted] == ["v"]
    assert sched.node.instance(victim).status is InstanceStatus.UNLOADING


# 5. (wire) see tests/core/test_wire_views.py ---------------------------------------------------
# 6. New instances pack instead of spreading ----------------------------------------------------
def test_new_instance_packs_onto_a_used_node_whatever_its_iteration_state():
    perf = _two_models_perf()
    spec, other = model("m", weight_gb=10), model("o", weight_gb=10)
    used, empty = node("g0", Hardware.GPU, 80, perf), node("g1", Hardware.GPU, 80, perf)
    loaded(used, None, request("o1", model_name="o", ttft=5), other)
    newcomer = request("x", ttft=5)
    idle = place(newcomer, spec, DecisionContext([empty.view(), used.view()], perf, 0.0, CFG))
    used.step(0.0)  # now mid-iteration: the old order would pick the empty node instead
    busy = place(newcomer, spec, DecisionContext([empty.view(), used.view()], perf, 0.0, CFG))
    assert idle.action is busy.action is PlaceAction.NEW_INSTANCE
    assert idle.node_id == busy.node_id == "g0"
    first = next(a for a in busy.attempts if a.instance_id is None)
    assert first.node_id == "g0" and first.free_bytes is not None and first.startup_s == 1.0


def test_a_node_whose_startup_breaks_the_ttft_comes_after_one_that_meets_it():
    perf = _two_models_perf(load_s=1.0)
    spec, other = model("m", weight_gb=40), model("o", weight_gb=45)
    crowded, empty = node("g0", Hardware.GPU, 80, perf), node("g1", Hardware.GPU, 80, perf)
    old = loaded(crowded, None, request("o1", model_name="o"), other)
    crowded.node.instance(old).requests.clear()
    crowded.reclaim_idle(10.0)  # unloading: a new load there waits for it
    crowded.node.memops_until = 13.0  # a slow unload, say
    newcomer = request("x", arrival=10.0, ttft=1.0)
    plan = place(newcomer, spec, DecisionContext([crowded.view(), empty.view()], perf, 10.0, CFG))
    assert plan.node_id == "g1"


# 7. Equal-size neighbours cannot be preempted ---------------------------------------------------
def test_only_strictly_smaller_batches_are_victims():
    spec, other = model("m", weight_gb=10), model("o", weight_gb=10)
    sched = node("g0", Hardware.GPU, 80, _two_models_perf())
    mine = loaded(sched, None, request("a"), spec)
    equal = loaded(sched, None, request("b", model_name="o"), other)
    idle = loaded(sched, None, request("c", model_name="o"), other)
    sched.node.instance(idle).requests.clear()
    victims = {v.instance_id for v in preemption_victims(sched.node, sched.node.instance(mine))}
    assert equal not in victims and idle in victims
    assert preemption_victims(sched.node, None) == []  # a new instance preempts nobody


# 8. The drop test judges each hardware kind with its own numbers, with the margin --------------
def test_drop_does_not_mix_one_kinds_prefill_with_anothers_load():
    # CPU: fast prefill, slow load; GPU: slow prefill, fast load. Neither alone can make it,
    # but the fastest prefill plus the longest load (as grace) used to say "queue".
    perf = perf_for(flat_profile("m", Hardware.CPU, prefill_s=0.4, load_s=5.0),
                    flat_profile("m", Hardware.GPU, prefill_s=1.0, load_s=0.1))
    spec = model("m")
    nodes = [node("c0", Hardware.CPU, 256, perf).view(), node("g0", Hardware.GPU, 80, perf).view()]
    r = request("x", arrival=0.0, ttft=1.0)
    assert queueing_breaks_ttft(r, nodes, spec, DecisionContext(nodes, perf, 0.7, CFG))


def test_drop_keeps_the_overestimate_margin():
    perf = perf_for(flat_profile("m", Hardware.GPU, prefill_s=0.5, load_s=0.0))
    nodes = [node("g0", Hardware.GPU, 80, perf).view()]
    r = request("x", arrival=0.0, ttft=1.0)
    # 0.48 + 0.55 > 1
    assert queueing_breaks_ttft(r, nodes, model("m"), DecisionContext(nodes, perf, 0.48, CFG))
    assert not queueing_breaks_ttft(r, nodes, model("m"), DecisionContext(nodes, perf, 0.40, CFG))


# Grace for a request joining an instance that is still loading ---------------------------------
def test_joining_a_loading_instance_gets_the_rest_of_the_load_as_grace():
    perf = _two_models_perf(load_s=2.0)
    spec = model("m")
    sched = node("g0", Hardware.GPU, 80, perf)
    res = sched.admit(request("a", ttft=1.0), None, spec, 0.0)
    assert res.admission.grace_s == 2.0
    late_joiner = request("b", arrival=0.5, ttft=1.0)
    adm = sched.admit(late_joiner, res.instance_id, spec, 0.5)
    assert adm.admission.ok and adm.admission.grace_s == 1.5
    joined = next(r for r in sched.node.instance(res.instance_id).requests if r.request_id == "b")
    assert joined.grace_s == 1.5

"""Issue 22's LoRA wrong decisions (#4, #5, #9), each pinned by a test that failed before its fix.

#4: an adapter's load blocks its backbone instance; it is priced by its size at the core's
    adapter load rate, the admission's shadow validation sees the block, and pre-loading onto a
    serving instance happens only where the requests running there can wait for it.
#5: stop-and-resume preempt-and-admit checks what the admission then checks (the adapter's
    bytes), so it never unloads the victims and then refuses the newcomer.
#9: a batch's LoRA cost grows with the distinct adapters it holds, and the placer accounts for
    the adapter's bytes (and which instances hold it) when it picks a node.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.core.context import DecisionContext
from shared.core.admission import AdmitReason
from shared.core.evaluate import evaluate
from shared.core.iteration import IterationChoice, IterationKind, predict_seconds
from shared.core.lora import ADAPTER_LOAD_BYTES_PER_S, adapter_load_s
from shared.core.memory import MemOpKind
from shared.core.perf_model import LoraCost
from shared.core.placement import PlaceAction, place
from shared.core.types import AdapterSpec, Hardware, InstanceStatus, InstanceView, adapter_key

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request

GB = 10**9


def done(sched, ops, now=0.0):
    pending = list(ops)
    while pending:
        pending.extend(sched.memop_done(pending.pop(0), now))


def serving(memory_gb=10.0, weight_gb=1.0, ttft=1.0, tpot=0.25):
    """A node with one ready backbone instance running one decoding request ("base": prefilled,
    its next token is due at its 1 s cold-start grace + ttft + tpot: 2.25 s by default)."""
    spec = model("m", weight_gb=weight_gb)
    sched = node(memory_gb=memory_gb, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("base", ttft=ttft, tpot=tpot), spec)
    prefill(sched)
    return sched, spec, iid


def prefill(sched, now=0.0):
    """Run the node's next iteration (a prefill) at once: time is passed in, so it takes none."""
    plan = sched.step(now)
    assert plan.iteration is not None
    sched.finish_iteration(plan.iteration, now)


# --- #4: the adapter's load, priced and validated --------------------------------------------
def test_an_adapter_load_is_priced_by_its_bytes_at_the_core_rate():
    """2 GB at the core's adapter rate is 4 s, not a flat 0.05 s: the instance (which runs
    nothing while its adapter loads) is ready then in the node's timeline."""
    sched, spec, iid = serving(ttft=60.0, tpot=30.0)
    assert adapter_load_s(2 * GB) == pytest.approx(2 * GB / ADAPTER_LOAD_BYTES_PER_S) == 4.0
    res = sched.admit(request("r", ttft=60.0, tpot=30.0), iid, spec, 0.0, AdapterSpec("a", 2 * GB))
    assert res.admission.ok
    assert sched.node.instance(iid).ready_at == pytest.approx(4.0)
    assert sched.node.memops_until == pytest.approx(4.0)
    # Done early (the real read was quicker): free to run at once, as for any memory op.
    done(sched, [op for op in res.start_ops if op.instance_id == adapter_key(iid, "a")], 1.0)
    assert sched.node.instance(iid).ready_at == pytest.approx(1.0)


def test_an_adapter_load_that_would_make_a_running_request_late_is_refused():
    """The existing request's next token is due at 2.25 s; a 1.25 GB adapter holds its
    instance up for 2.5 s. Before the fix the admission validated the instance as free at once
    (and the node then ran the load anyway): admitted, and the token came at 2.52 s."""
    sched, spec, iid = serving()
    assert sched.node.instance(iid).requests[0].deadline() == pytest.approx(2.25)
    res = sched.admit(request("r", ttft=5.0), iid, spec, 0.0, AdapterSpec("a", 5 * GB // 4))
    assert res.admission.reason is AdmitReason.HEADROOM
    assert sched.node.instance(iid).adapters == {} and res.start_ops == ()
    # A small adapter (20 ms) leaves the running request on time: admitted.
    small = sched.admit(request("s", ttft=5.0), iid, spec, 0.0, AdapterSpec("b", 10**7))
    assert small.admission.ok


def test_the_newcomers_first_token_waits_for_its_adapter():
    """A ready instance gives no cold-start grace: a 1 GB adapter (2 s) breaks a 1 s TTFT."""
    sched, spec, iid = serving(ttft=60.0, tpot=30.0)
    res = sched.admit(request("r", ttft=1.0), iid, spec, 0.0, AdapterSpec("a", 1 * GB))
    assert res.admission.reason is AdmitReason.TTFT_MISS
    assert sched.admit(request("r2", ttft=3.0), iid, spec, 0.0,
                       AdapterSpec("a", 1 * GB)).admission.ok


def test_preloading_onto_a_serving_instance_respects_the_running_requests_headroom():
    sched, spec, iid = serving()  # "base" is due at 2.25 s
    assert sched.preload_adapter(iid, AdapterSpec("big", 5 * GB // 4), 0.0) == []  # 2.5 s: late
    assert sched.node.instance(iid).adapters == {}
    ops = sched.preload_adapter(iid, AdapterSpec("small", 10**7), 0.0)  # 20 ms: fits
    assert [op.instance_id for op in ops] == [adapter_key(iid, "small")]
    # An idle instance has nobody to make late: the long load goes ahead.
    sched2, _, iid2 = serving()
    sched2.cancel("base", 0.0)
    assert [op.kind for op in sched2.preload_adapter(iid2, AdapterSpec("big", 5 * GB // 4), 0.0)] \
        == [MemOpKind.LOAD]


# --- #5: the stop-and-resume trial checks the adapter's bytes ---------------------------------
def test_stop_and_resume_preemption_never_unloads_the_victims_then_refuses():
    """The preemptor's KV pool is big enough already, so evaluate() checks no memory; the
    adapter does not fit even without the victim. Before the fix the trial passed, the victim
    was unloaded and its requests evicted, and then the admission refused for memory."""
    spec = model("m", weight_gb=4)
    small = model("v", weight_gb=1)
    perf = perf_for(flat_profile("m", Hardware.GPU), flat_profile("v", Hardware.GPU))
    sched = node(memory_gb=6.5, perf=perf)
    iid = loaded(sched, None, request("p0", ttft=60.0, tpot=30.0), spec)
    prefill(sched)
    loaded(sched, iid, request("p1", ttft=60.0, tpot=30.0), spec)
    prefill(sched)
    victim = loaded(sched, None, request("v0", model_name="v", ttft=60.0, tpot=30.0), small)
    prefill(sched)
    sched.cancel("v0", 0.0)  # an idle neighbour: its batch (0) is smaller than the preemptor's
    free_after = sched.ledger.capacity - sched.ledger.budget + sched.ledger.target(victim)
    too_big = AdapterSpec("a", free_after + 1)
    res = sched.preempt_and_admit([victim], request("r", ttft=60.0, tpot=30.0), iid, spec, 0.0,
                                  too_big)
    assert res.admission.reason is AdmitReason.MEMORY
    assert res.evicted == () and res.start_ops == ()
    assert sched.node.instance(victim).status is InstanceStatus.READY
    # One that fits once the victim is gone: the victim goes, the request is admitted.
    fits = AdapterSpec("b", free_after - 10**6)
    res = sched.preempt_and_admit([victim], request("r", ttft=60.0, tpot=30.0), iid, spec, 0.0,
                                  fits)
    assert res.admission.ok and sched.node.instance(victim).status is InstanceStatus.UNLOADING
    assert "b" in sched.node.instance(iid).adapters


def test_stop_and_resume_trial_counts_the_victims_adapters_and_idle_ones_it_may_offload():
    """What the admission may free is what the trial may count: a victim's adapters go with it,
    and idle adapters elsewhere are offloaded first (§4.3)."""
    spec = model("m", weight_gb=4)
    small = model("v", weight_gb=1)
    perf = perf_for(flat_profile("m", Hardware.GPU), flat_profile("v", Hardware.GPU))
    sched = node(memory_gb=7.0, perf=perf)
    iid = loaded(sched, None, request("p0", ttft=60.0, tpot=30.0), spec)
    prefill(sched)
    loaded(sched, iid, request("p1", ttft=60.0, tpot=30.0), spec)
    prefill(sched)
    victim = loaded(sched, None, request("v0", model_name="v", ttft=60.0, tpot=30.0), small)
    prefill(sched)
    done(sched, sched.admit(request("va", model_name="v", ttft=60.0, tpot=30.0), victim, small, 0.0,
                            AdapterSpec("on-victim", GB // 2)).start_ops)
    done(sched, sched.admit(request("pa", ttft=60.0, tpot=30.0), iid, spec, 0.0,
                            AdapterSpec("idle", GB // 4)).start_ops)
    sched.cancel("pa", 0.0)
    sched.cancel("v0", 0.0)
    sched.cancel("va", 0.0)
    free_after = sched.ledger.capacity - sched.ledger.budget + sched.ledger.target(victim)
    need = free_after + GB // 2 + GB // 8  # the victim's adapter and half the idle one
    res = sched.preempt_and_admit([victim], request("r", ttft=60.0, tpot=30.0), iid, spec, 0.0,
                                  AdapterSpec("new", need))
    assert res.admission.ok
    assert set(sched.node.instance(iid).adapters) == {"new"}


# --- #9: distinct adapters in a batch ---------------------------------------------------------
COST = LoraCost(ranks=[8], batch_sizes=[1, 8], decode=[[0.2, 0.1]], prefill=[0.05], adapters=4)


def through(rid, adapter, rank=8, **kw):
    return replace(request(rid, **kw), lora_rank=rank, adapter=adapter, prefilled=True,
                   generated=1)


def test_the_lora_cost_grows_past_the_measured_adapters_and_never_falls_below_them():
    assert COST.decode_factor(8, 8, adapters=4) == pytest.approx(1.1)
    assert COST.decode_factor(8, 8, adapters=8) == pytest.approx(1.2)  # twice the segments
    assert COST.decode_factor(8, 8, adapters=1) == pytest.approx(1.1)  # the measured figure
    assert COST.decode_factor(8, 8) == pytest.approx(1.1)


def test_a_batch_over_more_adapters_is_predicted_slower():
    """Eight requests through eight adapters run eight segments per projection; before the fix
    they were predicted as fast as eight through one adapter."""
    profile = replace(flat_profile("m", Hardware.GPU), lora=COST)
    spec = model("m")

    def step_s(names):
        inst = InstanceView("i", spec, "n0",
                            requests=[through(f"r{k}", a) for k, a in enumerate(names)])
        choice = IterationChoice("i", IterationKind.DECODE, tuple(r.request_id for r in inst.requests),
                                 0.0)
        return predict_seconds(choice, inst, profile)

    one, eight = step_s(["a"] * 8), step_s([f"a{k}" for k in range(8)])
    assert one == pytest.approx(0.02 * 1.1)
    assert eight == pytest.approx(0.02 * 1.2)


def test_the_shadow_round_counts_the_newcomers_adapter_among_the_batchs():
    """Case 3 with a 26 ms TPOT, a flat +10% measured over four adapters: seven requests
    through seven adapters and a newcomer through one of them make a 0.02 x 1.175 x 1.1 =
    25.85 ms round (admitted); a newcomer through an eighth, 0.02 x 1.2 x 1.1 = 26.4 ms
    (refused). Before the fix both rounds were priced 0.02 x 1.1 x 1.1 = 24.2 ms."""
    flat = LoraCost([8], [1], [[0.1]], [0.05], adapters=4)
    profile = replace(flat_profile("m", Hardware.GPU), lora=flat)
    spec = model("m")
    sched = node(perf=perf_for(profile))

    def req(rid, adapter):
        return replace(request(rid, ttft=60.0, tpot=0.026), lora_rank=8, adapter=adapter)

    iid = loaded(sched, None, req("r0", "a0"), spec)
    for k in range(1, 7):
        assert sched.admit(req(f"r{k}", f"a{k}"), iid, spec, 0.0).admission.ok
    view = sched.view()
    assert evaluate(view, iid, req("new", "a0"), spec, sched.perf, 0.0, sched.config).ok
    assert evaluate(view, iid, req("new", "a7"), spec, sched.perf, 0.0, sched.config).reason \
        is AdmitReason.TPOT_BUDGET


# --- #9: the placer sees adapters ---------------------------------------------------------------
def _two_nodes(n0_gb: float):
    """n0 (`n0_gb`) runs a backbone instance with two requests, n1 (10 GB) one with one:
    bin-packing tries n0's first."""
    spec = model("m", weight_gb=4)
    perf = perf_for(flat_profile("m", Hardware.GPU))
    n0, n1 = node("n0", memory_gb=n0_gb, perf=perf), node("n1", memory_gb=10, perf=perf)
    i0 = loaded(n0, None, request("a", ttft=60.0, tpot=30.0), spec)
    loaded(n0, i0, request("b", ttft=60.0, tpot=30.0), spec)
    i1 = loaded(n1, None, request("c", ttft=60.0, tpot=30.0), spec)
    return spec, perf, n0, n1, i0, i1


def test_the_placer_routes_an_adapter_request_to_a_node_with_room_for_the_adapter():
    """n0 has no room for the adapter; before the fix the plan named n0's instance anyway (the
    placer never saw the adapter), n0 refused for memory, and the same plan came back."""
    spec, perf, n0, n1, i0, i1 = _two_nodes(4.3)
    adapter = AdapterSpec("ad", n0.ledger.capacity - n0.ledger.budget + 1)
    req = replace(request("r", ttft=60.0, tpot=30.0), lora_rank=8, adapter="ad")
    assert n0.admit(req, i0, spec, 0.0, adapter).admission.reason is AdmitReason.MEMORY
    plan = place(req, spec, DecisionContext([n0.view(), n1.view()], perf, 0.0, n0.config),
                 adapter=adapter)
    assert (plan.action, plan.node_id, plan.instance_id) == (PlaceAction.ROUTE, "n1", i1)
    assert [(a.node_id, a.reason) for a in plan.attempts][:1] == [("n0", AdmitReason.MEMORY)]
    assert n1.admit(req, i1, spec, 0.0, adapter).admission.ok  # the node confirms it


def test_the_placer_counts_no_bytes_where_the_instance_holds_the_adapter_or_may_offload():
    spec, perf, n0, n1, i0, _ = _two_nodes(4.3)
    free = n0.ledger.capacity - n0.ledger.budget
    held = AdapterSpec("held", free // 2)
    done(n0, n0.admit(replace(request("h", ttft=60.0, tpot=30.0), lora_rank=8), i0, spec, 0.0,
                      held).start_ops)
    # n0 holds "held": a request through it needs no adapter bytes there.
    req = replace(request("r", ttft=60.0, tpot=30.0), lora_rank=8, adapter="held")
    plan = place(req, spec, DecisionContext([n0.view(), n1.view()], perf, 0.0, n0.config),
                 adapter=held)
    assert (plan.node_id, plan.instance_id) == ("n0", i0)
    # Once idle, "held" is what n0 offloads for another adapter that only fits without it.
    n0.cancel("h", 0.0)
    other = AdapterSpec("other", free - free // 4)
    req = replace(request("o", ttft=60.0, tpot=30.0), lora_rank=8, adapter="other")
    plan = place(req, spec, DecisionContext([n0.view(), n1.view()], perf, 0.0, n0.config),
                 adapter=other)
    assert (plan.node_id, plan.instance_id) == ("n0", i0)
    assert n0.admit(req, i0, spec, 0.0, other).admission.ok
    assert set(n0.node.instance(i0).adapters) == {"other"}


def test_the_placer_reads_the_adapter_from_the_wire_request_and_the_registry():
    """The placer's request-to-view path: the request's adapter by name (its batch's cost),
    and its bytes from the adapter's registry record (what the node's admission uses)."""
    from shared.cluster import adapter_spec, request_view
    from shared.schemas import InferenceRequest, ModelRecord

    records = {"base": ModelRecord("base", "/m", weight_bytes=4 * GB),
               "t~a": ModelRecord("t~a", "/a", base_model="base", weight_bytes=3 * 10**7)}
    req = InferenceRequest("r", "t", "base", [1, 2, 3], 8, 0.0, 1.0, 0.25, adapter="t~a",
                           adapter_rank=8)
    assert request_view(req).adapter == "t~a"
    assert adapter_spec(req, records) == AdapterSpec("t~a", 3 * 10**7)
    plain = InferenceRequest("r", "t", "base", [1, 2, 3], 8, 0.0, 1.0, 0.25)
    assert adapter_spec(plain, records) is None and request_view(plain).adapter is None
    assert adapter_spec(replace(req, adapter="t~gone"), records) is None


def test_stop_and_resume_trial_waits_for_the_victims_unload_before_the_adapter_load():
    """An adapter that fits only in the victim's memory cannot start loading before the
    victim's unload has run (pessimistic tracking parks it): the admission after the unload
    sees its first token 50 ms later than a trial on the node as it was. Before the fix the
    trial passed, the victim was unloaded, and the admission then refused (TTFT_MISS)."""
    from shared.core.memory import UNLOAD_S

    spec = model("m", weight_gb=4)
    small = model("v", weight_gb=1)
    perf = perf_for(flat_profile("m", Hardware.GPU), flat_profile("v", Hardware.GPU))
    sched = node(memory_gb=6.5, perf=perf)
    iid = loaded(sched, None, request("p0", ttft=60.0, tpot=30.0), spec)
    prefill(sched)
    loaded(sched, iid, request("p1", ttft=60.0, tpot=30.0), spec)
    prefill(sched)
    victim = loaded(sched, None, request("v0", model_name="v", ttft=60.0, tpot=30.0), small)
    prefill(sched)
    sched.cancel("v0", 0.0)
    free_now = sched.ledger.capacity - sched.ledger.pessimistic
    need = free_now + sched.ledger.target(victim) // 2  # starts once the victim has gone
    first_token = adapter_load_s(need) + 0.1 * 1.1  # its load, then its prefill
    ttft = first_token + UNLOAD_S / 2  # on time if the load started now; late after the unload
    res = sched.preempt_and_admit([victim], request("r", ttft=ttft, tpot=30.0), iid, spec, 0.0,
                                  AdapterSpec("a", need))
    assert res.admission.reason is AdmitReason.TTFT_MISS
    assert res.evicted == () and sched.node.instance(victim).status is InstanceStatus.READY
    relaxed = request("r", ttft=first_token + 2 * UNLOAD_S, tpot=30.0)
    assert sched.preempt_and_admit([victim], relaxed, iid, spec, 0.0,
                                   AdapterSpec("a", need)).admission.ok

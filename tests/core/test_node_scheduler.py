"""NodeScheduler: admission re-check, the step loop, memory ops, eviction and keep-alive."""

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.iteration import IterationKind
from shared.core.memory import MemOpKind
from shared.core.types import Hardware, InstanceStatus

from tests.core.factories import GB, flat_profile, loaded, model, node, perf_for, request


def test_new_instance_loads_then_runs_prefill_then_decodes():
    spec = model("m")
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU, load_s=0.5)))
    res = sched.admit(request("r1", arrival=0.0, ttft=1.0), None, spec, now=0.0)
    assert res.admission.ok and res.instance_id
    assert [op.kind for op in res.start_ops] == [MemOpKind.LOAD]
    assert sched.step(0.1).iteration is None  # still loading
    sched.memop_done(res.start_ops[0], 0.5)
    plan = sched.step(0.5)
    assert plan.iteration.kind is IterationKind.PREFILL
    sched.finish_iteration(plan.iteration, 0.6)
    plan = sched.step(0.6)
    assert plan.iteration.kind is IterationKind.DECODE and plan.iteration.request_ids == ("r1",)


def test_node_rechecks_and_rejects_with_reason():
    spec = model("m", weight_gb=70)
    sched = node(memory_gb=80, perf=perf_for(flat_profile("m", Hardware.GPU)))
    loaded(sched, None, request("a"), spec)
    other = model("big", weight_gb=20)
    sched.perf.add(flat_profile("big", Hardware.GPU))
    assert sched.admit(request("b", "big"), None, other, 0.0).admission.reason is AdmitReason.MEMORY
    assert sched.admit(request("c"), "nope", spec, 0.0).admission.reason is AdmitReason.INSTANCE_GONE


def test_kv_underestimation_scales_up_or_evicts_longest_headroom():
    # 1 GB weights, KV 1 MiB/token, node 1 GB + 700 MiB: the KV can never exceed 700 tokens.
    # Eq. 2 sizes the instance at its 600-token floor; two requests outgrow it while decoding.
    spec = model("m", weight_gb=1.0, kv_per_token=1024 * 1024, max_context=600, avg_out=1)
    cfg = CoreConfig(watermark=0.0)
    sched = node(memory_gb=1 + 700 / 1024, perf=perf_for(flat_profile("m", Hardware.GPU, prefill_s=0.01)),
                 config=cfg)
    iid = loaded(sched, None, request("a", input_len=200, ttft=5, max_tokens=400), spec)
    loaded(sched, iid, request("b", input_len=200, ttft=9, max_tokens=400), spec)
    now = 0.0
    for _ in range(2):  # both prefills
        plan = sched.step(now)
        sched.finish_iteration(plan.iteration, now)
    evicted = []
    grew = False
    for _ in range(400):  # decode until memory runs out
        plan = sched.step(now)
        for op in plan.start_ops:
            grew = True
            sched.memop_done(op, now)
        evicted += [e.request.request_id for e in plan.evictions]
        if evicted or (plan.iteration is None and not plan.start_ops):
            break
        if plan.iteration is not None:  # None while its scale-up runs
            sched.finish_iteration(plan.iteration, now)
        now += 0.01
    assert grew  # first it scaled up past the estimate (§VII-D) ...
    assert evicted == ["b"]  # ... then evicted the longer-headroom request (later TTFT deadline)
    assert sched.ledger.pessimistic <= sched.ledger.capacity


def test_keep_alive_reclaims_idle_instance():
    spec = model("m")
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)), config=CoreConfig(keep_alive_s=1.0))
    iid = loaded(sched, None, request("a", max_tokens=1), spec)
    plan = sched.step(0.0)
    sched.finish_iteration(plan.iteration, 0.1, finished={"a"})
    assert sched.reclaim_idle(0.5) == []
    ops = sched.reclaim_idle(1.2)
    assert [o.kind for o in ops] == [MemOpKind.UNLOAD]
    assert sched.view().instance(iid).status is InstanceStatus.UNLOADING
    sched.memop_done(ops[0], 1.3)
    assert sched.view().instances == [] and sched.ledger.budget == 0


def test_preempt_returns_requests_and_unloads():
    spec = model("m")
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("a"), spec)
    evicted, ops = sched.preempt([iid], 0.0)
    assert [r.request_id for r in evicted] == ["a"] and ops[0].kind is MemOpKind.UNLOAD


def test_budget_snapshot_matches_ledger():
    spec = model("m", weight_gb=2)
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)))
    loaded(sched, None, request("a"), spec)
    view = sched.view()
    assert view.budget_bytes == sched.ledger.budget >= 2 * GB


def test_growth_while_the_load_runs_is_a_scale_after_it():
    spec = model("m", kv_per_token=1024 * 1024, max_context=256)
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU, load_s=0.5)))
    first = sched.admit(request("a", input_len=60, ttft=5), None, spec, 0.0)
    assert [op.kind for op in first.start_ops] == [MemOpKind.LOAD]  # the load runs now
    grow = sched.admit(request("b", input_len=200, ttft=5, max_tokens=50), first.instance_id, spec, 0.1)
    assert grow.admission.ok and grow.start_ops == ()  # queued behind the running load
    released = sched.memop_done(first.start_ops[0], 0.5)
    assert [op.kind for op in released] == [MemOpKind.SCALE]  # not a second load


def test_next_reclaim_at_names_the_keep_alive_expiry():
    spec = model("m")
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)), config=CoreConfig(keep_alive_s=1.0))
    assert sched.next_reclaim_at() is None
    loaded(sched, None, request("a", max_tokens=1), spec)
    assert sched.next_reclaim_at() is None  # busy with a request
    plan = sched.step(0.0)
    sched.finish_iteration(plan.iteration, 0.2, finished={"a"})
    # finishing scaled the KV down lazily? then the op must complete before the clock matters
    for op in sched.ledger.running():
        sched.memop_done(op, 0.2)
    assert sched.next_reclaim_at() == 1.2
    assert sched.reclaim_idle(1.2) and sched.next_reclaim_at() is None

"""Invariants of the policy core under random inputs (hypothesis)."""

import random

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shared.core.config import CoreConfig
from shared.core.consolidation import preemption_victims
from shared.core.iteration import IterationKind
from shared.core.memory import MemOpKind, MemoryLedger, watermark_target
from shared.core.types import Hardware, InstanceView

from tests.core.factories import linear_profile, model, node, perf_for, request

# --- memory: pessimistic <= capacity, and parked ops always drain ---------------------------
ledger_actions = st.lists(
    st.tuples(st.sampled_from(["resize", "unload", "complete"]), st.integers(0, 4), st.integers(0, 60)),
    min_size=1, max_size=60)


@given(actions=ledger_actions, order_seed=st.integers(0, 2**16))
@settings(max_examples=300, deadline=None)
def test_pessimistic_never_exceeds_capacity_and_parked_ops_drain(actions, order_seed):
    cap = 100
    ledger = MemoryLedger(cap)
    rng = random.Random(order_seed)
    running = []
    for action, inst, size in actions:
        iid = f"i{inst}"
        if action == "complete" and running:  # completions arrive in any order
            op = running.pop(rng.randrange(len(running)))
            running += ledger.complete(op.instance_id, op.op_id, 0.0)
        elif action == "resize":
            kind = MemOpKind.SCALE if ledger.target(iid) else MemOpKind.LOAD
            ok, ops = ledger.request(kind, iid, size, 0.0)
            running += ops
            assert ok or ledger.budget - ledger.target(iid) + size > cap
        elif action == "unload":
            running += ledger.request(MemOpKind.UNLOAD, iid, 0, 0.0)[1]
        assert ledger.pessimistic <= cap
        assert ledger.budget <= cap
    while running:  # liveness: once nothing new arrives, every parked op gets to run
        op = running.pop(rng.randrange(len(running)))
        running += ledger.complete(op.instance_id, op.op_id, 0.0)
        assert ledger.pessimistic <= cap
    assert ledger.parked() == []
    assert ledger.pessimistic == ledger.budget


# --- watermark: no ping-pong on a steady load ---------------------------------------------------
@given(m_cur=st.integers(0, 10**9), m_req=st.integers(1, 10**9), w=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]))
def test_watermark_settles_after_one_change_on_steady_load(m_cur, m_req, w):
    target = watermark_target(m_cur, m_req, w)
    if target is not None:
        assert target >= m_req  # never below what the load needs
        assert watermark_target(target, m_req, w) is None  # and then it stays


# --- shadow validation: what was admitted meets its deadlines when the node runs -------------
request_specs = st.lists(st.tuples(st.integers(16, 1500), st.floats(0.3, 3.0), st.integers(0, 20)),
                         min_size=1, max_size=6)


@given(existing=request_specs, newcomers=request_specs, speed=st.floats(0.5, 1.1), seed=st.integers(0, 999))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_admitted_requests_pass_the_simulation_they_passed(existing, newcomers, speed, seed):
    """Run the node with real steps, each iteration taking `speed` x the prediction (<= the 10%
    overestimate): every request on time at the last admission stays on time until the last
    admitted request has its first token and every instance has decoded once after it."""
    rng = random.Random(seed)
    # No load time: a cold start would add its grace to TTFT and hide tight timelines.
    # Iterations slow enough (1 ms/token prefill, 50+ ms decode) that deadlines bind.
    perf = perf_for(linear_profile("a", Hardware.CPU, 1e-3, 0.05, 0.01, load_s=0.0),
                    linear_profile("b", Hardware.CPU, 1e-3, 0.08, 0.01, load_s=0.0))
    specs = {"a": model("a", weight_gb=1), "b": model("b", weight_gb=1)}
    sched = node("n", Hardware.CPU, 64, perf, CoreConfig())
    ids = {}
    for k, (inp, ttft, gen) in enumerate(existing):
        name = rng.choice("ab")
        r = request(f"e{k}", name, input_len=inp, ttft=ttft, generated=gen, arrival=0.0, max_tokens=64)
        res = sched.admit(r, ids.get(name), specs[name], 0.0)
        for op in res.start_ops:
            sched.memop_done(op, 0.0)
        if res.admission.ok:
            ids[name] = res.instance_id
    admitted = []
    for k, (inp, ttft, _) in enumerate(newcomers):
        name = rng.choice("ab")
        r = request(f"n{k}", name, input_len=inp, ttft=ttft, arrival=0.0, max_tokens=64)
        res = sched.admit(r, ids.get(name), specs[name], 0.0)
        for op in res.start_ops:
            sched.memop_done(op, 0.0)
        if res.admission.ok:
            ids[name] = res.instance_id
            admitted.append(r.request_id)
    assume(admitted)  # a case with no admission has nothing to check: hypothesis draws another
    on_time = {r.request_id for i in sched.node.instances for r in i.requests if r.headroom(0.0) >= 0}
    last = admitted[-1]
    busy = {i.instance_id for i in sched.node.instances if i.requests}
    now, last_done, decoded_after = 0.0, False, set()
    for _ in range(500):
        plan = sched.step(now)
        assert not plan.evictions
        for op in plan.start_ops:
            sched.memop_done(op, now)
        if plan.iteration is None:
            break
        now += plan.predicted_s * speed
        inst = sched.node.instance(plan.iteration.instance_id)
        for r in inst.requests:
            if r.request_id in plan.iteration.request_ids and r.request_id in on_time:
                assert r.headroom(now) >= -1e-9, (r.request_id, r.headroom(now))
        sched.finish_iteration(plan.iteration, now)
        if plan.iteration.kind is IterationKind.PREFILL and plan.iteration.request_ids[0] == last:
            last_done = True
        elif plan.iteration.kind is IterationKind.DECODE and last_done:
            decoded_after.add(inst.instance_id)
        if last_done and busy <= decoded_after:
            break


# --- preemption: never a neighbour at least as large as the preemptor ------------------------
@given(batches=st.lists(st.integers(0, 8), min_size=2, max_size=8), who=st.integers(0, 7))
def test_preemption_never_targets_an_equal_or_larger_batch(batches, who):
    spec = model("m")
    sched = node("n", Hardware.GPU, 1000, perf_for(linear_profile("m", Hardware.GPU)))
    for k, b in enumerate(batches):
        inst = InstanceView(f"i{k}", spec, "n", requests=[request(f"r{k}-{j}") for j in range(b)])
        sched.node.instances.append(inst)
    preemptor = sched.node.instances[who % len(batches)]
    victims = preemption_victims(sched.node, preemptor)
    # Exactly the neighbours with a strictly smaller batch (§VIII-A): none at least as large, and
    # none of the smaller ones missed (an empty answer must be the right answer, not a pass).
    smaller = {i.instance_id for i in sched.node.instances
               if i is not preemptor and i.batch_size < preemptor.batch_size}
    assert {v.instance_id for v in victims} == smaller and len(victims) == len(smaller)
    sizes = [v.batch_size for v in victims]
    assert sizes == sorted(sizes)  # smallest first

"""Preemption by live migration (SLINFER §VIII-A carried out with ServerlessLLM §5), pure.

The plan: live when the newcomer still meets its SLO waiting for the handover (the migration time
a·(t_in + t_out) + b of the destination's profile, after what holds the destination), with the
victims' work on the node until then; otherwise stop-and-resume, and the plan says why.
The node: the victims keep running their requests, take no work and keep their memory counted
by pessimistic tracking (their unload is held in the reservation station) until the handover;
the newcomer's instance runs nothing until they are unloaded.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.consolidation import handover_seconds
from shared.core.memory import MemOpKind
from shared.core.placement import PlaceAction, place
from shared.core.types import Hardware, InstanceStatus

from tests.core.factories import flat_profile, linear_profile, loaded, model, node, perf_for, request

LIVE = CoreConfig(live_preemption=True)
BIG = model("big", weight_gb=30, kv_per_token=10 * 1024**2, max_context=1024, avg_out=64)
SMALL = model("small", weight_gb=35, max_context=1024)
MODELS = {"big": BIG, "small": SMALL}


def _perf(small_per_token: float = 1e-4):
    return perf_for(flat_profile("big", Hardware.GPU, prefill_s=0.05, decode_s=0.01),
                    linear_profile("small", Hardware.GPU, small_per_token, 0.01, 0.001))


def _cluster(perf, config=LIVE):
    """g0: big with two requests whose KV cannot grow for a third while small (one running
    request, the smaller neighbour) holds 35 GB. g1: an instance of small with room."""
    g0, g1 = node("g0", Hardware.GPU, 80, perf, config), node("g1", Hardware.GPU, 80, perf, config)
    ib = loaded(g0, None, request("a", "big", input_len=400, ttft=5), BIG)
    loaded(g0, ib, request("b", "big", input_len=400, ttft=5), BIG)
    isv = loaded(g0, None, _moved_in("s", input_len=400, generated=10), SMALL)
    iso = loaded(g1, None, _moved_in("t", input_len=100, generated=3), SMALL)
    return g0, g1, ib, isv, iso


def _moved_in(rid: str, input_len: int, generated: int):
    """A request of small with tokens so far, still to (re)compute its KV cache."""
    return replace(request(rid, "small", input_len=input_len, ttft=5, generated=generated),
                   prefilled=False)


def _newcomer(ttft: float = 5.0):
    return request("c", "big", input_len=900, ttft=ttft, max_tokens=100)


def test_plan_goes_live_with_the_profiles_migration_time():
    perf = _perf()
    g0, g1, ib, isv, iso = _cluster(perf)
    g1.step(0.0)  # g1 is in an iteration: the destination starts the migration after it
    plan = place(_newcomer(), BIG,
                 DecisionContext([g0.view(), g1.view()], perf, 0.0, LIVE, MODELS))
    assert plan.action is PlaceAction.PREEMPT_AND_ROUTE and plan.preempt == (isv,)
    assert [(m.request_id, m.to_node, m.to_instance) for m in plan.migrations] == [("s", "g1", iso)]
    expected = g1.node.busy_until + perf.get("small", Hardware.GPU).migration_s(410)
    assert plan.live and plan.handover_s == pytest.approx(expected)
    assert plan.preempt_why.startswith("live")


def test_plan_falls_back_to_stop_and_resume_when_the_wait_breaks_the_ttft():
    perf = _perf(small_per_token=4e-3)  # recomputing s's 410 tokens takes ~1.6 s on g1
    g0, g1, *_ = _cluster(perf)
    plan = place(_newcomer(ttft=0.6), BIG,
                 DecisionContext([g0.view(), g1.view()], perf, 0.0, LIVE, MODELS))
    assert plan.action is PlaceAction.PREEMPT_AND_ROUTE
    assert not plan.live and plan.handover_s > 1.0
    assert "stop-and-resume" in plan.preempt_why and AdmitReason.TTFT_MISS.value in plan.preempt_why
    # The same wait is fine for a newcomer with a looser TTFT.
    loose = place(_newcomer(ttft=5.0), BIG,
                  DecisionContext([g0.view(), g1.view()], perf, 0.0, LIVE, MODELS))
    assert loose.live


def test_a_victim_whose_engine_cannot_migrate_live_moves_stop_and_resume():
    perf = _perf()
    g0, g1, *_ = _cluster(perf)
    fixed = {**MODELS, "small": replace(SMALL, live_migration=False)}  # e.g. served by OpenVINO
    plan = place(_newcomer(), BIG, DecisionContext([g0.view(), g1.view()], perf, 0.0, LIVE, fixed))
    assert plan.action is PlaceAction.PREEMPT_AND_ROUTE and not plan.live
    assert plan.preempt_why == "stop-and-resume: the engine of small cannot migrate live"


def test_without_live_preemption_the_plan_is_as_before():
    perf = _perf()
    g0, g1, *_ = _cluster(perf, CoreConfig())
    plan = place(_newcomer(), BIG,
                 DecisionContext([g0.view(), g1.view()], perf, 0.0, CoreConfig(), MODELS))
    assert plan.action is PlaceAction.PREEMPT_AND_ROUTE
    assert not plan.live and plan.handover_s == 0.0 and plan.preempt_why == ""


def test_handover_counts_a_loading_destinations_startup():
    perf = _perf()
    g0, g1, _, isv, _ = _cluster(perf)
    g2 = node("g2", Hardware.GPU, 80, perf, LIVE)
    res = g2.admit(request("u", "small", ttft=5), None, SMALL, 0.0)  # its load runs for 1 s
    assert res.admission.ok
    view = g0.view()
    victim_req = view.instance(isv).requests[0]
    from shared.core.consolidation import Migration

    moves = [Migration("s", isv, "g2", res.instance_id)]
    h = handover_seconds([(isv, victim_req)], moves,
                         DecisionContext([g0.view(), g2.view()], perf, 0.0, CoreConfig()))
    ready = g2.view().instance(res.instance_id).ready_at
    assert ready > 0.5
    assert h == pytest.approx(ready + perf.get("small", Hardware.GPU).migration_s(410))


def test_node_keeps_the_victim_running_and_counted_until_the_handover():
    perf = _perf()
    g0, g1, ib, isv, _ = _cluster(perf)
    plan = place(_newcomer(), BIG,
                 DecisionContext([g0.view(), g1.view()], perf, 0.0, LIVE, MODELS))
    cap, victim_bytes = g0.ledger.capacity, g0.ledger.allocated(isv)
    # A handover a little longer than planned: the victim runs only iterations that end by it,
    # and its request's recompute (41 ms, 45 ms with the overestimate) must fit here.
    handover = plan.handover_s + 0.1
    res = g0.preempt_and_admit(list(plan.preempt), _newcomer(), ib, BIG, 0.0, handover_s=handover)
    assert res.admission.ok and res.evicted == ()
    assert [r.request_id for r in res.migrating] == ["s"]
    victim = g0.node.instance(isv)
    assert victim.status is InstanceStatus.HANDOVER and victim.leaves_at == pytest.approx(handover)
    # The victim's bytes are promised away (budget) but still held (pessimistic): the newcomer's
    # KV growth is parked in the reservation station, nothing has started.
    assert res.start_ops == ()
    assert g0.ledger.allocated(isv) == victim_bytes and g0.ledger.pessimistic <= cap
    assert {(op.instance_id, op.kind, op.held) for op in g0.ledger.parked()} == {
        (isv, MemOpKind.UNLOAD, True), (ib, MemOpKind.SCALE, False)}
    # The victim's request still decodes; the newcomer's instance waits.
    step = g0.step(0.0)
    assert step.iteration is not None and step.iteration.instance_id == isv
    g0.finish_iteration(step.iteration, 0.02)
    assert g0.view().instance(ib).ready_at >= handover
    # A request on the victim accepts nothing new; placement does not offer it.
    assert g0.admit(request("z", "small", ttft=5), isv, SMALL, 0.1).admission.reason is \
        AdmitReason.INSTANCE_GONE
    # The request moved (the destination committed): the victim is unloaded now, then the
    # newcomer's growth starts and its instance runs.
    g0.cancel("s", 0.3)
    left, ops = g0.finish_handover(isv, 0.3)
    assert left == [] and [(op.kind, op.instance_id) for op in ops] == [(MemOpKind.UNLOAD, isv)]
    assert g0.ledger.pessimistic <= cap
    released = g0.memop_done(ops[0], 0.35)
    assert [(op.kind, op.instance_id) for op in released] == [(MemOpKind.SCALE, ib)]
    assert g0.node.instance(isv) is None
    g0.memop_done(released[0], 0.4)
    step = g0.step(0.4)
    assert step.iteration is not None and step.iteration.instance_id == ib  # it runs again


def test_a_request_left_on_the_victim_comes_back_for_stop_and_resume():
    perf = _perf()
    g0, g1, ib, isv, _ = _cluster(perf)
    plan = place(_newcomer(), BIG,
                 DecisionContext([g0.view(), g1.view()], perf, 0.0, LIVE, MODELS))
    g0.preempt_and_admit(list(plan.preempt), _newcomer(), ib, BIG, 0.0, handover_s=plan.handover_s)
    left, ops = g0.finish_handover(isv, 5.0)  # its migration was refused
    assert [r.request_id for r in left] == ["s"] and ops
    assert g0.finish_handover(isv, 5.0) == ([], [])  # once only


def test_node_refuses_a_live_preemption_whose_wait_breaks_the_ttft():
    perf = _perf()
    g0, _, ib, isv, _ = _cluster(perf)
    res = g0.preempt_and_admit([isv], _newcomer(ttft=1.0), ib, BIG, 0.0, handover_s=3.0)
    assert res.admission.reason is AdmitReason.TTFT_MISS
    assert g0.node.instance(isv).status is InstanceStatus.READY  # untouched
    assert g0.ledger.parked() == []


# --- the invariant under any interleaving ------------------------------------------------------
actions = st.lists(st.tuples(st.sampled_from(["admit", "admit", "admit", "preempt", "preempt",
                                              "handover", "complete", "complete", "step"]),
                             st.integers(0, 50), st.floats(0.0, 3.0)), max_size=40)


PROP_MODELS = [model(f"p{k}", weight_gb=w, kv_per_token=2 * 1024**2, max_context=1024, avg_out=64)
               for k, w in enumerate((10, 12, 8))]
PROP_PERF = perf_for(*(flat_profile(m.name, Hardware.GPU, prefill_s=0.05, decode_s=0.01)
                       for m in PROP_MODELS))


@given(actions=actions, memory_gb=st.sampled_from([30.0, 40.0, 60.0]))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_pessimistic_memory_never_exceeds_capacity_with_live_preemption(actions, memory_gb):
    """Admissions, live preemptions, handovers, memory-op completions and iterations in any
    order: pessimistic memory never exceeds capacity, a victim's bytes stay counted until its
    unload completes, the budget never exceeds capacity, and once every handover finished all
    parked ops drain."""
    g0 = node("g0", Hardware.GPU, memory_gb, PROP_PERF, LIVE)
    running: list = []
    now = 0.0
    n = 0

    handing: set[str] = set()  # victims whose handover has not been finished

    def check():
        assert g0.ledger.pessimistic <= g0.ledger.capacity
        assert g0.ledger.budget <= g0.ledger.capacity
        for v in handing:  # still there, still holding (and counted with) all its memory
            inst = g0.node.instance(v)
            assert inst is not None and inst.status is InstanceStatus.HANDOVER
            assert g0.ledger.allocated(v) >= inst.model.weight_bytes
            assert all(op.kind is not MemOpKind.UNLOAD for op in g0.ledger.running()
                       if op.instance_id == v)  # a KV resize it had under way may run on
        assert g0.ledger.pessimistic >= sum(g0.ledger.allocated(v) for v in handing)

    for kind, k, dt in actions:
        now += dt / 10
        n += 1
        if kind == "admit":
            spec = PROP_MODELS[k % 3]
            same = [i for i in g0.node.instances if i.model.name == spec.name and i.accepts]
            iid = same[0].instance_id if same and k % 3 else None
            res = g0.admit(request(f"r{n}", spec.name, input_len=50 + 10 * k, ttft=50, arrival=now),
                           iid, spec, now)
            running.extend(res.start_ops)
        elif kind == "preempt":
            pre = [i for i in g0.node.instances if i.accepts and i.requests]
            if not pre:
                continue
            p = max(pre, key=lambda i: i.batch_size)
            victims = [i.instance_id for i in g0.node.instances
                       if i.instance_id != p.instance_id and i.accepts and i.batch_size < p.batch_size]
            if not victims:
                continue
            res = g0.preempt_and_admit(victims[:1 + k % 2], request(f"r{n}", p.model.name, ttft=50,
                                                                   arrival=now, input_len=20 * k + 1),
                                       p.instance_id, p.model, now, handover_s=dt)
            running.extend(res.start_ops)
            if res.admission.ok:
                handing |= set(victims[:1 + k % 2])
        elif kind == "handover":
            victims = g0.handing_over()
            if victims:
                victim = victims[k % len(victims)]
                handing.discard(victim)
                running.extend(g0.finish_handover(victim, now)[1])
        elif kind == "complete" and running:
            op = running.pop(k % len(running))
            running.extend(g0.memop_done(op, now))
        elif kind == "step":
            plan = g0.step(now)
            running.extend(plan.start_ops)
            if plan.iteration is not None:
                running.extend(g0.finish_iteration(plan.iteration, now + plan.predicted_s))
        check()
    for victim in g0.handing_over():
        handing.discard(victim)
        running.extend(g0.finish_handover(victim, now)[1])
        check()
    while running:
        running.extend(g0.memop_done(running.pop(0), now))
        check()
    assert g0.ledger.parked() == []
    assert g0.ledger.pessimistic == g0.ledger.budget

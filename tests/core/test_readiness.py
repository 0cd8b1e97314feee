"""When an instance can run (`shared.core.readiness`): one answer for the admission, the node's
timeline and startup. Issue 22 #2: a join whose KV growth the reservation station will park
behind a live preemption's handover (or a running unload or scale-down) is validated with the
time it really runs, not as if the resize started now."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.evaluate import evaluate
from shared.core.memory import UNLOAD_S
from shared.core.readiness import growth_ready_at, parks
from shared.core.types import Hardware

from tests.core.factories import (flat_profile, linear_profile, loaded, model, node, perf_for,
                                  request)

LIVE = CoreConfig(live_preemption=True)
BIG = model("big", weight_gb=30, kv_per_token=10 * 1024**2, max_context=1024, avg_out=64)
SMALL = model("small", weight_gb=20, max_context=1024)
JOINED = model("a", weight_gb=10, kv_per_token=4 * 1024**2, max_context=1024, avg_out=64)
HANDOVER_S = 8.0


def _perf():
    return perf_for(flat_profile("big", Hardware.GPU, prefill_s=0.05, decode_s=0.01),
                    linear_profile("small", Hardware.GPU, 1e-4, 0.01, 0.001),
                    flat_profile("a", Hardware.GPU, prefill_s=0.05, decode_s=0.01))


def _handing_over(first_token_due: float = 2.0):
    """An 80 GB node: big (two requests), small (the victim, one moved-in request) and a (one
    request whose first token is due at `first_token_due`), 77.5 GB in all. A newcomer on big
    preempts small live with an 8 s handover: small's 20 GB leave the budget but stay held."""
    g0 = node("g0", Hardware.GPU, 80, _perf(), LIVE)
    ib = loaded(g0, None, request("b1", "big", input_len=400, ttft=30), BIG)
    loaded(g0, ib, request("b2", "big", input_len=400, ttft=30), BIG)
    victim = loaded(g0, None, replace(request("s", "small", input_len=400, ttft=5, generated=10),
                                      prefilled=False), SMALL)
    ia = loaded(g0, None, request("r1", "a", input_len=600, ttft=first_token_due), JOINED)
    newcomer = request("c", "big", input_len=900, ttft=12, max_tokens=100)
    res = g0.preempt_and_admit([victim], newcomer, ib, BIG, 0.0, handover_s=HANDOVER_S)
    assert res.admission.ok
    return g0, ia


def _join(ttft: float = 12.0):
    """Takes a's KV pool from 5 GB to ~7.7 GB: the budget has room (small's bytes are promised
    away), pessimistic tracking does not until small is unloaded."""
    return request("r2", "a", input_len=850, ttft=ttft, max_tokens=100)


def test_a_join_parked_behind_a_handover_is_refused_when_it_makes_a_first_token_late():
    g0, ia = _handing_over(first_token_due=2.0)
    view = g0.view()
    # A parked op starts once the held unload ends, after the handover.
    assert view.parked_start == pytest.approx(HANDOVER_S + UNLOAD_S)
    # The placer's check on the view and the node's own re-check agree: r1's first token (due
    # at 2.0 s) would wait for a resize that cannot start before ~8.05 s.
    assert evaluate(view, ia, _join(), JOINED, g0.perf, 0.0, LIVE).reason is AdmitReason.HEADROOM
    res = g0.admit(_join(), ia, JOINED, 0.0)
    assert res.admission.reason is AdmitReason.HEADROOM
    assert g0.view().instance(ia).ready_at == 0.0  # nothing changed on the node


def test_a_join_that_waits_for_the_handover_without_harm_is_admitted_and_timed_as_the_node_will():
    g0, ia = _handing_over(first_token_due=20.0)  # r1 can wait for the handover
    res = g0.admit(_join(), ia, JOINED, 0.0)
    assert res.admission.ok and res.admission.kv_target_bytes is not None
    assert res.start_ops == ()  # parked in the reservation station
    assert g0.view().instance(ia).ready_at > HANDOVER_S


def test_a_join_whose_growth_fits_pessimistic_memory_is_not_held_back():
    g0, ia = _handing_over(first_token_due=2.0)
    small_join = request("r2", "a", input_len=700, ttft=12, max_tokens=100)
    res = g0.admit(small_join, ia, JOINED, 0.0)
    assert res.admission.ok
    assert [op.instance_id for op in res.start_ops] == [ia]  # the resize runs now
    assert g0.view().instance(ia).ready_at < 1.0


def test_behind_a_running_unload_the_prediction_is_the_nodes_own_timeline():
    """The shorter case: the bytes of an instance being unloaded stay held until its unload
    completes, so a join's growth that needs them waits for it; the admission's ready time is
    the one the node's timeline then shows."""
    g0 = node("g0", Hardware.GPU, 80, _perf())
    gone = loaded(g0, None, replace(request("s", "small", input_len=400, ttft=5, generated=10),
                                    prefilled=False), SMALL)
    loaded(g0, None, request("b1", "big", input_len=400, ttft=30), BIG)
    ia = loaded(g0, None, request("r1", "a", input_len=600, ttft=20), JOINED)
    _, ops = g0.preempt([gone], 0.0)
    assert [op.instance_id for op in ops] == [gone]  # running: its 20 GB are held until it ends
    view = g0.view()
    assert view.parked_start == view.memops_until == pytest.approx(0.05)
    inst = view.instance(ia)
    kv = evaluate(view, ia, _join(), JOINED, g0.perf, 0.0, CoreConfig()).kv_target_bytes
    assert kv is not None and parks(view, kv - inst.kv_bytes)
    predicted = growth_ready_at(view, inst, kv, g0.perf.get("a", Hardware.GPU), 0.0)
    res = g0.admit(_join(), ia, JOINED, 0.0)
    assert res.admission.ok and res.start_ops == ()  # parked behind the unload
    assert g0.view().instance(ia).ready_at == pytest.approx(predicted)
    assert predicted > view.parked_start


def test_behind_a_running_scale_down_the_prediction_is_the_nodes_own_timeline():
    """A lazy scale-down holds its larger size until it completes: a join's growth that needs
    those bytes waits for it, and the admission says so."""
    shrinking = model("x", weight_gb=16, kv_per_token=10 * 1024**2, max_context=1024, avg_out=64)
    perf = perf_for(flat_profile("x", Hardware.GPU), flat_profile("a", Hardware.GPU))
    g0 = node("g0", Hardware.GPU, 80, perf)
    ix = loaded(g0, None, request("x0", "x", input_len=900, ttft=30, max_tokens=100), shrinking)
    for k in range(1, 5):
        loaded(g0, ix, request(f"x{k}", "x", input_len=900, ttft=30, max_tokens=100), shrinking)
    ia = loaded(g0, None, request("r1", "a", input_len=600, ttft=20), JOINED)
    ops = []
    for k in range(1, 5):
        ops.extend(g0.cancel(f"x{k}", 0.0))
    assert [op.kind.value for op in ops] == ["scale"] and not ops[0].grows  # running
    view = g0.view()
    inst = view.instance(ia)
    kv = evaluate(view, ia, _join(), JOINED, perf, 0.0, CoreConfig()).kv_target_bytes
    assert kv is not None and parks(view, kv - inst.kv_bytes)
    predicted = growth_ready_at(view, inst, kv, perf.get("a", Hardware.GPU), 0.0)
    res = g0.admit(_join(), ia, JOINED, 0.0)
    assert res.admission.ok and res.start_ops == ()  # parked behind the scale-down
    assert g0.view().instance(ia).ready_at == pytest.approx(predicted)
    assert predicted > view.parked_start > 0.0

"""Eq. 1's deadline in one place (issue 22 #13): the core's `first_token_due` and `token_deadline`,
the grace a resumed request is given (`resume_grace`), the cold-start grace as it crosses the wire,
and a shadow validation that refuses a target that can never run."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import wire
from shared.cluster import request_view
from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.shadow import shadow_validate
from shared.core.types import (SLO, Hardware, InstanceStatus, InstanceView, RequestView,
                               first_token_due, resume_grace, token_deadline)
from shared.schemas import InferenceRequest

from tests.core.factories import flat_profile, model, node, perf_for, request

times = st.floats(0, 1e6, allow_nan=False)
slos = st.floats(0.01, 30, allow_nan=False)


@given(arrival=times, grace=st.floats(0, 100), ttft=slos, tpot=slos, generated=st.integers(0, 5000))
def test_a_request_views_deadline_is_the_cores_rule(arrival, grace, ttft, tpot, generated):
    r = RequestView("r", "m", 10, arrival, SLO(ttft, tpot), generated=generated, grace_s=grace)
    assert r.deadline_base() == first_token_due(arrival, grace, ttft)
    assert r.deadline() == token_deadline(first_token_due(arrival, grace, ttft), tpot, generated)


@given(arrival=times, lost=st.floats(0, 1e4), ttft=slos, tpot=slos, generated=st.integers(0, 5000))
def test_a_resumed_requests_next_token_is_due_one_ttft_after_the_resume(arrival, lost, ttft, tpot,
                                                                         generated):
    now = arrival + lost
    grace = resume_grace(arrival, tpot, generated, now)
    due = token_deadline(first_token_due(arrival, grace, ttft), tpot, generated)
    assert due == pytest.approx(now + ttft, abs=1e-6 * max(1.0, now))


def _wire_request(view: RequestView, grace_s: float) -> InferenceRequest:
    return InferenceRequest(view.request_id, "t", view.model, list(range(view.input_len)),
                            view.max_tokens, view.arrival, view.slo.ttft_s, view.slo.tpot_s,
                            grace_s=grace_s)


def test_the_cold_start_grace_survives_the_wire():
    """A node admits a request with a cold start's load as its grace; the request, moved on (to
    the request stream, another node, a placer), carries it, and whoever reads it judges the
    same deadline the admitting node did."""
    spec = model("m")
    sched = node("n0", Hardware.GPU, 80, perf_for(flat_profile("m", Hardware.GPU, load_s=3.0)))
    req = request("r", "m", input_len=100, arrival=10.0, ttft=1.0)
    res = sched.admit(req, None, spec, 10.0)
    assert res.admission.ok and res.admission.grace_s == pytest.approx(3.0)
    admitted = sched.node.instance(res.instance_id).requests[0]
    sent = _wire_request(req, res.admission.grace_s)
    received = wire.decode(InferenceRequest, wire.encode(sent))
    assert received.grace_s == res.admission.grace_s
    view = request_view(received)
    assert view.deadline() == admitted.deadline() == pytest.approx(14.0)
    # Without it the moved request would look a load's time later than it is.
    assert request_view(replace(received, grace_s=0.0)).deadline() == pytest.approx(11.0)


def test_shadow_refuses_a_target_that_can_never_run():
    profile = flat_profile("m", Hardware.GPU)
    never = InstanceView("i", model("m"), "n0", InstanceStatus.LOADING, ready_at=math.inf)
    verdict = shadow_validate([never], {"i": profile}, "i", request("r", ttft=5.0), 0.0, 0.0,
                              CoreConfig())
    assert verdict is AdmitReason.NEVER_READY


def test_shadow_still_admits_a_target_that_runs_late_but_in_time():
    profile = flat_profile("m", Hardware.GPU)
    late = InstanceView("i", model("m"), "n0", InstanceStatus.LOADING, ready_at=2.0)
    verdict = shadow_validate([late], {"i": profile}, "i", request("r", ttft=5.0), 0.0, 0.0,
                              CoreConfig())
    assert verdict is AdmitReason.ADMITTED

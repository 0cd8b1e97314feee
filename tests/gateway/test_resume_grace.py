"""The gateway's resumed request (services/gateway/backend.py) is judged by the core's Eq. 1 like
a new arrival for its next token: no servers, the pure part only."""

from __future__ import annotations

import pytest

from services.gateway.backend import resumed_request
from shared.cluster import request_view
from shared.core.types import first_token_due, resume_grace, token_deadline
from shared.schemas import InferenceRequest


def _request(arrival: float = 1000.0, grace_s: float = 0.0) -> InferenceRequest:
    return InferenceRequest("r", "t", "m", [1, 2, 3], 64, arrival, ttft_slo_s=2.0, tpot_slo_s=0.25,
                            grace_s=grace_s, target_node="n0", target_instance="i")


def test_a_resumed_requests_next_token_is_due_one_ttft_after_the_resume():
    req = _request()
    output = [7] * 10
    now = 1030.0  # its node died; 30 s lost, far past its tokens' deadlines
    resumed = resumed_request(req, output, 1, now)
    assert resumed.grace_s == resume_grace(req.arrival, req.tpot_slo_s, len(output), now)
    assert resumed.attempt == 1 and resumed.resumed_token_ids == output
    assert resumed.target_node is None and resumed.target_instance is None
    view = request_view(resumed)  # what the placer and the node judge it by
    assert view.generated == len(output)
    assert view.deadline() == pytest.approx(now + req.ttft_slo_s)
    assert view.deadline() == token_deadline(
        first_token_due(req.arrival, resumed.grace_s, req.ttft_slo_s), req.tpot_slo_s, len(output))


def test_a_resume_never_shortens_the_grace_it_had():
    req = _request(grace_s=50.0)  # a long cold start's grace, resumed soon after
    resumed = resumed_request(req, [7], 2, 1001.0)
    assert resumed.grace_s == 50.0

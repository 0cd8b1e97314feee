"""bench/path_split.py's cut of one request's time to first token, on a hand-made trace."""

from __future__ import annotations

import pytest

from bench.path_split import PARTS, split

MS = 1_000_000  # ns


def span(service: str, name: str, start_ms: float, end_ms: float, kind: int = 1,
         attributes: dict | None = None, events=(), event_ms=()) -> dict:
    return {"service": service, "name": name, "start_ns": int(start_ms * MS),
            "end_ns": int(end_ms * MS), "kind": kind, "attributes": attributes or {},
            "events": [list(e) for e in events], "event_ns": [int(t * MS) for t in event_ms]}


def trace() -> list[dict]:
    return [
        span("slinfer-gateway", "POST /v1/completions", 1.0, 30.0, kind=2),
        span("slinfer-gateway", "text_completion m", 3.0, 29.0,
             attributes={"gen_ai.response.id": "r"}, events=[("first_token", {})], event_ms=[26.0]),
        span("slinfer-placer", "place m", 9.0, 12.0,
             attributes={"slinfer.placement.queued_s": 0.002}),
        span("slinfer-placer", "place m", 40.0, 41.0,  # a later decision (a retry): not the first
             attributes={"slinfer.placement.queued_s": 0.0}),
        span("slinfer-node", "node.request", 11.0, 29.0),
        span("slinfer-node", "node.prefill", 13.0, 25.0),
        span("slinfer-node", "node.decode", 25.0, 29.0),
    ]


def test_the_parts_follow_the_request_and_sum_to_its_ttft():
    parts = split(trace(), sent_ns=0, first_ns=int(27.5 * MS))
    assert list(parts) == list(PARTS)
    expected = {"http_in": 1.0, "gateway_in": 2.0, "to_placer": 4.0, "placer": 2.0,
                "to_node": 2.0, "node_admit": 2.0, "prefill": 12.0, "token_back": 1.0,
                "http_out": 1.5}
    assert parts == pytest.approx({k: v / 1e3 for k, v in expected.items()})
    assert sum(parts.values()) == pytest.approx(27.5e-3)


def test_a_request_the_gateway_sent_to_its_node_has_no_placer_parts():
    """The warm fast path: no placer span; the gateway's admit command is the hop to the node."""
    spans = [s for s in trace() if s["service"] != "slinfer-placer"]
    parts = split(spans, sent_ns=0, first_ns=int(27.5 * MS))
    assert parts["to_placer"] == parts["placer"] == 0.0
    assert parts["to_node"] == pytest.approx(8.0e-3)  # request span start (3) -> node (11)
    assert sum(parts.values()) == pytest.approx(27.5e-3)


def test_a_trace_without_a_service_span_is_refused_by_name():
    spans = [s for s in trace() if s["service"] != "slinfer-node"]
    with pytest.raises(ValueError, match="slinfer-node"):
        split(spans, 0, 1)

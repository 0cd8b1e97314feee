"""One request's telemetry at the gateway: its GenAI span (`chat <model>` / `text_completion
<model>`, child of the HTTP server span, parent of everything the placer and node do for it) and
its metrics (TTFT, TPOT, duration, SLO met / violated / dropped), recorded when it ends."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from shared import telemetry as tm
from shared.schemas import InferenceRequest

if TYPE_CHECKING:
    from services.gateway.generation import Generation

_tracer = trace.get_tracer("slinfer.gateway")


class RequestObserver:
    """Created before the request is published (its span is the context the publish carries);
    `first_token` and `finished` are called by the `Generation`."""

    def __init__(self, metrics: tm.GenAIMetrics, request: InferenceRequest, operation: str) -> None:
        self.metrics = metrics
        self.request = request
        self.operation = operation
        self.started = time.monotonic()
        self.span = _tracer.start_span(f"{operation} {request.model}", attributes={
            tm.OPERATION: operation, tm.MODEL: request.model, tm.MAX_TOKENS: request.max_tokens,
            tm.INPUT_TOKENS: len(request.prompt_token_ids), "gen_ai.response.id": request.request_id,
            "slinfer.request_id": request.request_id, "slinfer.slo.ttft_s": request.ttft_slo_s,
            "slinfer.slo.tpot_s": request.tpot_slo_s})
        self._first: float | None = None

    def first_token(self, at: float) -> None:
        self._first = at
        ttft = at - self.started
        self.metrics.first_token(self.request.model, self.operation, ttft)
        self.span.add_event("first_token", {"slinfer.ttft_s": ttft})

    def finished(self, gen: Generation, node_headers: dict[str, str] | None,
                 prefill_s: float | None) -> None:
        end = time.monotonic()
        duration = end - self.started
        tokens = gen.completion_tokens
        ttft = None if self._first is None else self._first - self.started
        tpot = (end - self._first) / (tokens - 1) if self._first is not None and tokens > 1 else None
        error = gen.failure if gen.finish_reason is None else None
        violated = None
        if error is None and ttft is not None:
            violated = tm.slo_violation(ttft, tpot, self.request.ttft_slo_s, self.request.tpot_slo_s)
        self.metrics.finished(self.request.model, self.operation, duration, tpot, violated, error)
        span = self.span
        if not span.is_recording():
            span.end()
            return
        span.set_attribute(tm.OUTPUT_TOKENS, tokens)
        span.set_attribute(tm.FINISH_REASONS, [gen.finish_reason or error or "unknown"])
        span.set_attribute("gen_ai.response.model", self.request.model)
        if ttft is not None:
            span.set_attribute("slinfer.ttft_s", ttft)
        if tpot is not None:
            span.set_attribute("slinfer.tpot_s", tpot)
        if violated is not None:
            span.set_attribute("slinfer.slo.violated", violated)
        if prefill_s is not None:
            span.set_attribute("slinfer.engine.prefill_s", prefill_s)
        if node_headers:  # the node span that produced the tokens
            remote = trace.get_current_span(tm.extract_context(node_headers)).get_span_context()
            if remote.is_valid:
                span.add_link(remote, {"slinfer.link": "token_stream"})
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, gen.failure_detail or error))
        span.end()

    def failed_to_submit(self, exc: Exception) -> None:
        self.metrics.finished(self.request.model, self.operation, time.monotonic() - self.started,
                              None, None, "backend_unavailable")
        self.span.record_exception(exc)
        self.span.set_attribute("error.type", "backend_unavailable")
        self.span.set_status(Status(StatusCode.ERROR, str(exc)))
        self.span.end()


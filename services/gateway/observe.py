"""The gateway's telemetry: the HTTP server span of each request (`ServerSpanMiddleware`, tracing
on only), and one request's GenAI span (`chat <model>` / `text_completion <model>`, child of the
server span, parent of everything the placer and node do for it) and metrics (TTFT, TPOT,
duration, SLO met / violated / dropped, token usage in total and per tenant, and vLLM's names
for the same: shared/vllm_metrics.py), recorded when it ends.

Only what must precede the first token is done before it: starting the spans, bare (the request
span's context rides the request message). Attributes, the first-token event and every metric are
written when the request ends."""

from __future__ import annotations

import time
from typing import Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import telemetry as tm
from shared import vllm_metrics
from shared.schemas import InferenceRequest


class GenerationResult(Protocol):
    """What the observer reads of a finished generation (`generation.Generation` has it): the
    observer sits below the generation, which calls it, so it names only these fields."""

    completion_tokens: int
    finish_reason: str | None  # None: it ended without output, see `failure`
    failure: str | None
    failure_detail: str | None


_tracer = trace.get_tracer("slinfer.gateway")

HTTP_DURATION = "http.server.request.duration"
HTTP_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class ServerSpanMiddleware:
    """Pure ASGI: a SERVER span for each HTTP request except `excluded` paths, current while the
    app runs, named `<METHOD> <route>` once the router has matched, with the stable HTTP semantic
    convention attributes; `http.server.request.duration` recorded after the response.

    In place of FastAPI's OpenTelemetry instrumentation, which does more before the first byte
    of every request: it matches the route itself up front, parses and redacts the URL, sniffs
    the user agent, keeps an active-requests counter and wraps each sent chunk (four extra ASGI
    layers). Here the request costs one bare `start_span` before the app runs; its attributes and
    the metric are written when the response has ended."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer, meter=None,
                 excluded: tuple[str, ...] = ("/health", "/metrics")) -> None:
        self.app = app
        self.tracer = tracer
        self.excluded = frozenset(excluded)
        self.fields = frozenset(f.encode("latin-1") for f in propagate.get_global_textmap().fields)
        self.duration = None if meter is None else meter.create_histogram(
            HTTP_DURATION, unit="s", description="Duration of HTTP server requests",
            explicit_bucket_boundaries_advisory=HTTP_DURATION_BUCKETS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.excluded:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope["method"]
        parent = None
        for name, _ in scope["headers"]:
            if name in self.fields:  # the caller's trace (the global propagator's headers): continue it
                parent = propagate.extract({k.decode("latin-1"): v.decode("latin-1")
                                            for k, v in scope["headers"]})
                break
        span = self.tracer.start_span(method, context=parent, kind=SpanKind.SERVER)
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span, parent))
        error: Exception | None = None
        try:
            await self.app(scope, receive, send_status)
        except Exception as exc:
            error = exc
            raise
        finally:
            otel_context.detach(token)
            self._end(span, scope, method, status, error, started)

    def _end(self, span: trace.Span, scope: Scope, method: str, status: int, error: Exception | None,
             started: float) -> None:
        if error is not None and not status:
            status = 500  # what the outer ServerErrorMiddleware answers
        route = getattr(scope.get("route"), "path", None)
        metric = {"http.request.method": method, "url.scheme": scope.get("scheme", "http")}
        if status:
            metric["http.response.status_code"] = status
        if route:
            metric["http.route"] = route
            span.update_name(f"{method} {route}")
        if span.is_recording():
            attrs = {**metric, "url.path": scope["path"]}
            server, client = scope.get("server"), scope.get("client")
            if server:
                attrs["server.address"] = server[0]
                if server[1] is not None:
                    attrs["server.port"] = server[1]
            if client:
                attrs["client.address"] = client[0]
            if status >= 500:
                attrs["error.type"] = type(error).__qualname__ if error is not None else str(status)
                span.set_status(Status(StatusCode.ERROR, repr(error) if error is not None else None))
            if error is not None:
                span.record_exception(error)
            span.set_attributes(attrs)
        span.end()
        if self.duration is not None:
            self.duration.record(time.perf_counter() - started, metric)


class RequestObserver:
    """Created before the request is published (its span's context rides the request message's
    headers: `headers`); `first_token` and `finished` are called by the `Generation`. Before the
    first token it only starts the span and notes the time; attributes, the `first_token` event
    and the metrics are written when the request ends."""

    def __init__(self, metrics: tm.GenAIMetrics, request: InferenceRequest, operation: str,
                 counts_prompt: bool = True) -> None:
        self.metrics = metrics
        self.request = request
        self.operation = operation
        # A response's usage counts its prompt once: the first of its n choices counts it.
        self.counts_prompt = counts_prompt
        self.started = time.monotonic()
        self.span = _tracer.start_span(f"{operation} {request.model}")  # attributes: at the end
        self._first: float | None = None
        self._last: float | None = None  # the latest token message's arrival
        self._gaps: list[float] = []  # per later token message: its gap / its tokens

    def _request_attributes(self) -> dict:
        request = self.request
        return {tm.OPERATION: self.operation, tm.MODEL: request.model, tm.PROVIDER: tm.PROVIDER_NAME,
                tm.MAX_TOKENS: request.max_tokens,
                tm.INPUT_TOKENS: len(request.prompt_token_ids), "gen_ai.response.id": request.request_id,
                "slinfer.request_id": request.request_id, "slinfer.slo.ttft_s": request.ttft_slo_s,
                "slinfer.slo.tpot_s": request.tpot_slo_s}

    @property
    def headers(self) -> dict[str, str]:
        """W3C trace context with this request's span as the parent (empty with tracing off)."""
        return tm.span_context_headers(self.span)

    def first_token(self, at: float) -> None:
        """`at`: time.monotonic() of the first token. Nothing else happens here: it is on the
        request's time to first token."""
        self._first = self._last = at

    def tokens(self, at: float, count: int) -> None:
        """A token message after the first arrived at `at` (time.monotonic()) with `count`
        tokens: its gap is kept for the inter-token latency, recorded when the request ends."""
        if self._last is not None and count:
            self._gaps.append((at - self._last) / count)
        self._last = at

    def finished(self, gen: GenerationResult, node_headers: dict[str, str] | None,
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
        if ttft is not None:
            self.metrics.first_token(self.request.model, self.operation, ttft)
        self.metrics.finished(self.request.model, self.operation, duration, tpot, violated, error)
        self._record_tokens(gen, ttft, tpot, duration)
        span = self.span
        if not span.is_recording():
            span.end()
            return
        attrs = {**self._request_attributes(), tm.OUTPUT_TOKENS: tokens,
                 tm.FINISH_REASONS: [gen.finish_reason or error or "unknown"],
                 "gen_ai.response.model": self.request.model}
        if ttft is not None:
            attrs["slinfer.ttft_s"] = ttft
            span.add_event("first_token", {"slinfer.ttft_s": ttft},
                           timestamp=time.time_ns() - int((end - self._first) * 1e9))
        if tpot is not None:
            attrs["slinfer.tpot_s"] = tpot
        if violated is not None:
            attrs["slinfer.slo.violated"] = violated
        if prefill_s is not None:
            attrs["slinfer.engine.prefill_s"] = prefill_s
        if error is not None:
            attrs["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, gen.failure_detail or error))
        span.set_attributes(attrs)
        if node_headers:  # the node span that produced the tokens
            remote = trace.get_current_span(tm.extract_context(node_headers)).get_span_context()
            if remote.is_valid:
                span.add_link(remote, {"slinfer.link": "token_stream"})
        span.end()

    def _record_tokens(self, gen: GenerationResult, ttft: float | None, tpot: float | None,
                       duration: float) -> None:
        """Token usage (GenAI, per tenant) and vLLM's request metrics. The prompt counts once
        its prefill ran (a first token came), the output as the tokens that came."""
        request = self.request
        prompt = len(request.prompt_token_ids) if ttft is not None else 0
        tokens = gen.completion_tokens
        if ttft is not None or tokens:
            self.metrics.usage(request.model, self.operation, request.tenant,
                               prompt if self.counts_prompt else None, tokens)
        reason = gen.finish_reason or ("abort" if gen.failure == "cancelled" else None)
        self.metrics.vllm.record(vllm_metrics.RequestRecord(
            request.model, prompt, tokens, ttft, tpot, duration, reason, tuple(self._gaps)))

    def failed_to_submit(self, exc: Exception) -> None:
        self.metrics.finished(self.request.model, self.operation, time.monotonic() - self.started,
                              None, None, "backend_unavailable")
        self.span.record_exception(exc)
        self.span.set_attributes({**self._request_attributes(), "error.type": "backend_unavailable"})
        self.span.set_status(Status(StatusCode.ERROR, str(exc)))
        self.span.end()

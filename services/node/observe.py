"""The node worker's telemetry: spans of each request on the node, of commands and memory
operations, and the node's gauges (read by /metrics on SLINFER_NODE_METRICS_PORT and by OTLP).

Spans (all children of the placer's decision through the command's NATS headers):
  node.command admit|preempt   the admission re-check and its answer (the core's AdmitReason)
  node.request                 admission to final token; GenAI usage and finish reason
    node.queue                 admission to its first iteration (includes a cold start's load)
    node.prefill               the prefill iteration
    node.decode                first to last decode iteration, iterations counted (no per-token span)
  node.memop load|scale|unload issue to completion: bytes, run time, time parked in the
                               reservation station (a child of whatever was current when it started)

With tracing off every hook returns at once; the gauges read a snapshot taken by the heartbeat.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared import telemetry as tm
from shared.core.iteration import IterationChoice, IterationKind
from shared.core.memory import MemOp
from shared.schemas import InferenceRequest, MemOpCompletion

if TYPE_CHECKING:
    from services.node.worker import NodeWorker

log = logging.getLogger("slinfer.node")
_tracer = trace.get_tracer("slinfer.node")
RATE_WINDOW_S = 5.0


class RequestSpans:
    """The spans of one request on this node."""

    def __init__(self, request: InferenceRequest, instance_id: str, node_id: str, cold: bool) -> None:
        self.admitted_ns = time.time_ns()
        self.span = _tracer.start_span("node.request", attributes={
            tm.MODEL: request.model, tm.MAX_TOKENS: request.max_tokens,
            tm.INPUT_TOKENS: len(request.prompt_token_ids), "slinfer.request_id": request.request_id,
            "slinfer.node_id": node_id, "slinfer.instance_id": instance_id,
            "slinfer.resumed_tokens": len(request.resumed_token_ids), "slinfer.cold_start": cold})
        self.context = trace.set_span_in_context(self.span)
        self.headers = tm.span_context_headers(self.span)  # on every token message, computed once
        self.prefill: trace.Span | None = None
        self.decode: trace.Span | None = None
        self.decode_iterations = 0
        self.max_batch = 0
        self.queued = False  # the queue span has been written

    def _end_queue(self, now_ns: int) -> None:
        if not self.queued:
            self.queued = True
            _tracer.start_span("node.queue", context=self.context, start_time=self.admitted_ns
                               ).end(end_time=now_ns)

    def prefill_started(self, input_tokens: int) -> None:
        now = time.time_ns()
        self._end_queue(now)
        self.prefill = _tracer.start_span("node.prefill", context=self.context, start_time=now,
                                          attributes={"slinfer.prefill.tokens": input_tokens})

    def prefill_done(self, seconds: float, error: str | None = None) -> None:
        if self.prefill is None:
            return
        self.prefill.set_attribute("slinfer.prefill.engine_s", seconds)
        if error:
            self.prefill.set_status(Status(StatusCode.ERROR, error))
        self.prefill.end()
        self.prefill = None

    def decode_iteration(self, started_ns: int, batch: int) -> None:
        if self.decode is None:
            self._end_queue(started_ns)
            self.decode = _tracer.start_span("node.decode", context=self.context, start_time=started_ns)
        self.decode_iterations += 1
        self.max_batch = max(self.max_batch, batch)

    def end(self, outcome: str, output_tokens: int, error: str | None = None) -> None:
        if self.prefill is not None:
            self.prefill_done(0.0, error or outcome)
        if self.decode is not None:
            self.decode.set_attribute("slinfer.decode.iterations", self.decode_iterations)
            self.decode.set_attribute("slinfer.decode.max_batch", self.max_batch)
            self.decode.end()
        span = self.span
        span.set_attribute(tm.OUTPUT_TOKENS, output_tokens)
        span.set_attribute(tm.FINISH_REASONS, [outcome])
        span.set_attribute("slinfer.decode.iterations", self.decode_iterations)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


class NodeObserver:
    def __init__(self, telemetry: tm.Telemetry, node_id: str, hardware: str) -> None:
        self.tel = telemetry
        self.tracing = telemetry.tracing
        self.node_id = node_id
        self.hardware = hardware
        self.requests: dict[str, RequestSpans] = {}
        self._stats = tm.NodeStats()
        self._samples: deque[tuple[float, int]] = deque()
        self._server = None

    # --- lifecycle and gauges ---------------------------------------------------------------
    async def start(self, worker: NodeWorker, metrics_port: int) -> None:
        self.sample(worker)
        tm.register_node_gauges(self.tel.meter("slinfer.node"),
                                {"slinfer.node_id": self.node_id, "slinfer.hardware": self.hardware},
                                lambda: self._stats)
        if metrics_port:
            self._server = await tm.serve_metrics(self.tel, "0.0.0.0", metrics_port)
            log.info("node %s: Prometheus metrics on :%d/metrics", self.node_id, metrics_port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for spans in list(self.requests.values()):
            spans.end("error", 0, "node shutting down")
        self.requests.clear()

    def sample(self, worker: NodeWorker) -> None:
        """Snapshot the node for the gauges (on the event loop; readers may be other threads)."""
        now = time.monotonic()
        self._samples.append((now, worker.iterations))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        rate = (worker.iterations - n0) / (now - t0) if now > t0 else 0.0
        node, ledger = worker.sched.node, worker.sched.ledger
        self._stats = tm.NodeStats(
            memory_capacity=node.memory_bytes, memory_budget=ledger.budget,
            memory_pessimistic=ledger.pessimistic, kv_allocated=sum(i.kv_bytes for i in node.instances),
            parked_ops=len(ledger.parked()), running_ops=len(ledger.running()),
            instances=len(node.instances), requests=len(worker.live), iterations=worker.iterations,
            iterations_per_s=rate)

    # --- commands ---------------------------------------------------------------------------
    @contextmanager
    def command(self, headers: dict[str, str] | None):
        """The span of one placer command, current while it is handled."""
        if not self.tracing:
            yield None
            return
        span = _tracer.start_span("node.command", context=tm.extract_context(headers),
                                  kind=SpanKind.SERVER, attributes={"slinfer.node_id": self.node_id})
        with trace.use_span(span, end_on_exit=True):
            yield span

    @staticmethod
    def command_result(span, kind: str, accepted: bool, reason: str, instance_id: str | None) -> None:
        if span is None or not span.is_recording():
            return
        span.update_name(f"node.command {kind}")
        span.set_attribute("slinfer.command", kind)
        span.set_attribute("slinfer.node.accepted", accepted)
        span.set_attribute("slinfer.admit_reason", reason)
        if instance_id:
            span.set_attribute("slinfer.instance_id", instance_id)

    # --- requests ---------------------------------------------------------------------------
    def admitted(self, request: InferenceRequest, instance_id: str, cold: bool) -> None:
        if self.tracing:
            self.requests[request.request_id] = RequestSpans(request, instance_id, self.node_id, cold)

    def use(self, request_id: str):
        """Make the request's node span current (log lines then carry its ids)."""
        spans = self.requests.get(request_id) if self.tracing else None
        return trace.use_span(spans.span, end_on_exit=False) if spans is not None else nullcontext()

    def headers(self, request_id: str) -> dict[str, str] | None:
        spans = self.requests.get(request_id)
        return spans.headers if spans is not None and spans.headers else None

    def iteration_started(self, choice: IterationChoice, context_tokens: int) -> None:
        if not self.tracing:
            return
        if choice.kind is IterationKind.PREFILL:
            spans = self.requests.get(choice.request_ids[0])
            if spans is not None:
                spans.prefill_started(context_tokens)
            return
        now, batch = time.time_ns(), len(choice.request_ids)
        for rid in choice.request_ids:
            spans = self.requests.get(rid)
            if spans is not None:
                spans.decode_iteration(now, batch)

    def prefill_done(self, request_id: str, seconds: float, error: str | None = None) -> None:
        spans = self.requests.get(request_id) if self.tracing else None
        if spans is not None:
            spans.prefill_done(seconds, error)

    def event(self, request_id: str, name: str, **attributes) -> None:
        spans = self.requests.get(request_id) if self.tracing else None
        if spans is not None:
            spans.span.add_event(name, attributes)

    def ended(self, request_id: str, outcome: str, output_tokens: int, error: str | None = None) -> None:
        spans = self.requests.pop(request_id, None) if self.tracing else None
        if spans is not None:
            spans.end(outcome, output_tokens, error)

    # --- memory operations ------------------------------------------------------------------
    def memop_done(self, op: MemOp, done: MemOpCompletion) -> None:
        """A span from the op's issue to its completion (parked time, then the run)."""
        if not self.tracing:
            return
        span = _tracer.start_span(f"node.memop {op.kind.value}", start_time=tm.seconds_to_ns(op.issued_at),
                                  attributes={
                                      "slinfer.memop.kind": op.kind.value,
                                      "slinfer.memop.op_id": op.op_id,
                                      "slinfer.instance_id": op.instance_id,
                                      "slinfer.node_id": self.node_id,
                                      "slinfer.memop.bytes_before": op.bytes_before,
                                      "slinfer.memop.bytes_after": op.bytes_after,
                                      "slinfer.memop.bytes": op.bytes_after - op.bytes_before,
                                      "slinfer.memop.parked_s": done.parked_s,
                                      "slinfer.memop.duration_s": done.finished - done.started})
        span.add_event("started", timestamp=tm.seconds_to_ns(done.started))
        if not done.ok:
            span.set_status(Status(StatusCode.ERROR, done.error or "failed"))
        span.end(end_time=tm.seconds_to_ns(done.finished))

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

Between admission and the first token message a request costs one span start (`node.request`,
whose context the token messages carry): queue, prefill and decode are timestamps, written as
spans with those times after the first token went out or when the request ends. The trace context
rides only the first and the final token message.

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
    """The spans of one request on this node. Only `node.request` is a live span (its context is
    the token messages' parent); queue, prefill and decode are timestamps until written, so the
    work between admission and the first token message is one `start_span`. `flush()` writes the
    queue and prefill spans (after the first token message went out), `end()` whatever is left."""

    __slots__ = ("request", "instance_id", "node_id", "cold", "admitted_ns", "span", "headers",
                 "headers_sent", "queue_end_ns", "prefill_tokens", "prefill_start_ns", "prefill_end_ns",
                 "prefill_s", "prefill_written", "decode_start_ns", "decode_iterations", "max_batch")

    def __init__(self, request: InferenceRequest, instance_id: str, node_id: str, cold: bool) -> None:
        self.request, self.instance_id, self.node_id, self.cold = request, instance_id, node_id, cold
        self.admitted_ns = time.time_ns()
        self.span = _tracer.start_span("node.request", start_time=self.admitted_ns)  # attributes: at end
        self.headers = tm.span_context_headers(self.span)  # computed once
        self.headers_sent = False  # on the first token message (and the final one)
        self.queue_end_ns: int | None = None
        self.prefill_tokens = 0
        self.prefill_start_ns: int | None = None
        self.prefill_end_ns: int | None = None
        self.prefill_s: float | None = None
        self.prefill_written = False
        self.decode_start_ns: int | None = None
        self.decode_iterations = 0
        self.max_batch = 0

    def prefill_started(self, input_tokens: int) -> None:
        now = time.time_ns()
        if self.queue_end_ns is None:
            self.queue_end_ns = now
        self.prefill_start_ns, self.prefill_tokens = now, input_tokens

    def prefill_done(self, seconds: float) -> None:
        if self.prefill_start_ns is not None and self.prefill_end_ns is None:
            self.prefill_end_ns, self.prefill_s = time.time_ns(), seconds

    def decode_iteration(self, started_ns: int, batch: int) -> None:
        if self.decode_start_ns is None:
            self.decode_start_ns = started_ns
            if self.queue_end_ns is None:
                self.queue_end_ns = started_ns
        self.decode_iterations += 1
        if batch > self.max_batch:
            self.max_batch = batch

    def flush(self, error: str | None = None) -> None:
        """Write the queue and prefill spans once the prefill has ended (or the request did)."""
        if self.prefill_written or (self.prefill_end_ns is None and error is None):
            return
        self.prefill_written = True
        context = trace.set_span_in_context(self.span)
        if self.queue_end_ns is not None:
            _tracer.start_span("node.queue", context=context, start_time=self.admitted_ns
                               ).end(end_time=self.queue_end_ns)
        if self.prefill_start_ns is None:
            return
        end_ns = self.prefill_end_ns or time.time_ns()
        prefill = _tracer.start_span("node.prefill", context=context, start_time=self.prefill_start_ns,
                                     attributes={"slinfer.prefill.tokens": self.prefill_tokens,
                                                 "slinfer.prefill.engine_s": self.prefill_s or 0.0})
        if self.prefill_end_ns is None:
            prefill.set_status(Status(StatusCode.ERROR, error))
        prefill.end(end_time=end_ns)

    def end(self, outcome: str, output_tokens: int, error: str | None = None) -> None:
        self.flush(error or outcome)
        now = time.time_ns()
        if self.decode_start_ns is not None:
            _tracer.start_span("node.decode", context=trace.set_span_in_context(self.span),
                               start_time=self.decode_start_ns, attributes={
                                   "slinfer.decode.iterations": self.decode_iterations,
                                   "slinfer.decode.max_batch": self.max_batch}).end(end_time=now)
        span, request = self.span, self.request
        span.set_attributes({
            tm.MODEL: request.model, tm.MAX_TOKENS: request.max_tokens,
            tm.INPUT_TOKENS: len(request.prompt_token_ids), "slinfer.request_id": request.request_id,
            "slinfer.node_id": self.node_id, "slinfer.instance_id": self.instance_id,
            "slinfer.resumed_tokens": len(request.resumed_token_ids), "slinfer.cold_start": self.cold,
            tm.OUTPUT_TOKENS: output_tokens, tm.FINISH_REASONS: [outcome],
            "slinfer.decode.iterations": self.decode_iterations})
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=now)


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
        span = _tracer.start_span("node.command", context=tm.extract_context(headers), kind=SpanKind.SERVER)
        with trace.use_span(span, end_on_exit=True):
            yield span

    def command_result(self, span, kind: str, accepted: bool, reason: str, instance_id: str | None) -> None:
        if span is None or not span.is_recording():
            return
        span.update_name(f"node.command {kind}")
        attrs = {"slinfer.command": kind, "slinfer.node.accepted": accepted, "slinfer.admit_reason": reason,
                 "slinfer.node_id": self.node_id}
        if instance_id:
            attrs["slinfer.instance_id"] = instance_id
        span.set_attributes(attrs)

    # --- requests ---------------------------------------------------------------------------
    def admitted(self, request: InferenceRequest, instance_id: str, cold: bool) -> None:
        if self.tracing:
            self.requests[request.request_id] = RequestSpans(request, instance_id, self.node_id, cold)

    def use(self, request_id: str):
        """Make the request's node span current (log lines then carry its ids)."""
        spans = self.requests.get(request_id) if self.tracing else None
        return trace.use_span(spans.span, end_on_exit=False) if spans is not None else nullcontext()

    def headers(self, request_id: str) -> dict[str, str] | None:
        """The request's trace context (its node span as the parent), e.g. to hand it back."""
        spans = self.requests.get(request_id)
        return spans.headers if spans is not None and spans.headers else None

    def message_headers(self, request_id: str, final: bool) -> dict[str, str] | None:
        """Headers for a token message: the trace context on the request's first message and its
        final one (the gateway links the first it sees), none on the messages between."""
        spans = self.requests.get(request_id)
        if spans is None or not spans.headers or (spans.headers_sent and not final):
            return None
        spans.headers_sent = True
        return spans.headers

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

    def prefill_done(self, request_id: str, seconds: float) -> None:
        """The prefill's engine time (a timestamp: its span is written by `flush`)."""
        spans = self.requests.get(request_id) if self.tracing else None
        if spans is not None:
            spans.prefill_done(seconds)

    def flush(self, request_id: str) -> None:
        """Write the request's queue and prefill spans; call after its first token went out."""
        spans = self.requests.get(request_id) if self.tracing else None
        if spans is not None:
            spans.flush()

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

"""The node worker's telemetry: spans of each request on the node, of commands and memory
operations, and the node's gauges (read by /metrics on SLINFER_NODE_METRICS_PORT and by OTLP).

Spans (all children of the placer's decision through the command's NATS headers):
  node.command admit|preempt   the admission re-check and its answer (the core's AdmitReason)
  node.request                 admission to final token; GenAI usage and finish reason
    node.queue                 admission to its first iteration (includes a cold start's load)
    node.prefill               the prefill iteration
    node.decode                first to last decode iteration, iterations counted (no per-token span)
  node.memop load|scale|unload issue to completion: bytes, run time, time parked in the
                               reservation station (a child of the command that started it, if any)

Every span here is written after the fact, from timestamps: handling a command and running a
request to its first token create none. A command's span is written once the request it admitted
ends (or a memory operation it started completes, or right away if it admitted nothing), the
request's spans when it ends; the trace context rides the request's second and final token
messages only (a request the gateway ends at its first token has no link to its node span).

With tracing off every hook returns at once; the gauges read a snapshot taken by the heartbeat.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared import telemetry as tm
from shared import vllm_metrics
from shared.core.iteration import IterationChoice, IterationKind
from shared.core.memory import MemOp
from shared.schemas import InferenceRequest, MemOpCompletion

if TYPE_CHECKING:
    from services.node.load_record import LoadRecord
    from shared.core.node_scheduler import NodeScheduler

log = logging.getLogger("slinfer.node")
_tracer = trace.get_tracer("slinfer.node")
RATE_WINDOW_S = 5.0


class CommandSpan:
    """One placer command's span (`node.command <kind>`, a SERVER span under the placer's decision),
    written after the fact: handling the command only notes its times, its outcome and the
    caller's headers. It is written when something needs its context (the request it admitted
    ends, a memory operation it started completes, a log line inside it) or, if nothing took it
    over, when the command is done."""

    __slots__ = ("headers", "node_id", "start_ns", "end_ns", "name", "attrs", "error", "adopted",
                 "_span")

    def __init__(self, headers: dict[str, str] | None, node_id: str) -> None:
        self.headers, self.node_id = headers, node_id
        self.start_ns, self.end_ns = time.time_ns(), None
        self.name = "node.command"
        self.attrs: dict = {"slinfer.node_id": node_id}
        self.error: str | None = None
        self.adopted = False  # a request span took it as parent and writes it at the latest
        self._span: trace.Span | None = None

    def result(self, kind: str, accepted: bool, reason: str, instance_id: str | None) -> None:
        self.name = f"node.command {kind}"
        self.attrs.update({"slinfer.command": kind, "slinfer.node.accepted": accepted,
                           "slinfer.admit_reason": reason})
        if instance_id:
            self.attrs["slinfer.instance_id"] = instance_id

    def span(self) -> trace.Span:
        if self._span is None:
            self._span = _tracer.start_span(self.name, context=tm.extract_context(self.headers),
                                            kind=SpanKind.SERVER, start_time=self.start_ns)
            if self.end_ns is not None:
                self._end()
        return self._span

    def close(self, error: str | None = None) -> None:
        self.end_ns, self.error = time.time_ns(), error
        if self._span is not None:
            self._end()
        elif not self.adopted:
            self.span()

    def _end(self) -> None:
        span = self._span
        span.update_name(self.name)
        span.set_attributes(self.attrs)
        if self.error:
            span.set_status(Status(StatusCode.ERROR, self.error))
        span.end(end_time=self.end_ns)


# The command being handled: memory operations it starts (their tasks copy the context) and the
# requests it admits take it as their span's parent.
_COMMAND: ContextVar[CommandSpan | None] = ContextVar("slinfer_node_command", default=None)


class RequestSpans:
    """The spans of one request on this node, all written after the fact: until then they are
    timestamps. `node.request` (child of the admitting command) is written when its context is
    first needed (the second token message carries it; a hand-back, a log line) or at the end;
    queue, prefill and decode at the end. Between admission and the first token nothing is
    written at all."""

    __slots__ = ("request", "instance_id", "node_id", "cold", "command", "admitted_ns", "_span",
                 "_headers", "messages", "queue_end_ns", "prefill_tokens", "prefill_start_ns", "prefill_end_ns",
                 "prefill_s", "decode_start_ns", "decode_iterations", "max_batch",
                 "prefill_predicted_s", "decode_error_sum")

    def __init__(self, request: InferenceRequest, instance_id: str, node_id: str, cold: bool,
                 command: CommandSpan | None) -> None:
        self.request, self.instance_id, self.node_id, self.cold = request, instance_id, node_id, cold
        self.command = command
        if command is not None:
            command.adopted = True
        self.admitted_ns = time.time_ns()
        self._span: trace.Span | None = None
        self._headers: dict[str, str] | None = None
        self.messages = 0  # token messages sent
        self.queue_end_ns: int | None = None
        self.prefill_tokens = 0
        self.prefill_start_ns: int | None = None
        self.prefill_end_ns: int | None = None
        self.prefill_s: float | None = None
        self.decode_start_ns: int | None = None
        self.decode_iterations = 0
        self.max_batch = 0
        self.prefill_predicted_s: float | None = None  # what the node decided with
        self.decode_error_sum = 0.0  # relative errors of its decode iterations, summed

    @property
    def span(self) -> trace.Span:
        if self._span is None:
            parent = (trace.set_span_in_context(self.command.span()) if self.command is not None
                      else None)
            self._span = _tracer.start_span("node.request", context=parent, start_time=self.admitted_ns)
        return self._span

    @property
    def headers(self) -> dict[str, str]:
        """Trace context with `node.request` as the parent (written now if it was not yet)."""
        if self._headers is None:
            self._headers = tm.span_context_headers(self.span)
        return self._headers

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

    def end(self, outcome: str, output_tokens: int, error: str | None = None) -> None:
        now = time.time_ns()
        span, request = self.span, self.request
        context = trace.set_span_in_context(span)
        if self.queue_end_ns is not None:
            _tracer.start_span("node.queue", context=context, start_time=self.admitted_ns
                               ).end(end_time=self.queue_end_ns)
        if self.prefill_start_ns is not None:
            attributes = {"slinfer.prefill.tokens": self.prefill_tokens,
                          "slinfer.prefill.engine_s": self.prefill_s or 0.0}
            if self.prefill_predicted_s and self.prefill_s:
                attributes["slinfer.prefill.predicted_s"] = self.prefill_predicted_s
                attributes["slinfer.prediction_error"] = self.prefill_s / self.prefill_predicted_s - 1
            prefill = _tracer.start_span("node.prefill", context=context, start_time=self.prefill_start_ns,
                                         attributes=attributes)
            if self.prefill_end_ns is None:  # the request ended inside its prefill
                prefill.set_status(Status(StatusCode.ERROR, error or outcome))
            prefill.end(end_time=self.prefill_end_ns or now)
        if self.decode_start_ns is not None:
            _tracer.start_span("node.decode", context=context, start_time=self.decode_start_ns, attributes={
                "slinfer.decode.iterations": self.decode_iterations,
                "slinfer.decode.max_batch": self.max_batch,
                "slinfer.prediction_error": self.decode_error_sum / max(1, self.decode_iterations),
            }).end(end_time=now)
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
        # A ratio, not ratio - 1: OpenTelemetry histograms take only non-negative values.
        self._prediction_ratio = telemetry.meter("slinfer.node").create_histogram(
            tm.NODE_PREDICTION_RATIO, unit="1",
            description="Iteration time vs the profile's prediction: actual / predicted",
            explicit_bucket_boundaries_advisory=[0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25,
                                                 1.5, 2.0, 3.0, 6.0])
        meter = telemetry.meter("slinfer.node")
        self._load_s = meter.create_histogram(
            tm.NODE_LOAD_DURATION, unit="s", description="A model's whole load on the node "
            "(engine and checkpoint), by the checkpoint tier that served it",
            explicit_bucket_boundaries_advisory=list(tm.LOAD_BUCKETS))
        self._loader_s = meter.create_histogram(
            tm.NODE_LOADER_DURATION, unit="s", description="The checkpoint loader's part of a "
            "load (reading the checkpoint into the engine), by tier",
            explicit_bucket_boundaries_advisory=list(tm.LOAD_BUCKETS))
        self._loader_bytes = meter.create_counter(
            tm.NODE_LOADER_BYTES, unit="By", description="Checkpoint bytes the loader moved, by tier")
        self._server = None

    # --- lifecycle and gauges ---------------------------------------------------------------
    async def start(self, metrics_port: int, host: str = "127.0.0.1") -> None:
        """Serve the gauges (`sample` them first) and, with a port, Prometheus metrics."""
        tm.register_node_gauges(self.tel.meter("slinfer.node"),
                                {"slinfer.node_id": self.node_id, "slinfer.hardware": self.hardware},
                                lambda: self._stats)
        if metrics_port:
            self._server = await tm.serve_metrics(self.tel, host, metrics_port)
            log.info("node %s: Prometheus metrics on %s:%d/metrics", self.node_id, host,
                     metrics_port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for spans in list(self.requests.values()):
            spans.end("error", 0, "node shutting down")
        self.requests.clear()

    def sample(self, sched: NodeScheduler, requests: int, iterations: int) -> None:
        """Snapshot the node for the gauges (on the event loop; readers may be other threads)."""
        now = time.monotonic()
        self._samples.append((now, iterations))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        rate = (iterations - n0) / (now - t0) if now > t0 else 0.0
        node, ledger = sched.node, sched.ledger
        self._stats = tm.NodeStats(
            memory_capacity=node.memory_bytes, memory_budget=ledger.budget,
            memory_pessimistic=ledger.pessimistic, kv_allocated=sum(i.kv_bytes for i in node.instances),
            parked_ops=len(ledger.parked()), running_ops=len(ledger.running()),
            instances=len(node.instances), requests=requests, iterations=iterations,
            iterations_per_s=rate, models=vllm_metrics.model_loads(node, sched.kv_capacity_bytes))

    # --- commands ---------------------------------------------------------------------------
    @contextmanager
    def command(self, headers: dict[str, str] | None):
        """One placer command being handled: yields its `CommandSpan` (None with tracing off),
        which requests admitted and memory operations started meanwhile take as their parent."""
        if not self.tracing:
            yield None
            return
        command = CommandSpan(headers, self.node_id)
        token = _COMMAND.set(command)
        error = None
        try:
            yield command
        except BaseException as exc:
            error = repr(exc)
            raise
        finally:
            _COMMAND.reset(token)
            command.close(error)

    @staticmethod
    def command_result(command: CommandSpan | None, kind: str, accepted: bool, reason: str,
                       instance_id: str | None) -> None:
        if command is not None:
            command.result(kind, accepted, reason, instance_id)

    @staticmethod
    def use_command(command: CommandSpan | None):
        """Make the command's span current (a log line inside it then carries its ids)."""
        return trace.use_span(command.span(), end_on_exit=False) if command is not None else nullcontext()

    # --- requests ---------------------------------------------------------------------------
    def admitted(self, request: InferenceRequest, instance_id: str, cold: bool) -> None:
        if self.tracing:
            self.requests[request.request_id] = RequestSpans(request, instance_id, self.node_id, cold,
                                                             _COMMAND.get())

    def use(self, request_id: str):
        """Make the request's node span current (log lines then carry its ids)."""
        spans = self.requests.get(request_id) if self.tracing else None
        return trace.use_span(spans.span, end_on_exit=False) if spans is not None else nullcontext()

    def headers(self, request_id: str) -> dict[str, str] | None:
        """The request's trace context (its node span as the parent), e.g. to hand it back."""
        spans = self.requests.get(request_id) if self.tracing else None
        return (spans.headers or None) if spans is not None else None

    def message_headers(self, request_id: str, final: bool) -> dict[str, str] | None:
        """Headers for a token message: the trace context (the gateway links the node span from
        the first message that has it) on the request's second message and its final one; none
        on its first, which is on the way to the first token, nor on the ones between."""
        spans = self.requests.get(request_id) if self.tracing else None
        if spans is None:
            return None
        spans.messages += 1
        return (spans.headers or None) if final or spans.messages == 2 else None

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
        """The prefill's engine time (a timestamp: its span is written when the request ends)."""
        spans = self.requests.get(request_id) if self.tracing else None
        if spans is not None:
            spans.prefill_done(seconds)

    def prediction(self, model: str, kind: str, predicted_s: float, actual_s: float) -> None:
        """One iteration's time against the prediction the node decided with: a metric."""
        self._prediction_ratio.record(actual_s / predicted_s,
                                      {tm.MODEL: model, "slinfer.iteration.kind": kind,
                                       "slinfer.node_id": self.node_id})

    def prediction_on_spans(self, kind: str, request_ids: tuple[str, ...], predicted_s: float,
                            actual_s: float) -> None:
        """The same, an attribute of each request's prefill / decode span (before any of them
        ends with this iteration's token)."""
        if not self.tracing:
            return
        error = actual_s / predicted_s - 1
        for rid in request_ids:
            spans = self.requests.get(rid)
            if spans is None:
                continue
            if kind == "prefill":
                spans.prefill_predicted_s = predicted_s
            else:
                spans.decode_error_sum += error

    def event(self, request_id: str, name: str, **attributes) -> None:
        spans = self.requests.get(request_id) if self.tracing else None
        if spans is not None:
            spans.span.add_event(name, attributes)

    def ended(self, request_id: str, outcome: str, output_tokens: int, error: str | None = None) -> None:
        spans = self.requests.pop(request_id, None) if self.tracing else None
        if spans is not None:
            spans.end(outcome, output_tokens, error)

    # --- loads ------------------------------------------------------------------------------
    def load_done(self, load: LoadRecord) -> None:
        """A model's load ended (from the load thread: the SDK's instruments are thread-safe).
        `slinfer.load.tier` is the checkpoint tier the node's loader served it from, or
        `engine` for an engine that reads its own files (OpenVINO, vLLM), `unknown` for a load
        that failed before the loader said."""
        tier = load.tier or ("engine" if load.ok else "unknown")
        attrs = {"slinfer.node_id": self.node_id, tm.MODEL: load.model, "slinfer.load.tier": tier}
        if load.seconds is not None:
            self._load_s.record(load.seconds, {**attrs, "slinfer.load.ok": bool(load.ok)})
        if load.ok and load.loader_seconds is not None:
            self._loader_s.record(load.loader_seconds, attrs)
        if load.ok and load.bytes:
            self._loader_bytes.add(load.bytes, {"slinfer.node_id": self.node_id,
                                                "slinfer.load.tier": tier})

    # --- memory operations ------------------------------------------------------------------
    def memop_done(self, op: MemOp, done: MemOpCompletion) -> None:
        """A span from the op's issue to its completion (parked time, then the run)."""
        if not self.tracing:
            return
        command = _COMMAND.get()  # the command that started it, if one did (the task's context)
        parent = trace.set_span_in_context(command.span()) if command is not None else None
        span = _tracer.start_span(f"node.memop {op.kind.value}", context=parent,
                                  start_time=tm.seconds_to_ns(op.issued_at), attributes={
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

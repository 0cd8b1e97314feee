"""Traces, metrics and logs for every slinfer service, set up in one place from the standard
OpenTelemetry environment variables.

    OTEL_SERVICE_NAME            default slinfer-<service> (gateway, placer, node, ...)
    OTEL_TRACES_EXPORTER         otlp | console | none. Unset: otlp when an OTLP endpoint is set,
                                 else none (nothing configured = nothing exported)
    OTEL_METRICS_EXPORTER        otlp | console | prometheus | none, same default. /metrics is
                                 served either way (gateway route, node SLINFER_NODE_METRICS_PORT)
    OTEL_EXPORTER_OTLP_ENDPOINT  e.g. http://127.0.0.1:4318 (the exporters append /v1/traces ...)
    OTEL_EXPORTER_OTLP_PROTOCOL  http/protobuf (the default; grpc needs its exporter installed)
    OTEL_TRACES_SAMPLER(_ARG)    read by the SDK (default parentbased_always_on)
    OTEL_SDK_DISABLED=true       everything off
    SLINFER_LOG_FORMAT           json (default: one JSON object a line, with trace_id and span_id
                                 inside a request) | text

With tracing off no SDK tracer provider is installed: every span is the API's no-op span and the
NATS header helpers add nothing. Metrics always run on an SDK meter provider, read on demand by
the Prometheus endpoint (nothing is exported unless an OTLP reader is configured).

Trace context crosses NATS in message headers (W3C `traceparent`/`tracestate`, always: it is the
services' own wire format, whatever OTEL_PROPAGATORS says), written with `inject_headers` and read
with `extract_context` on the request stream, node commands, token messages and re-published
(evicted or preempted) requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shared import vllm_metrics

log = logging.getLogger("slinfer.telemetry")

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# --- metric names (OpenTelemetry names; Prometheus shows dots as underscores plus a unit suffix) --
TTFT = "gen_ai.server.time_to_first_token"  # histogram, s, by model and operation
TPOT = "gen_ai.server.time_per_output_token"  # histogram, s
REQUEST_DURATION = "gen_ai.server.request.duration"  # histogram, s (error.type on failures)
SLO_MET = "slinfer.requests.slo_met"  # counter, by model
SLO_VIOLATED = "slinfer.requests.slo_violated"  # counter, by model and which SLO (ttft | tpot)
DROPPED = "slinfer.requests.dropped"  # counter, by model: queueing alone would break the TTFT SLO
NODE_MEMORY_CAPACITY = "slinfer.node.memory.capacity"  # gauge, By
NODE_MEMORY_BUDGET = "slinfer.node.memory.budget"  # gauge, By: optimistic budget in use
NODE_MEMORY_PESSIMISTIC = "slinfer.node.memory.pessimistic"  # gauge, By
NODE_KV_ALLOCATED = "slinfer.node.kv.allocated"  # gauge, By: KV cache of all instances
NODE_PARKED_OPS = "slinfer.node.memops.parked"  # gauge: scale-ups waiting in the reservation station
NODE_RUNNING_OPS = "slinfer.node.memops.running"  # gauge
NODE_INSTANCES = "slinfer.node.instances"  # gauge
NODE_REQUESTS = "slinfer.node.requests"  # gauge: requests the node owns
NODE_ITERATIONS_RATE = "slinfer.node.iterations_per_second"  # gauge, over the last ~5 s
NODE_ITERATIONS = "slinfer.node.iterations"  # counter
PLACER_DECISIONS = "slinfer.placer.decisions"  # counter, by action
# counter, by outcome (admitted | refused | silent): the gateway's warm fast path
GATEWAY_DIRECT_ADMISSIONS = "slinfer.gateway.direct_admissions"
NODE_PREDICTION_RATIO = "slinfer.node.prediction_ratio"  # histogram: actual / predicted (1 = exact)
# A model's load on a node (ServerlessLLM §4), by the checkpoint tier that served it: the engine's
# whole load, the checkpoint loader's part of it, and the bytes the loader moved.
NODE_LOAD_DURATION = "slinfer.node.load.duration"  # histogram, s, by tier, model, outcome
NODE_LOADER_DURATION = "slinfer.node.loader.duration"  # histogram, s, by tier and model
NODE_LOADER_BYTES = "slinfer.node.loader.bytes"  # counter, By, by tier
TOKEN_USAGE = "gen_ai.client.token.usage"  # histogram, {token}, by gen_ai.token.type (GenAI semconv)
TENANT_TOKENS = "slinfer.tenant.tokens"  # counter, {token}, by tenant, model and token type

# Bucket boundaries the GenAI semantic conventions recommend.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)

# The GenAI conventions' buckets for token counts: powers of 4 from 1 to 4^13.
TOKEN_BUCKETS = tuple(4 ** i for i in range(14))

# GenAI attribute keys used on spans and metrics.
PROVIDER = "gen_ai.provider.name"
PROVIDER_NAME = "slinfer"
TOKEN_TYPE = "gen_ai.token.type"  # input | output
TENANT = "slinfer.tenant"
OPERATION = "gen_ai.operation.name"
MODEL = "gen_ai.request.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"


# --- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str
    traces: tuple[str, ...] = ()  # exporters: "otlp", "console"
    metrics: tuple[str, ...] = ()  # OTLP-side metric exporters: "otlp", "console"
    log_format: str = "json"  # json | text

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] | None = None) -> TelemetryConfig:
        env = os.environ if env is None else env

        def get(name: str) -> str:
            return (env.get(name) or "").strip()

        log_format = (get("SLINFER_LOG_FORMAT") or "json").lower()
        if log_format not in ("json", "text"):
            raise ValueError(f"SLINFER_LOG_FORMAT must be json or text, got {log_format!r}")
        name = get("OTEL_SERVICE_NAME") or f"slinfer-{service}"
        if get("OTEL_SDK_DISABLED").lower() == "true":
            return cls(name, log_format=log_format)
        endpoint = bool(get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        traces = _exporters("OTEL_TRACES_EXPORTER", get("OTEL_TRACES_EXPORTER"),
                            endpoint or bool(get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")),
                            ("otlp", "console"))
        metrics = _exporters("OTEL_METRICS_EXPORTER", get("OTEL_METRICS_EXPORTER"),
                             endpoint or bool(get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")),
                             ("otlp", "console", "prometheus"))
        for signal, chosen in (("TRACES", traces), ("METRICS", metrics)):
            if "otlp" in chosen:
                protocol = (get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
                            or get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
                if protocol not in ("http/protobuf", "grpc"):
                    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf or grpc, "
                                     f"got {protocol!r}")
                if protocol == "grpc":
                    raise ValueError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc: the gRPC exporter is not "
                                     "installed; use http/protobuf (port 4318)")
        return cls(name, traces, tuple(m for m in metrics if m != "prometheus"), log_format)


def _exporters(var: str, raw: str, endpoint_set: bool, known: tuple[str, ...]) -> tuple[str, ...]:
    if not raw:
        return ("otlp",) if endpoint_set else ()
    names = tuple(n.strip().lower() for n in raw.split(",") if n.strip())
    for n in names:
        if n != "none" and n not in known:
            raise ValueError(f"{var} must be a list of {', '.join(known)} or none, got {n!r}")
    return () if "none" in names else names


# --- the running telemetry of one process -------------------------------------------------------
@dataclass
class Telemetry:
    config: TelemetryConfig
    meter_provider: MeterProvider
    registry: CollectorRegistry  # Prometheus exposition of every metric of this process
    tracer_provider: object | None = None  # the SDK TracerProvider when traces are exported
    exporters: list[str] = field(default_factory=list)  # what was created, e.g. ["otlp traces"]

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def meter(self, name: str):
        return self.meter_provider.get_meter(name)

    def tracer(self, name: str) -> trace.Tracer:
        if self.tracer_provider is not None:
            return self.tracer_provider.get_tracer(name)
        return trace.get_tracer(name)

    def metrics_text(self) -> bytes:
        """The Prometheus text exposition of this process's metrics (collected now)."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Flush and stop exporters (spans still buffered are sent)."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup(service: str, *, env: Mapping[str, str] | None = None, level: str | int = "INFO",
          install_global: bool = True, configure_logging: bool = True) -> Telemetry:
    """Read the environment once and set up logs, traces and metrics for `service`.

    Raises ValueError naming the variable on a bad value. `install_global` makes the tracer
    provider the process's global one (what `trace.get_tracer` and the instrumentations use)."""
    config = TelemetryConfig.from_env(service, env)
    if configure_logging:
        configure_logs(config.log_format, level, config.service_name)
    return build(config, install_global=install_global)


def local(service: str) -> Telemetry:
    """Metrics for /metrics only; no tracing, no exporter, no logging changes (tests, defaults)."""
    return build(TelemetryConfig(f"slinfer-{service}"), install_global=False)


def build(config: TelemetryConfig, *, install_global: bool = True) -> Telemetry:
    resource = Resource.create({"service.name": config.service_name,
                                "service.namespace": "slinfer"})
    exporters: list[str] = []
    readers: list[MetricReader] = []
    for name in config.metrics:
        readers.append(PeriodicExportingMetricReader(_metric_exporter(name)))
        exporters.append(f"{name} metrics")
    pull = _PullReader()
    meter_provider = MeterProvider(resource=resource, metric_readers=[pull, *readers])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_PrometheusBridge(pull))
    ProcessCollector(registry=registry)

    tracer_provider = None
    if config.traces:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=resource)  # reads OTEL_TRACES_SAMPLER itself
        for name in config.traces:
            tracer_provider.add_span_processor(BatchSpanProcessor(_span_exporter(name)))
            exporters.append(f"{name} traces")
        if install_global:
            trace.set_tracer_provider(tracer_provider)
    return Telemetry(config, meter_provider, registry, tracer_provider, exporters)


def _span_exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression from OTEL_EXPORTER_OTLP_*


def _metric_exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()


# --- W3C trace context in NATS headers --------------------------------------------------------
# The NATS hops are the services' own wire format: always W3C trace context, through
# OpenTelemetry's trace-context propagator used directly rather than the global one, whose
# composite (trace context + baggage) costs several times more on every hop of a request.
# Baggage does not cross NATS.
_W3C = TraceContextTextMapPropagator()


class _HeaderGetter(Getter[Mapping[str, str]]):
    """NATS headers are a plain dict; match names case-insensitively (a proxy may recase them)."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            value = next((v for k, v in carrier.items() if k.lower() == key), None)
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier)


_GETTER = _HeaderGetter()


def inject_headers(headers: dict[str, str] | None = None,
                   context: Context | None = None) -> dict[str, str]:
    """`headers` (a new dict when None) plus `traceparent`/`tracestate` of `context` (default:
    the current one). Adds nothing when there is no valid span, e.g. with tracing off."""
    carrier = {} if headers is None else headers
    _W3C.inject(carrier, context)
    return carrier


def extract_context(*carriers: Mapping[str, str] | None) -> Context:
    """The remote span context in the first carrier (NATS headers, or a message's
    `trace_context`) that holds a valid one, as a parent context; an empty context if none."""
    for carrier in carriers:
        if carrier:
            context = _W3C.extract(carrier, Context(), getter=_GETTER)
            if trace.get_current_span(context).get_span_context().is_valid:
                return context
    return Context()


def span_context_headers(span: trace.Span) -> dict[str, str]:
    """Headers carrying `span` as the parent: computed once, reused on every message of a request."""
    return inject_headers({}, trace.set_span_in_context(span))


def seconds_to_ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


# --- logs -----------------------------------------------------------------------------------------
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class TraceContextFilter(logging.Filter):
    """Puts the current span's ids on the record (`trace_id`, `span_id`; empty outside a span)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = format(ctx.trace_id, "032x")
            record.span_id = format(ctx.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, message, service, trace_id/span_id (inside a
    span), exception, and any `extra={...}` fields."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage(),
               "service": self.service}
        trace_id = getattr(record, "trace_id", "")
        if trace_id:
            out["trace_id"], out["span_id"] = trace_id, record.span_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in ("trace_id", "span_id") and key not in out:
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class CurrentStderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever `sys.stderr` is when a record is emitted, not to the
    stream it was when the handler was made: a process that swaps stderr (pytest's capture, a
    daemon redirecting it) must not leave the root logger writing to a closed file."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler's would pin a stream

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def configure_logs(log_format: str, level: str | int, service: str) -> None:
    """Replace the root logger's handlers with one stderr handler in the chosen format."""
    handler = CurrentStderrHandler()
    handler.addFilter(TraceContextFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


# --- metrics: the gateway's GenAI histograms and SLO counters ------------------------------------
class GenAIMetrics:
    """What the gateway records once per finished request."""

    def __init__(self, meter) -> None:
        self.ttft = meter.create_histogram(TTFT, unit="s", description="Time to first token",
                                           explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = meter.create_histogram(TPOT, unit="s", description="Time per output token "
                                           "after the first", explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = meter.create_histogram(REQUEST_DURATION, unit="s",
                                               description="Request duration, submission to last token",
                                               explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.slo_met = meter.create_counter(SLO_MET, unit="{request}",
                                            description="Requests that met their TTFT and TPOT SLOs")
        self.slo_violated = meter.create_counter(SLO_VIOLATED, unit="{request}",
                                                 description="Requests that missed an SLO")
        self.dropped = meter.create_counter(DROPPED, unit="{request}",
                                            description="Requests dropped: queueing alone would "
                                            "break the TTFT SLO")
        self.token_usage = meter.create_histogram(TOKEN_USAGE, unit="{token}",
                                                  description="Tokens a request used, input and output",
                                                  explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.tenant_tokens = meter.create_counter(TENANT_TOKENS, unit="{token}",
                                                  description="Tokens used, by tenant")
        self.vllm = vllm_metrics.VllmRequestMetrics(meter)

    def first_token(self, model: str, operation: str, ttft_s: float) -> None:
        self.ttft.record(ttft_s, {MODEL: model, OPERATION: operation})

    def finished(self, model: str, operation: str, duration_s: float, tpot_s: float | None,
                 violated: str | None, error_type: str | None) -> None:
        """`violated`: None = met, "ttft" or "tpot"; only for requests that completed."""
        attrs = {MODEL: model, OPERATION: operation}
        if tpot_s is not None:
            self.tpot.record(tpot_s, attrs)
        self.duration.record(duration_s, attrs if error_type is None else {**attrs, "error.type": error_type})
        if error_type == "dropped":
            self.dropped.add(1, {MODEL: model})
        elif error_type is None:
            if violated is None:
                self.slo_met.add(1, {MODEL: model})
            else:
                self.slo_violated.add(1, {MODEL: model, "slinfer.slo": violated})


    def usage(self, model: str, operation: str, tenant: str, input_tokens: int | None,
              output_tokens: int) -> None:
        """Tokens a request used, as its response's usage counts them. `input_tokens` None: not
        counted on this request (another choice of the same response counts the prompt)."""
        attrs = {MODEL: model, OPERATION: operation, PROVIDER: PROVIDER_NAME}
        tenant_attrs = {TENANT: tenant, MODEL: model}
        for kind, tokens in (("input", input_tokens), ("output", output_tokens)):
            if tokens is None:
                continue
            self.token_usage.record(tokens, {**attrs, TOKEN_TYPE: kind})
            if tokens:
                self.tenant_tokens.add(tokens, {**tenant_attrs, TOKEN_TYPE: kind})


def slo_violation(ttft_s: float, tpot_s: float | None, ttft_slo_s: float, tpot_slo_s: float) -> str | None:
    """Which SLO a completed request missed (mean TPOT, as the paper counts it), or None."""
    if ttft_s > ttft_slo_s:
        return "ttft"
    if tpot_s is not None and tpot_s > tpot_slo_s:
        return "tpot"
    return None


# --- metrics: a node's gauges -----------------------------------------------------------------
@dataclass(frozen=True)
class NodeStats:
    """A snapshot of one node, taken on the event loop (the gauges read it from any thread)."""

    memory_capacity: int = 0
    memory_budget: int = 0
    memory_pessimistic: int = 0
    kv_allocated: int = 0
    parked_ops: int = 0
    running_ops: int = 0
    instances: int = 0
    requests: int = 0
    iterations: int = 0
    iterations_per_s: float = 0.0
    models: tuple[vllm_metrics.ModelLoad, ...] = ()  # per model: vLLM's running/waiting/KV gauges


def register_node_gauges(meter, attributes: Mapping[str, str], stats: Callable[[], NodeStats]) -> None:
    from opentelemetry.metrics import Observation

    attrs = dict(attributes)

    def gauge(name: str, unit: str, description: str, read: Callable[[NodeStats], float]) -> None:
        meter.create_observable_gauge(name, [lambda _opts: [Observation(read(stats()), attrs)]],
                                      unit=unit, description=description)

    gauge(NODE_MEMORY_CAPACITY, "By", "Memory the node's subsystem may hand out", lambda s: s.memory_capacity)
    gauge(NODE_MEMORY_BUDGET, "By", "Optimistic memory budget in use", lambda s: s.memory_budget)
    gauge(NODE_MEMORY_PESSIMISTIC, "By", "Pessimistic memory usage", lambda s: s.memory_pessimistic)
    gauge(NODE_KV_ALLOCATED, "By", "KV-cache bytes of all instances", lambda s: s.kv_allocated)
    gauge(NODE_PARKED_OPS, "{operation}", "Memory operations parked in the reservation station",
          lambda s: s.parked_ops)
    gauge(NODE_RUNNING_OPS, "{operation}", "Memory operations running", lambda s: s.running_ops)
    gauge(NODE_INSTANCES, "{instance}", "Model instances on the node", lambda s: s.instances)
    gauge(NODE_REQUESTS, "{request}", "Requests the node owns", lambda s: s.requests)
    gauge(NODE_ITERATIONS_RATE, "{iteration}/s", "Engine iterations per second (last ~5 s)",
          lambda s: s.iterations_per_s)
    meter.create_observable_counter(
        NODE_ITERATIONS, [lambda _opts: [Observation(stats().iterations, attrs)]],
        unit="{iteration}", description="Engine iterations run")
    vllm_metrics.register_node_gauges(meter, attrs.get("slinfer.node_id", ""), lambda: stats().models)


# --- Prometheus: an on-demand reader of the SDK's metrics --------------------------------------
class _PullReader(MetricReader):
    """Collects only when asked (a scrape); cumulative, like Prometheus wants."""

    def __init__(self) -> None:
        super().__init__()
        self._data: MetricsData | None = None

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
                         **kwargs) -> None:
        self._data = metrics_data

    def pull(self) -> MetricsData | None:
        self._data = None
        self.collect()
        return self._data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


_UNIT_SUFFIX = {"s": "seconds", "ms": "milliseconds", "By": "bytes"}


def prometheus_name(name: str, unit: str) -> str:
    """`gen_ai.server.time_to_first_token` + `s` -> `gen_ai_server_time_to_first_token_seconds`;
    `vllm.<name>` -> `vllm:<name>` (vLLM's own names, which OpenTelemetry's cannot spell)."""
    base = vllm_metrics.prometheus_base(name) or "".join(
        c if c.isalnum() or c in "_:" else "_" for c in name)
    suffix = _UNIT_SUFFIX.get(unit, "")
    if unit.endswith("/s"):
        suffix = "per_second" if not base.endswith("per_second") else ""
    return f"{base}_{suffix}" if suffix and not base.endswith(suffix) else base


def _label(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)


def _label_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class _PrometheusBridge:
    """A prometheus_client collector that turns the SDK's metrics into metric families."""

    def __init__(self, reader: _PullReader) -> None:
        self.reader = reader

    def collect(self) -> Iterable:
        data = self.reader.pull()
        if data is None:
            return
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    family = self._family(metric)
                    if family is not None:
                        yield family

    @staticmethod
    def _family(metric):
        name = prometheus_name(metric.name, metric.unit or "")
        points = list(metric.data.data_points)
        keys = sorted({k for p in points for k in p.attributes})
        labels = [_label(k) for k in keys]

        def values(p) -> list[str]:
            return [_label_value(p.attributes.get(k, "")) for k in keys]

        doc = metric.description or metric.name
        if isinstance(metric.data, Histogram):
            fam = HistogramMetricFamily(name, doc, labels=labels)
            for p in points:
                running, buckets = 0, []
                for bound, count in zip(p.explicit_bounds, p.bucket_counts):
                    running += count
                    buckets.append((repr(float(bound)), running))
                buckets.append(("+Inf", p.count))
                fam.add_metric(values(p), buckets, p.sum)
            return fam
        if isinstance(metric.data, Sum) and metric.data.is_monotonic:
            fam = CounterMetricFamily(name, doc, labels=labels)
        elif isinstance(metric.data, (Sum, Gauge)):
            fam = GaugeMetricFamily(name, doc, labels=labels)
        else:
            return None
        for p in points:
            fam.add_metric(values(p), p.value)
        return fam


# --- a /metrics server for processes without a web framework (node workers) ---------------------
async def serve_metrics(telemetry: Telemetry, host: str, port: int) -> asyncio.AbstractServer:
    """GET /metrics over HTTP/1.1 on the running event loop (so collection reads the service's
    state on its own thread). One response per connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method == "GET" and path.split("?", 1)[0] == "/metrics":
                body, status, ctype = telemetry.metrics_text(), "200 OK", PROMETHEUS_CONTENT_TYPE
            else:
                body, status, ctype = b"not found\n", "404 Not Found", "text/plain"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: "
                         f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


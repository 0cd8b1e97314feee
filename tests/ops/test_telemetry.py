"""shared.telemetry on its own: configuration from OTEL_*, W3C trace context in NATS headers
(unit and through a real nats-server's JetStream), the Prometheus exposition, JSON logs."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
from dataclasses import dataclass

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared import telemetry as tm
from shared.schemas import InferenceRequest

OTLP = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "otlp"}


@pytest.fixture
def tracer() -> trace.Tracer:
    return TracerProvider().get_tracer("test")  # a real SDK tracer, not the global one


# --- configuration ------------------------------------------------------------------------------
def test_nothing_configured_creates_no_exporter_and_no_sdk_tracer(monkeypatch):
    for var in [v for v in os.environ if v.startswith("OTEL_")]:
        monkeypatch.delenv(var)

    def refuse(*args, **kwargs):
        raise AssertionError("an exporter was created with OTEL unset")

    import opentelemetry.exporter.otlp.proto.http.metric_exporter as metric_exporter
    import opentelemetry.exporter.otlp.proto.http.trace_exporter as trace_exporter

    monkeypatch.setattr(trace_exporter.OTLPSpanExporter, "__init__", refuse)
    monkeypatch.setattr(metric_exporter.OTLPMetricExporter, "__init__", refuse)
    tel = tm.setup("gateway", configure_logging=False)
    assert tel.exporters == [] and not tel.tracing and tel.tracer_provider is None
    assert tel.config.service_name == "slinfer-gateway"
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # the API's no-op/proxy
    span = tel.tracer("t").start_span("x")
    assert not span.is_recording()
    assert tm.inject_headers({"Nats-Msg-Id": "r"}) == {"Nats-Msg-Id": "r"}  # no traceparent
    assert b"process_cpu_seconds_total" in tel.metrics_text()  # /metrics still works
    tel.shutdown()


def test_an_endpoint_alone_turns_otlp_on_and_none_turns_it_off():
    tel = tm.setup("node", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
                   install_global=False, configure_logging=False)
    try:
        assert tel.exporters == ["otlp metrics", "otlp traces"] and tel.tracing
        span = tel.tracer("t").start_span("x")
        assert span.is_recording() and span.resource.attributes["service.name"] == "slinfer-node"
        span.end()
    finally:
        tel.shutdown()
    off = tm.TelemetryConfig.from_env("node", {**OTLP, "OTEL_TRACES_EXPORTER": "none",
                                               "OTEL_METRICS_EXPORTER": "prometheus"})
    assert off.traces == () and off.metrics == ()
    assert tm.TelemetryConfig.from_env("x", {**OTLP, "OTEL_SDK_DISABLED": "true"}).traces == ()
    named = tm.TelemetryConfig.from_env("x", {**OTLP, "OTEL_SERVICE_NAME": "edge-gw"})
    assert named.service_name == "edge-gw" and named.traces == ("otlp",)


@pytest.mark.parametrize("env, var", [
    ({**OTLP, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({**OTLP, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"SLINFER_LOG_FORMAT": "xml"}, "SLINFER_LOG_FORMAT"),
])
def test_bad_settings_name_the_variable(env, var):
    with pytest.raises(ValueError, match=var):
        tm.TelemetryConfig.from_env("gateway", env)


# --- trace context in NATS headers -----------------------------------------------------------
def test_inject_then_extract_gives_the_same_span_as_remote_parent(tracer):
    span = tracer.start_span("parent")
    headers = tm.inject_headers({"Nats-Msg-Id": "r1"}, trace.set_span_in_context(span))
    sc = span.get_span_context()
    assert headers["Nats-Msg-Id"] == "r1"
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{sc.trace_id:032x}", f"{sc.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    remote = trace.get_current_span(tm.extract_context(headers)).get_span_context()
    assert remote.is_valid and remote.is_remote
    assert (remote.trace_id, remote.span_id) == (sc.trace_id, sc.span_id)
    child = tracer.start_span("child", context=tm.extract_context(headers))
    assert child.parent.span_id == sc.span_id and child.get_span_context().trace_id == sc.trace_id


def test_span_context_headers_carry_the_span_and_tracestate(tracer):
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    sc = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1),
                     trace_state=TraceState([("vendor", "v1")]))
    headers = tm.span_context_headers(NonRecordingSpan(sc))
    assert headers["traceparent"] == f"00-{0xABC:032x}-{0xDEF:016x}-01"
    assert headers["tracestate"] == "vendor=v1"
    back = trace.get_current_span(tm.extract_context(headers)).get_span_context()
    assert back.trace_state.get("vendor") == "v1"
    assert tm.span_context_headers(trace.INVALID_SPAN) == {}


def test_extract_is_case_insensitive_and_falls_back_to_the_next_carrier(tracer):
    span = tracer.start_span("p")
    tp = tm.inject_headers(context=trace.set_span_in_context(span))["traceparent"]
    assert trace.get_current_span(tm.extract_context({"TraceParent": tp})).get_span_context().is_valid
    ctx = tm.extract_context({"Nats-Msg-Id": "x"}, {"traceparent": tp})  # headers lack it: the body's
    assert trace.get_current_span(ctx).get_span_context().span_id == span.get_span_context().span_id
    for bad in (None, {}, {"traceparent": "00-zz-yy-01"}, {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"}):
        assert not trace.get_current_span(tm.extract_context(bad)).get_span_context().is_valid


async def test_trace_context_crosses_a_real_jetstream_stream_and_request_reply(nats_url, tracer):
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="OPS_TEST", subjects=["ops.test"])
        span = tracer.start_span("publish")
        await js.publish("ops.test", b"x", headers=tm.inject_headers(
            {"Nats-Msg-Id": "m1"}, trace.set_span_in_context(span)))
        sub = await js.pull_subscribe("ops.test", durable="ops")
        msg = (await sub.fetch(1, timeout=5))[0]
        got = trace.get_current_span(tm.extract_context(msg.headers)).get_span_context()
        assert (got.trace_id, got.span_id) == (span.get_span_context().trace_id,
                                               span.get_span_context().span_id)

        async def responder(m) -> None:  # like a node: extract, then answer
            ctx = trace.get_current_span(tm.extract_context(m.headers)).get_span_context()
            await m.respond(f"{ctx.span_id:016x}".encode())

        await nc.subscribe("ops.cmd", cb=responder)
        reply = await nc.request("ops.cmd", b"", timeout=5,
                                 headers=tm.inject_headers(context=trace.set_span_in_context(span)))
        assert reply.data.decode() == f"{span.get_span_context().span_id:016x}"
    finally:
        await nc.close()


# --- metrics -------------------------------------------------------------------------------------
def test_prometheus_exposition_of_histograms_counters_and_gauges():
    tel = tm.local("gateway")
    metrics = tm.GenAIMetrics(tel.meter("t"))
    for ttft in (0.003, 0.03, 0.3):
        metrics.first_token("m", "chat", ttft)
    metrics.finished("m", "chat", 1.0, 0.05, None, None)
    metrics.finished("m", "chat", 1.0, 0.5, "tpot", None)
    metrics.finished("m", "chat", 0.1, None, None, "dropped")
    tm.register_node_gauges(tel.meter("n"), {"slinfer.node_id": "n0"},
                            lambda: tm.NodeStats(memory_budget=123, parked_ops=2, iterations_per_s=7.5))
    text = tel.metrics_text().decode()

    def value(pattern: str) -> float:
        m = re.search(rf"^{pattern} (\S+)$", text, re.M)
        assert m, pattern
        return float(m.group(1))

    lbl = r'\{gen_ai_operation_name="chat",gen_ai_request_model="m"'
    assert value(rf'gen_ai_server_time_to_first_token_seconds_bucket{lbl},le="0.005"\}}') == 1
    assert value(rf'gen_ai_server_time_to_first_token_seconds_bucket{lbl},le="0.04"\}}') == 2  # cumulative
    assert value(rf'gen_ai_server_time_to_first_token_seconds_bucket{lbl},le="\+Inf"\}}') == 3
    assert value(rf'gen_ai_server_time_to_first_token_seconds_count{lbl}\}}') == 3
    assert value(rf'gen_ai_server_time_to_first_token_seconds_sum{lbl}\}}') == pytest.approx(0.333)
    assert value(r'slinfer_requests_slo_met_total\{gen_ai_request_model="m"\}') == 1
    assert value(r'slinfer_requests_slo_violated_total\{gen_ai_request_model="m",slinfer_slo="tpot"\}') == 1
    assert value(r'slinfer_requests_dropped_total\{gen_ai_request_model="m"\}') == 1
    assert value(r'slinfer_node_memory_budget_bytes\{slinfer_node_id="n0"\}') == 123
    assert value(r'slinfer_node_memops_parked\{slinfer_node_id="n0"\}') == 2
    assert value(r'slinfer_node_iterations_per_second\{slinfer_node_id="n0"\}') == 7.5


def test_node_loads_are_exported_by_tier():
    """The node's loads (NodeWorker.loads) as metrics: the whole load and the loader's part by
    the tier that served it, bytes per tier; an engine reading its own files is tier `engine`,
    a failed load is counted apart (tier `unknown`: the loader never said) and moves no bytes."""
    from services.node.observe import NodeObserver
    from services.node.load_record import LoadRecord

    tel = tm.local("node")
    obs = NodeObserver(tel, "n0", "cpu")
    obs.load_done(LoadRecord("i1", "m", 0.0, "registry", 1.0, tier="registry", seconds=2.0,
                             loader_seconds=1.5, bytes=1000, ok=True))
    obs.load_done(LoadRecord("i2", "m", 0.0, "dram", 0.1, tier="dram", seconds=0.2,
                             loader_seconds=0.05, bytes=1000, ok=True))
    obs.load_done(LoadRecord("i3", "m", 0.0, "dram", 0.1, tier="dram", seconds=0.3,
                             loader_seconds=0.1, bytes=1000, ok=True))
    obs.load_done(LoadRecord("i4", "o", 0.0, None, 3.0, seconds=4.0, ok=True))  # OpenVINO
    obs.load_done(LoadRecord("i5", "m", 0.0, "disk", 0.5, seconds=0.01, ok=False))
    text = tel.metrics_text().decode()

    def value(name: str, labels: str) -> float:
        m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
        assert m, (name, labels, text)
        return float(m.group(1))

    def load(model: str, ok: str, tier: str) -> str:
        return (f'gen_ai_request_model="{model}",slinfer_load_ok="{ok}",'
                f'slinfer_load_tier="{tier}",slinfer_node_id="n0"')

    assert value("slinfer_node_load_duration_seconds_count", load("m", "True", "dram")) == 2
    assert value("slinfer_node_load_duration_seconds_sum", load("m", "True", "dram")) == pytest.approx(0.5)
    assert value("slinfer_node_load_duration_seconds_sum", load("m", "True", "registry")) == 2.0
    assert value("slinfer_node_load_duration_seconds_bucket", load("m", "True", "dram").replace(
        "slinfer_load_ok", 'le="0.25",slinfer_load_ok')) == 1  # 0.2 s, not yet 0.3 s
    assert value("slinfer_node_load_duration_seconds_count", load("o", "True", "engine")) == 1
    assert value("slinfer_node_load_duration_seconds_count", load("m", "False", "unknown")) == 1
    loader = 'gen_ai_request_model="m",slinfer_load_tier="dram",slinfer_node_id="n0"'
    assert value("slinfer_node_loader_duration_seconds_sum", loader) == pytest.approx(0.15)
    assert value("slinfer_node_loader_bytes_total", 'slinfer_load_tier="dram",slinfer_node_id="n0"') == 2000
    assert value("slinfer_node_loader_bytes_total", 'slinfer_load_tier="registry",slinfer_node_id="n0"') == 1000
    assert "unknown" not in text.split("slinfer_node_loader_bytes_total")[-1]  # a failure moved nothing


def test_slo_violation_uses_ttft_then_mean_tpot():
    assert tm.slo_violation(0.4, 0.2, 0.5, 0.25) is None
    assert tm.slo_violation(0.6, 0.2, 0.5, 0.25) == "ttft"
    assert tm.slo_violation(0.4, 0.3, 0.5, 0.25) == "tpot"
    assert tm.slo_violation(0.4, None, 0.5, 0.25) is None  # one token: no TPOT


@pytest.mark.parametrize("name, unit, expected", [
    ("gen_ai.server.time_to_first_token", "s", "gen_ai_server_time_to_first_token_seconds"),
    ("slinfer.node.memory.budget", "By", "slinfer_node_memory_budget_bytes"),
    ("slinfer.node.iterations_per_second", "{iteration}/s", "slinfer_node_iterations_per_second"),
    ("slinfer.requests.dropped", "{request}", "slinfer_requests_dropped"),
    ("vllm.time_to_first_token", "s", "vllm:time_to_first_token_seconds"),
    ("vllm.num_requests_running", "{request}", "vllm:num_requests_running"),
    ("vllm.kv_cache_usage_perc", "1", "vllm:kv_cache_usage_perc"),
    ("gen_ai.client.token.usage", "{token}", "gen_ai_client_token_usage"),
])
def test_prometheus_names(name, unit, expected):
    assert tm.prometheus_name(name, unit) == expected


@dataclass
class _Ended:
    """A finished generation as the gateway's observer reads it (observe.GenerationResult)."""

    completion_tokens: int
    finish_reason: str | None
    failure: str | None = None
    failure_detail: str | None = None


def _request(rid: str, prompt: int) -> InferenceRequest:
    return InferenceRequest(request_id=rid, tenant="acme", model="m", prompt_token_ids=[1] * prompt,
                            max_tokens=16, arrival=0.0, ttft_slo_s=10.0, tpot_slo_s=10.0)


def test_request_observer_counts_usage_per_tenant_and_vllm_names():
    """Two choices of one response (7 prompt tokens; 3 and 2 tokens out) and a request the
    client cancelled after its first token: the usage counts the response's prompt once, vLLM's
    prompt counter each prefill; inter-token gaps are per token of each later message."""
    from services.gateway.observe import RequestObserver

    tel = tm.local("gateway")
    metrics = tm.GenAIMetrics(tel.meter("t"))
    first = RequestObserver(metrics, _request("r-0", 7), "chat")
    second = RequestObserver(metrics, _request("r-1", 7), "chat", counts_prompt=False)
    for obs, messages in ((first, (1, 2)), (second, (1, 1))):
        at = obs.started + 0.01
        obs.first_token(at)
        obs.tokens(at + 0.1 * messages[1], messages[1])  # 0.1 s per token
        obs.finished(_Ended(sum(messages), "stop"), None, None)
    cancelled = RequestObserver(metrics, _request("r-2", 4), "text_completion")
    cancelled.first_token(cancelled.started + 0.01)
    cancelled.finished(_Ended(1, None, "cancelled"), None, None)
    never = RequestObserver(metrics, _request("r-3", 9), "chat")  # ended before any token
    never.finished(_Ended(0, None, "timeout"), None, None)
    text = tel.metrics_text().decode()

    def value(name: str, labels: str) -> float:
        m = re.search(rf"^{re.escape(name)}\{{{labels}\}} (\S+)$", text, re.M)
        assert m, (name, labels, text)
        return float(m.group(1))

    assert value("vllm:prompt_tokens_total", 'model_name="m"') == 7 + 7 + 4
    assert value("vllm:generation_tokens_total", 'model_name="m"') == 3 + 2 + 1
    assert value("vllm:request_success_total", 'finished_reason="stop",model_name="m"') == 2
    assert value("vllm:request_success_total", 'finished_reason="abort",model_name="m"') == 1
    assert value("vllm:time_to_first_token_seconds_count", 'model_name="m"') == 3
    assert value("vllm:e2e_request_latency_seconds_count", 'model_name="m"') == 3
    assert value("vllm:inter_token_latency_seconds_count", 'model_name="m"') == 2
    assert value("vllm:inter_token_latency_seconds_sum", 'model_name="m"') == pytest.approx(0.2)
    assert value("slinfer_tenant_tokens_total", 'gen_ai_request_model="m",gen_ai_token_type="input",'
                 'slinfer_tenant="acme"') == 7 + 4
    assert value("slinfer_tenant_tokens_total", 'gen_ai_request_model="m",gen_ai_token_type="output",'
                 'slinfer_tenant="acme"') == 6
    usage = ('gen_ai_operation_name="chat",gen_ai_provider_name="slinfer",gen_ai_request_model="m",'
             'gen_ai_token_type="{}"')
    assert value("gen_ai_client_token_usage_count", usage.format("input")) == 1
    assert value("gen_ai_client_token_usage_sum", usage.format("input")) == 7
    assert value("gen_ai_client_token_usage_count", usage.format("output")) == 2
    assert value("gen_ai_client_token_usage_bucket", usage.format("output") + ',le="4.0"') == 2


def test_node_model_loads_count_running_waiting_and_kv_blocks():
    from shared import vllm_metrics as vm
    from shared.core.types import (SLO, Hardware, InstanceStatus, InstanceView, ModelSpec,
                                   NodeView, RequestView)

    spec = ModelSpec("m", weight_bytes=1000, kv_bytes_per_token=2, max_context=64, kv_block_tokens=16)
    other = ModelSpec("o", weight_bytes=1000, kv_bytes_per_token=1, max_context=64)
    slo = SLO(1.0, 0.1)

    def req(rid: str, prompt: int, generated: int, prefilled: bool) -> RequestView:
        return RequestView(rid, "m", prompt, 0.0, slo, generated=generated, prefilled=prefilled)

    ready = InstanceView("m#1", spec, "n0", requests=[req("a", 10, 3, True), req("b", 20, 0, False)])
    second = InstanceView("m#2", spec, "n0", requests=[req("c", 40, 1, True)])
    loading = InstanceView("o#1", other, "n0", status=InstanceStatus.LOADING,
                           requests=[req("d", 5, 0, False)])
    node = NodeView("n0", Hardware.CPU, 10**6, instances=[ready, second, loading])
    kv = {"m#1": 2 * 64 + 5, "m#2": 2 * 64, "o#1": 100}  # bytes: 64 tokens each, in whole blocks
    loads = {m.model: m for m in vm.model_loads(node, kv.__getitem__)}
    assert loads["m"].running == 2 and loads["m"].waiting == 1
    assert loads["m"].kv_used_tokens == 16 + 48  # 13 tokens in one block, 41 in three
    assert loads["m"].kv_usage == pytest.approx(64 / 128)
    assert (loads["o"].running, loads["o"].waiting, loads["o"].kv_usage) == (0, 1, 0.0)


async def test_metrics_server_answers_get_metrics_only():
    tel = tm.local("node")
    tm.register_node_gauges(tel.meter("n"), {"slinfer.node_id": "n9"},
                            lambda: tm.NodeStats(instances=3))
    server = await tm.serve_metrics(tel, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def get(path: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
        writer.close()
        return data

    try:
        ok = await get("/metrics")
        assert ok.startswith(b"HTTP/1.1 200") and b'slinfer_node_instances{slinfer_node_id="n9"} 3.0' in ok
        assert (await get("/other")).startswith(b"HTTP/1.1 404")
    finally:
        server.close()
        await server.wait_closed()


# --- logs ------------------------------------------------------------------------------------------
def test_json_log_lines_carry_ids_inside_a_span_only(tracer):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(tm.TraceContextFilter())
    handler.setFormatter(tm.JsonFormatter("slinfer-test"))
    logger = logging.getLogger("slinfer.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.warning("outside")
        span = tracer.start_span("req")
        with trace.use_span(span, end_on_exit=True):
            logger.info("inside %s", "a request", extra={"request_id": "r1"})
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    outside, inside, failed = (json.loads(line) for line in stream.getvalue().splitlines())
    assert "trace_id" not in outside and outside["level"] == "WARNING"
    sc = span.get_span_context()
    assert inside["trace_id"] == f"{sc.trace_id:032x}" and inside["span_id"] == f"{sc.span_id:016x}"
    assert inside["message"] == "inside a request" and inside["request_id"] == "r1"
    assert inside["service"] == "slinfer-test" and inside["ts"].endswith("Z")
    assert "RuntimeError: boom" in failed["exception"] and failed["trace_id"] == inside["trace_id"]


# --- the gateway's HTTP server span ----------------------------------------------------------------
async def test_server_span_middleware_names_by_route_and_continues_a_callers_trace():
    import httpx
    from fastapi import FastAPI
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.gateway.app import _NO_NATIVE_TELEMETRY
    from services.gateway.observe import ServerSpanMiddleware

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tel = tm.local("gateway")
    app = FastAPI(**_NO_NATIVE_TELEMETRY)
    inner = provider.get_tracer("inner")

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        with inner.start_as_current_span("inside"):
            return {"id": name}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("boom")

    @app.get("/health")
    async def health() -> dict:
        return {}

    app.add_middleware(ServerSpanMiddleware, tracer=provider.get_tracer("http"),
                       meter=tel.meter("http"), excluded=("/health",))
    caller = provider.get_tracer("caller").start_span("client")
    headers = tm.span_context_headers(caller)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://gw") as client:
        assert (await client.get("/v1/models/a/b", headers=headers)).json() == {"id": "a/b"}
        assert (await client.get("/boom")).status_code == 500
        assert (await client.get("/health")).status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"GET /v1/models/{name:path}", "inside", "GET /boom"}  # /health: none
    server = spans["GET /v1/models/{name:path}"]
    assert server.kind is trace.SpanKind.SERVER
    assert server.parent.span_id == caller.get_span_context().span_id  # the caller's trace
    assert spans["inside"].parent.span_id == server.context.span_id  # current while the app runs
    assert {k: server.attributes[k] for k in ("http.request.method", "http.route", "url.path",
                                              "http.response.status_code")} == {
        "http.request.method": "GET", "http.route": "/v1/models/{name:path}", "url.path": "/v1/models/a/b",
        "http.response.status_code": 200}
    failed = spans["GET /boom"]
    assert failed.parent is None and failed.attributes["http.response.status_code"] == 500
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert failed.attributes["error.type"] == "RuntimeError"
    assert [e.name for e in failed.events] == ["exception"]
    text = tel.metrics_text().decode()
    assert re.search(r'^http_server_request_duration_seconds_count\{[^}]*http_route="/boom"[^}]*\} 1\.0$',
                     text, re.M), text


def test_configured_logs_follow_a_swapped_stderr_and_never_write_to_a_closed_one(monkeypatch):
    """The root handler writes to the stderr of the moment: a stream swapped out and closed
    (pytest's capture between tests) gets nothing, so no 'I/O operation on closed file'."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    first, second = io.StringIO(), io.StringIO()
    errors: list[BaseException] = []
    monkeypatch.setattr(logging, "raiseExceptions", True)
    try:
        monkeypatch.setattr("sys.stderr", first)
        tm.configure_logs("text", "INFO", "slinfer-test")
        (handler,) = root.handlers
        monkeypatch.setattr(handler, "handleError", lambda record: errors.append(record))
        logging.getLogger("slinfer.test.stderr").warning("to the first")
        first.close()
        monkeypatch.setattr("sys.stderr", second)
        logging.getLogger("slinfer.test.stderr").warning("to the second")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    assert errors == []
    assert "to the second" in second.getvalue() and "to the first" not in second.getvalue()

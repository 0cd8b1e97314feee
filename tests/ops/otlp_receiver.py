"""A small OTLP/HTTP receiver (protobuf): what a collector would get from the services.

POST /v1/traces and /v1/metrics bodies are decoded with opentelemetry-proto's
ExportTraceServiceRequest / ExportMetricsServiceRequest and kept in memory, flattened into
`ReceivedSpan`s and metric names. Used by tests/ops and bench/ops_overhead.py.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: tuple[tuple[str, dict], ...]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    status_code: int
    event_ns: tuple[int, ...] = ()  # each event's time, in the order of `events`


class OTLPReceiver:
    def __init__(self, port: int = 0) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metric_names: set[str] = set()
        self.metric_services: set[str] = set()
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    receiver._traces(body)
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    receiver._metrics(body)
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _traces(self, body: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        out = []
        for rs in req.resource_spans:
            res = {a.key: any_value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(ReceivedSpan(
                        service=res.get("service.name", ""), name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(), kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: any_value(a.value) for a in s.attributes},
                        events=tuple((e.name, {a.key: any_value(a.value) for a in e.attributes})
                                     for e in s.events),
                        links=tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links),
                        status_code=s.status.code,
                        event_ns=tuple(e.time_unix_nano for e in s.events)))
        with self._lock:
            self.spans.extend(out)
            self.requests += 1

    def _metrics(self, body: bytes) -> None:
        req = ExportMetricsServiceRequest()
        req.ParseFromString(body)
        with self._lock:
            for rm in req.resource_metrics:
                res = {a.key: any_value(a.value) for a in rm.resource.attributes}
                self.metric_services.add(res.get("service.name", ""))
                for sm in rm.scope_metrics:
                    self.metric_names.update(m.name for m in sm.metrics)
            self.requests += 1

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)


def main() -> None:
    """`python -m tests.ops.otlp_receiver [PORT [DUMP]]`: print the endpoint, serve until SIGTERM,
    then print a JSON summary of what arrived (the overhead benchmarks run it in its own process),
    and with DUMP write every span there, one JSON object a line."""
    import dataclasses
    import json
    import signal
    import sys

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    with OTLPReceiver(int(sys.argv[1]) if len(sys.argv) > 1 else 0) as receiver:
        print(receiver.endpoint, flush=True)
        while not done.wait(0.2):
            pass
    spans = receiver.snapshot()
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as out:
            for span in spans:
                out.write(json.dumps(dataclasses.asdict(span)) + "\n")
    print(json.dumps({"spans": len(spans), "exports": receiver.requests,
                      "services": sorted({s.service for s in spans}),
                      "metrics": sorted(receiver.metric_names)}), flush=True)


if __name__ == "__main__":
    main()

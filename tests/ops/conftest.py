"""A real stack whose services export traces and metrics over OTLP/HTTP to a receiver the test
runs, with the node's Prometheus endpoint on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from shared.servers import free_port
from services.stack import Stack, running_stack
from tests.ops.otlp_receiver import OTLPReceiver


@dataclass(frozen=True)
class TracedStack:
    stack: Stack
    receiver: OTLPReceiver
    node_metrics_url: str


def otel_env(endpoint: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "500",
            "SLINFER_LOG_FORMAT": "json"}


@pytest.fixture(scope="session")
def traced_stack(tmp_path_factory, monkeypatch_session, demo_model,
                 demo_profile) -> Iterator[TracedStack]:
    # The services name themselves (slinfer-gateway, -placer, -node) when OTEL_SERVICE_NAME is unset.
    monkeypatch_session.delenv("OTEL_SERVICE_NAME", raising=False)
    model_dir = demo_model(tmp_path_factory.mktemp("models"))
    metrics_port = free_port()
    with OTLPReceiver() as receiver:
        with running_stack(tmp_path_factory.mktemp("traced"), model_dir, otel_env(receiver.endpoint),
                           {"node-0": {"SLINFER_NODE_METRICS_PORT": str(metrics_port)}},
                           profile=demo_profile) as stack:
            yield TracedStack(stack, receiver, f"http://127.0.0.1:{metrics_port}/metrics")


@pytest.fixture(scope="session")
def monkeypatch_session() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()

"""The session's real stack of processes (`stack`, `traced_stack` in tests/conftest.py): its
services export traces and metrics over OTLP/HTTP to a receiver the test run holds, and the
node's Prometheus endpoint is on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.stack import Stack, running_stack
from shared.core.perf_model import Profile
from shared.servers import free_port
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


@contextmanager
def running_traced_stack(root: Path, model_dir: Path, profile: Profile) -> Iterator[TracedStack]:
    # The services name themselves (slinfer-gateway, -placer, -node) when OTEL_SERVICE_NAME is
    # unset.
    base = {k: v for k, v in os.environ.items() if k != "OTEL_SERVICE_NAME"}
    metrics_port = free_port()
    with OTLPReceiver() as receiver:
        with running_stack(root, model_dir, otel_env(receiver.endpoint),
                           {"node-0": {"SLINFER_NODE_METRICS_PORT": str(metrics_port)}},
                           profile=profile, base_env=base) as stack:
            yield TracedStack(stack, receiver, f"http://127.0.0.1:{metrics_port}/metrics")

"""A real stack for the fault tests (`services.stack.Stack`): nats-server and valkey from their
wheels, the placer, two CPU node workers and the gateway as processes started the way `slinfer
up` starts them, each of which a test can SIGKILL and restart by name. One stack per module; each
test leaves it whole again (`heal`), and starts by checking that it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model
from services.stack import MODEL, Stack, running_stack
from shared.core.perf_model import Profile
from shared.modelgen import ensure_demo_model

NODES = ("node-0", "node-1")
HEARTBEAT_S = 0.25  # the node default; the snapshot's TTL is 12 heartbeats
SNAPSHOT_TTL_S = 12 * HEARTBEAT_S
REQUEST_TIMEOUT_S = 60.0  # the gateway's deadline for every request in these tests


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    return Path(ensure_demo_model(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def demo_profile(demo_model_dir) -> Profile:
    return profile_model(demo_model_dir, MODEL,
                         plan=ProfilePlan(max_len=512, max_batch=8, repeats=3, warmup=1))[0]


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory, demo_model_dir, demo_profile) -> Iterator[Stack]:
    """Two nodes serving the demo model in the best-effort `batch` SLO class. These tests check
    that a fault loses nothing and answers nothing twice, not the SLOs: in the standard class a
    full `make test` box (two nodes, the load, the test on two cores) runs the model 2-3x slower
    than its profile, the nodes' calibration rightly refuses what a standard TTFT asks, and a
    request of the fault-free phase was dropped as overloaded (503)."""
    with running_stack(tmp_path_factory.mktemp("faults"), demo_model_dir, nodes=len(NODES),
                       profile=demo_profile,
                       extra_env={"SLINFER_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)}) as stack:
        assert stack.node_ids == NODES
        resp = httpx.patch(f"{stack.url}/admin/models/{MODEL}", json={"slo_class": "batch"},
                           headers=stack.auth, timeout=30)
        assert resp.status_code == 200, resp.text
        yield stack


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    """Poll until `condition()` is truthy (returns it); a generous deadline, not a measurement."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)

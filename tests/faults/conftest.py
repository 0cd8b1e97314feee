"""A real stack for the fault tests: nats-server and valkey from their wheels, the placer, two CPU
node workers and the gateway as processes started the way `slinfer up` starts them
(`services.launcher.spawn`, the same environment), with handles to SIGKILL and restart each one:
services by spawning them again, servers with `ServerProcess.again()` (same port, same data
directory). One stack per module; each test leaves it whole again (`heal`), and starts by
checking that it is.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from services.launcher import Child, spawn, stop_child
from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model
from services.stack import MODEL, store_profile, wait_healthy, wait_nodes
from shared.core.perf_model import Profile
from shared.modelgen import ensure_demo_model
from shared.servers import ServerProcess, free_port, start_nats, start_redis

NODES = ("node-0", "node-1")
HEARTBEAT_S = 0.25  # the node default; the snapshot's TTL is 12 heartbeats
SNAPSHOT_TTL_S = 12 * HEARTBEAT_S
REQUEST_TIMEOUT_S = 60.0  # the gateway's deadline for every request in these tests
MODULES = {"placer": "services.placer", "gateway": "services.gateway", **{n: "services.node" for n in NODES}}


@dataclass
class FaultStack:
    url: str
    model: str
    model_dir: Path
    profile: Profile
    data: Path
    nats: ServerProcess
    redis: ServerProcess
    env: dict[str, str]
    children: dict[str, Child] = field(default_factory=dict)

    # --- services -----------------------------------------------------------------------------
    def child_env(self, name: str) -> dict[str, str]:
        if name.startswith("node-"):
            return {**self.env, "SLINFER_NODE_ID": name, "SLINFER_NODE_HARDWARE": "cpu",
                    "SLINFER_MATRIX_ACCEL": "true", "SLINFER_NODE_MEMORY_BYTES": str(2 * 1024**3),
                    "SLINFER_HEARTBEAT_S": str(HEARTBEAT_S)}
        return dict(self.env)

    def start(self, name: str) -> Child:
        child = spawn(name, MODULES[name], self.child_env(name), self.data / "logs")
        self.children[name] = child
        return child

    def kill(self, name: str) -> None:
        """SIGKILL the service (its process group: nothing it started survives it)."""
        child = self.children[name]
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.proc.wait(timeout=30)

    def alive(self, name: str) -> bool:
        return self.children[name].proc.poll() is None

    def log(self, name: str) -> str:
        return self.children[name].log_path.read_text(errors="replace")

    # --- servers --------------------------------------------------------------------------------
    def kill_server(self, server: ServerProcess) -> None:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)

    def restart_nats(self) -> None:
        self.nats = self.nats.again()

    def restart_redis(self, empty: bool = False) -> None:
        """Start valkey again on its port; `empty`: without its append-only file, as a new
        container without its volume would."""
        if empty:
            self.redis.stop()
            data = self.redis.log_path.parent
            for entry in data.iterdir():
                if entry.name != self.redis.log_path.name:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        self.redis = self.redis.again()

    # --- the whole --------------------------------------------------------------------------------
    def processes(self) -> list:
        return [*self.children.values()]

    def heal(self) -> None:
        """Restart whatever is down and wait until the stack serves with both nodes."""
        if self.nats.proc.poll() is not None:
            self.restart_nats()
        if self.redis.proc.poll() is not None:
            self.restart_redis()
        for name in self.children:
            if not self.alive(name):
                self.start(name)
        wait_healthy(self.url, self.processes(), timeout_s=120)
        wait_nodes(self.url, set(NODES), self.processes(), timeout_s=120)
        models = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        assert any(m["id"] == self.model for m in models), models

    def stop(self) -> None:
        for name in reversed(list(self.children)):
            stop_child(self.children[name], 10.0)
        self.redis.stop()
        self.nats.stop()


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    return Path(ensure_demo_model(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def demo_profile(demo_model_dir) -> Profile:
    return profile_model(demo_model_dir, MODEL,
                         plan=ProfilePlan(max_len=512, max_batch=8, repeats=3, warmup=1))[0]


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory, demo_model_dir, demo_profile) -> Iterator[FaultStack]:
    data = tmp_path_factory.mktemp("faults")
    nats = start_nats(data / "nats")
    redis = start_redis(data / "redis")
    port = free_port()
    env = {**os.environ, "SLINFER_NATS_URL": nats.url, "SLINFER_REDIS_URL": redis.url,
           "SLINFER_GATEWAY_PORT": str(port), "SLINFER_GATEWAY_HOST": "127.0.0.1",
           "PYTHONUNBUFFERED": "1", "SLINFER_API_KEYS": "",
           "SLINFER_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)}
    stack = FaultStack(f"http://127.0.0.1:{port}", MODEL, demo_model_dir, demo_profile, data,
                       nats, redis, env)
    try:
        store_profile(redis.url, demo_profile)
        for name in ("placer", *NODES, "gateway"):
            stack.start(name)
        wait_healthy(stack.url, stack.processes(), timeout_s=120)
        r = httpx.post(f"{stack.url}/admin/models", json={
            "name": MODEL, "path": str(demo_model_dir), "engine": "torch", "public": True}, timeout=30)
        assert r.status_code in (200, 201), r.text
        wait_nodes(stack.url, set(NODES), stack.processes(), timeout_s=120)
        yield stack
    finally:
        stack.stop()


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

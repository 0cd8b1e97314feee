"""Fixtures of the multicast tests: the `small` demo model converted to the loader's format, the
SHA-256 of each of its tensors as the safetensors files hold them, and multicast endpoints as
separate processes (`python -m services.node.multicast`) on a real nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import torch
from safetensors import safe_open

from services.node.loader.convert import convert_checkpoint
from shared.modelgen import ensure_model
from shared.servers import popen_tied
from shared.subjects import multicast_node_subject

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """The `small` demo model (float32, ~185 MB), converted (one partition)."""
    model = ensure_model(tmp_path_factory.mktemp("multicast-models"), "small", "small")
    convert_checkpoint(model)
    return model


def tensor_digest(tensor: torch.Tensor) -> str:
    if tensor.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(memoryview(tensor.contiguous().view(torch.uint8).numpy())).hexdigest()


@pytest.fixture(scope="session")
def small_digests(small_model: Path) -> dict[str, str]:
    """Every tensor's SHA-256, read from the model's own safetensors (not the converted copy)."""
    out = {}
    for path in sorted(small_model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                out[name] = tensor_digest(f.get_tensor(name))
    return out


@pytest.fixture
async def nc(nats_url):
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


async def ask(nc, node: str, body: dict, timeout: float = 60.0) -> dict:
    msg = await nc.request(multicast_node_subject(node), json.dumps(body).encode(),
                           timeout=timeout)
    return json.loads(msg.data)


class Endpoints:
    """Multicast endpoints, one process each, stopped (killed if need be) at teardown. `ready`
    starts any that is not running (never started, or killed by an earlier test)."""

    def __init__(self, nats_url: str, logs: Path) -> None:
        self.nats_url = nats_url
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, names: list[str], *extra: str) -> None:
        for name in names:
            log = open(self.logs / f"{name}.log", "wb")
            self.procs[name] = popen_tied(
                [sys.executable, "-m", "services.node.multicast", "--node-id", name,
                 "--nats", self.nats_url, *extra],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            log.close()

    async def ready(self, nc, names: list[str], timeout: float = 120.0) -> None:
        """Every endpoint runs and answers a ping (a generous bound for start-up on a busy
        machine)."""
        self.start([n for n in names if n not in self.procs or self.procs[n].poll() is not None])
        deadline = time.monotonic() + timeout
        for name in names:
            while True:
                if self.procs[name].poll() is not None:
                    raise AssertionError(f"endpoint {name} exited: {self.log(name)}")
                try:
                    if (await ask(nc, name, {"op": "ping"}, timeout=1.0))["ok"]:
                        break
                except Exception:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"endpoint {name} never answered: {self.log(name)}")
                    await asyncio.sleep(0.1)

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def endpoints(nats_url, tmp_path_factory) -> Iterator[Endpoints]:
    """Shared by the tests of a module (each process imports torch: seconds of CPU apiece)."""
    group = Endpoints(nats_url, tmp_path_factory.mktemp("endpoints"))
    try:
        yield group
    finally:
        group.stop()


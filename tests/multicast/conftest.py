"""Fixtures of the multicast tests: the `small` demo model converted to the loader's format, the
SHA-256 of each of its tensors as the safetensors files hold them, and multicast endpoints as
separate processes (`python -m services.node.multicast`) on a real nats-server."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import torch
from redis.asyncio import Redis
from safetensors import safe_open

from services.node.loader import LoaderSettings
from services.node.loader.convert import convert_checkpoint
from services.node.settings import NodeSettings
from services.node.worker import NodeWorker
from shared.bus import ensure_streams
from shared.cluster import save_profile
from shared.core.config import CoreConfig
from shared.modelgen import ensure_model
from shared.registry import ModelRegistry, model_record_from_dir
from shared.servers import popen_tied
from shared import wire
from shared.schemas import InferenceRequest, TokenMessage
from shared.subjects import REQUEST_SUBJECT, multicast_node_subject, token_subject

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


def node_settings(node_id: str, memory_bytes: int, nats_url: str, redis_url: str,
                  **overrides) -> NodeSettings:
    """An in-process CPU node worker of these tests: a quick heartbeat, no calibration, a
    512 MiB DRAM tier, instances kept alive for the whole test (`overrides`: other fields)."""
    fields = dict(node_id=node_id, hardware="cpu", device="cpu", memory_bytes=memory_bytes,
                  matrix_accel=True, nats_url=nats_url, redis_url=redis_url,
                  core=CoreConfig(keep_alive_s=120.0), heartbeat_s=0.05, calibrate=False,
                  loader=LoaderSettings(dram_cache_bytes=512 << 20))
    return NodeSettings(**(fields | overrides))


async def small_on_stack(own_servers, small_model: Path, context: int, profile):
    """Clients of the test's own nats-server and valkey, with the `small` model registered
    (its context cut to `context`) and `profile` saved: (nc, redis, record)."""
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    record = dataclasses.replace(model_record_from_dir("small", small_model), max_context=context)
    await ModelRegistry(redis).register(record)
    await save_profile(redis, profile)
    return nc, redis, record


def source_and_nodes(source: str, nodes, memory_bytes: int, record, own_servers, nc,
                     redis) -> dict:
    """Node workers: `source` with room for half the model (a memory node: it only holds the
    model in its DRAM tier), each of `nodes` with `memory_bytes`."""
    urls = tuple(own_servers)
    workers = {source: NodeWorker(node_settings(source, record.weight_bytes // 2, *urls), nc,
                                  redis)}
    return workers | {n: NodeWorker(node_settings(n, memory_bytes, *urls), nc, redis)
                      for n in nodes}


async def submit_timed(nc, finals: dict, first_token_at: dict, prompt_len: int,
                       max_tokens: int, prefix: str) -> str:
    """A greedy request (prompt 5, 6, ...) on the placer's stream; when its first token came
    (this process's clock) lands in `first_token_at`, its final message in `finals`."""
    rid = f"{prefix}-{uuid.uuid4().hex[:8]}"

    async def on_token(msg) -> None:
        m = wire.decode(TokenMessage, msg.data)
        if m.token_ids and rid not in first_token_at:
            first_token_at[rid] = time.time()
        if m.finished:
            finals[rid] = m

    await nc.subscribe(token_subject(rid), cb=on_token)
    req = InferenceRequest(rid, "t", "small", [5 + i for i in range(prompt_len)], max_tokens,
                           time.time(), 60.0, 0.5, temperature=0.0)
    await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req), headers={"Nats-Msg-Id": rid})
    return rid


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


"""A whole stack as real processes, for tests and benchmarks: nats-server and valkey from their
wheels, a measured profile in Redis, and the placer, one CPU node worker and the gateway, started
the way `slinfer up` starts them (`services.launcher.spawn`). Not supervised: a test wants to see
a crash, not have it papered over. Every process dies with the process that started it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from redis.asyncio import Redis

from services.launcher import Child, spawn, stop_child
from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model
from shared.cluster import save_profile
from shared.core.perf_model import Profile
from shared.servers import free_port, start_nats, start_redis

MODEL = "tiny-llama"


@dataclass(frozen=True)
class Stack:
    url: str  # gateway base URL
    model: str
    nats_url: str
    redis_url: str
    data_dir: Path
    children: tuple[Child, ...]
    server_pids: tuple[tuple[str, int], ...] = ()  # (name, pid) of nats-server and valkey


def store_profile(redis_url: str, profile: Profile) -> None:
    async def go() -> None:
        redis = Redis.from_url(redis_url)
        try:
            await save_profile(redis, profile)
        finally:
            await redis.aclose()

    asyncio.run(go())


def wait_until(ready: Callable[[], bool], children: list[Child], what: str,
               timeout_s: float = 60.0) -> None:
    """Poll `ready` until it holds; fail early, with its log, if a child process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited: {c.log_path.read_text()[-2000:]}")
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(what)


def wait_healthy(url: str, children: list[Child], timeout_s: float = 60.0) -> None:
    wait_until(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, children,
               "gateway never became healthy", timeout_s)


def wait_nodes(url: str, node_ids: set[str], children: list[Child], timeout_s: float = 60.0,
               headers: Mapping[str, str] | None = None) -> None:
    """Until every node in `node_ids` is in the cluster view (it published itself after loading
    its engine stack): a request sent before would only queue for it."""
    def joined() -> bool:
        r = httpx.get(f"{url}/admin/nodes", timeout=1, headers=headers)
        return r.status_code == 200 and node_ids <= {n["node_id"] for n in r.json()["data"]}

    wait_until(joined, children, f"nodes {sorted(node_ids)} never joined the cluster view", timeout_s)


@contextmanager
def running_stack(data: Path, model_dir: Path, extra_env: Mapping[str, str] | None = None,
                  child_env: Mapping[str, Mapping[str, str]] | None = None,
                  profile: Profile | None = None,
                  plan: ProfilePlan = ProfilePlan(max_len=512, max_batch=8, repeats=3, warmup=1,
                                                  lora_ranks=(8,)),
                  base_env: Mapping[str, str] | None = None, model: str = MODEL) -> Iterator[Stack]:
    """The stack as real processes serving `model_dir` as `model`. `extra_env` goes to every
    service, `child_env[name]` to one (placer, node-0, gateway); `profile` (measured with `plan`
    when not given; its model name must be `model`) is stored in the stack's Redis; `base_env`
    defaults to this process's."""
    with ExitStack() as cleanup:
        # Each process is registered for stopping the moment it exists, so a failed start, a
        # failing test or a pytest-timeout (its signal method unwinds through here) leaves nothing
        # running; a killed or crashed test process takes them down through PR_SET_PDEATHSIG.
        nats = start_nats(data / "nats")
        cleanup.callback(nats.stop)
        redis = start_redis(data / "redis")
        cleanup.callback(redis.stop)
        children: list[Child] = []
        per_child = child_env or {}
        store_profile(redis.url, profile or profile_model(model_dir, model, plan=plan)[0])
        port = free_port()
        env = {**(os.environ if base_env is None else base_env),
               "SLINFER_NATS_URL": nats.url, "SLINFER_REDIS_URL": redis.url,
               "SLINFER_GATEWAY_PORT": str(port), "SLINFER_GATEWAY_HOST": "127.0.0.1",
               "PYTHONUNBUFFERED": "1", "SLINFER_API_KEYS": "", **(extra_env or {})}
        logs = data / "logs"

        def start(name: str, module: str, service_env: Mapping[str, str]) -> None:
            child = spawn(name, module, {**service_env, **per_child.get(name, {})}, logs)
            children.append(child)
            cleanup.callback(stop_child, child, 10.0)  # stopped in reverse start order

        start("placer", "services.placer", env)
        start("node-0", "services.node", {
            # Its local disk tier of checkpoints in the stack's data, not the working directory.
            "SLINFER_NODE_CHECKPOINT_DIR": str(data / "checkpoints" / "node-0"),
            **env, "SLINFER_NODE_ID": "node-0", "SLINFER_NODE_HARDWARE": "cpu",
            # A development CPU may lack AMX; the placer's CPU rule needs the explicit override.
            "SLINFER_MATRIX_ACCEL": "true", "SLINFER_NODE_MEMORY_BYTES": str(2 * 1024**3)})
        start("gateway", "services.gateway", env)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, children)
        # With keys configured, the stack's own admin calls use the first operator key.
        operator = (env.get("SLINFER_OPERATOR_KEYS") or "").split(",")[0].strip()
        auth = {"Authorization": f"Bearer {operator}"} if operator else None
        r = httpx.post(f"{url}/admin/models", json={"name": model, "path": str(model_dir),
                                                    "engine": "torch", "public": True},
                       headers=auth)
        if r.status_code not in (200, 201):
            raise RuntimeError(f"registering {model} failed: {r.status_code} {r.text}")
        wait_nodes(url, {"node-0"}, children, headers=auth)
        yield Stack(url, model, nats.url, redis.url, data, tuple(children),
                    (("nats-server", nats.proc.pid), ("valkey", redis.proc.pid)))

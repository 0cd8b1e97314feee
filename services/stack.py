"""A whole stack as real processes, for tests and benchmarks: nats-server and valkey from their
wheels, a measured profile in Redis, and the placer, N CPU node workers and the gateway, started
the way `slinfer up` starts them (`services.launcher.spawn`). Not supervised: a test wants to see
a crash, not have it papered over. Instead every process is known by name ("nats", "redis",
"placer", "node-0".., "gateway") and can be SIGKILLed and started again, one at a time, by the
fault tests and the chaos soak; `heal()` brings back whatever is down. Every process dies with the
process that started it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from services.launcher import Child, spawn, stop_child
from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model
from shared.cluster import save_profile
from shared.core.perf_model import Profile
from shared.redis_client import open_redis
from shared.servers import ServerProcess, free_port, start_nats, start_redis

MODEL = "tiny-llama"
SERVERS = ("nats", "redis")
NODE_MEMORY_BYTES = 2 * 1024**3
START_TIMEOUT_S = 120.0  # first start imports torch; two nodes on two busy cores take a while
STOP_TIMEOUT_S = 10.0
DEFAULT_PLAN = ProfilePlan(max_len=512, max_batch=8, repeats=3, warmup=1, lora_ranks=(8,))


def store_profile(redis_url: str, profile: Profile) -> None:
    async def go() -> None:
        redis = open_redis(redis_url)
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
               headers: Mapping[str, str] | None = None, since: float = 0.0) -> None:
    """Until every node in `node_ids` is in the cluster view (it published itself after loading
    its engine stack): a request sent before would only queue for it. With `since` (time.time()),
    by a snapshot taken after it: a killed node's last snapshot stays in the view for its TTL."""
    def joined() -> bool:
        r = httpx.get(f"{url}/admin/nodes", timeout=1, headers=headers)
        return r.status_code == 200 and node_ids <= {
            n["node_id"] for n in r.json()["data"] if n["heartbeat"] > since}

    wait_until(joined, children, f"nodes {sorted(node_ids)} never joined the cluster view", timeout_s)


class Stack:
    """The stack serving `model_dir` as `model` on `nodes` CPU nodes. `extra_env` goes to every
    service, `child_env[name]` to one (placer, node-i, gateway); `profile` (measured with `plan`
    when not given; its model name must be `model`) is stored in the stack's Redis; `base_env`
    defaults to this process's. `start()` brings it up, `stop()` takes it down; in between any
    process can be killed and restarted by name."""

    def __init__(self, data: Path, model_dir: Path, *, model: str = MODEL, nodes: int = 1,
                 extra_env: Mapping[str, str] | None = None,
                 child_env: Mapping[str, Mapping[str, str]] | None = None,
                 profile: Profile | None = None, plan: ProfilePlan = DEFAULT_PLAN,
                 base_env: Mapping[str, str] | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"a stack needs at least one node, not {nodes}")
        self.data_dir, self.model_dir, self.model = data, model_dir, model
        self.node_ids = tuple(f"node-{i}" for i in range(nodes))
        self._extra_env, self._child_env = dict(extra_env or {}), dict(child_env or {})
        self._base_env = os.environ if base_env is None else base_env
        self._profile, self._plan = profile, plan
        self.servers: dict[str, ServerProcess] = {}
        self.children: dict[str, Child] = {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    # --- names and addresses -------------------------------------------------------------------
    @property
    def services(self) -> tuple[str, ...]:
        """Service names in start order."""
        return ("placer", *self.node_ids, "gateway")

    @property
    def names(self) -> tuple[str, ...]:
        """Every process of the stack: servers, then services."""
        return (*SERVERS, *self.services)

    @property
    def nats_url(self) -> str:
        return self.servers["nats"].url

    @property
    def redis_url(self) -> str:
        return self.servers["redis"].url

    @property
    def auth(self) -> dict[str, str] | None:
        """With keys configured, the stack's own admin calls use the first operator key."""
        operator = (self._env().get("SLINFER_OPERATOR_KEYS") or "").split(",")[0].strip()
        return {"Authorization": f"Bearer {operator}"} if operator else None

    def pids(self) -> dict[str, int]:
        """Name -> pid of every process that runs now (a restart changes the pid)."""
        running = {**self.servers, **self.children}
        return {n: p.proc.pid for n, p in running.items() if p.proc.poll() is None}

    def processes(self) -> list[Child]:
        return list(self.children.values())

    def alive(self, name: str) -> bool:
        return self._process(name).proc.poll() is None

    def log(self, name: str) -> str:
        return self._process(name).log_path.read_text(errors="replace")

    # --- one process -----------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """SIGKILL a server or service (its process group: nothing it started survives it)."""
        proc = self._process(name).proc
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def restart(self, name: str) -> None:
        """Start a server (same port, same data directory) or a service (same environment)
        again; one that still runs is stopped first. Returns once a server answers; a service
        is only spawned (`heal` waits for the whole)."""
        if name in SERVERS:
            self.servers[name] = self.servers[name].again()
            return
        if name in self.children and self.alive(name):
            stop_child(self.children[name], STOP_TIMEOUT_S)
        self.children[name] = spawn(name, self._module(name), self._service_env(name),
                                    self.data_dir / "logs")

    def restart_redis(self, empty: bool = False) -> None:
        """Start valkey again on its port; `empty`: without its append-only file, as a new
        container without its volume would."""
        if empty:
            redis = self.servers["redis"]
            redis.stop()
            for entry in redis.log_path.parent.iterdir():
                if entry.name != redis.log_path.name:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        self.restart("redis")

    # --- the whole -----------------------------------------------------------------------------
    def start(self) -> Stack:
        """Servers, the profile, the services, the model registered, every node in the view.
        A failed start leaves nothing running."""
        try:
            self.servers["nats"] = start_nats(self.data_dir / "nats")
            self.servers["redis"] = start_redis(self.data_dir / "redis")
            profile = self._profile or profile_model(self.model_dir, self.model, plan=self._plan)[0]
            store_profile(self.redis_url, profile)
            for name in self.services:
                self.restart(name)
            wait_healthy(self.url, self.processes(), START_TIMEOUT_S)
            self._register()
            wait_nodes(self.url, set(self.node_ids), self.processes(), START_TIMEOUT_S, self.auth)
        except BaseException:
            self.stop()
            raise
        return self

    def heal(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Restart whatever is down and wait until the stack serves its model on every node."""
        since = time.time()
        for name in self.names:
            if not self.alive(name):
                self.restart(name)
        wait_healthy(self.url, self.processes(), timeout_s)
        wait_nodes(self.url, set(self.node_ids), self.processes(), timeout_s, self.auth, since)
        wait_until(self._serves_model, self.processes(), f"{self.model} never listed again",
                   timeout_s)

    def stop(self) -> None:
        """Services in reverse start order, then the servers; safe to call twice."""
        for name in reversed(list(self.children)):
            stop_child(self.children[name], STOP_TIMEOUT_S)
        for name in reversed(list(self.servers)):
            self.servers[name].stop()

    # --- internals -----------------------------------------------------------------------------
    def _process(self, name: str) -> ServerProcess | Child:
        if name in SERVERS:
            return self.servers[name]
        return self.children[name]

    def _env(self) -> dict[str, str]:
        urls = {}
        if self.servers:
            urls = {"SLINFER_NATS_URL": self.nats_url, "SLINFER_REDIS_URL": self.redis_url}
        return {**self._base_env, **urls,
                "SLINFER_GATEWAY_PORT": str(self.port), "SLINFER_GATEWAY_HOST": "127.0.0.1",
                "PYTHONUNBUFFERED": "1", "SLINFER_API_KEYS": "", **self._extra_env}

    def _service_env(self, name: str) -> dict[str, str]:
        env = self._env()
        if name in self.node_ids:
            env = {
                # Its local disk tier of checkpoints in the stack's data, not the working directory.
                "SLINFER_NODE_CHECKPOINT_DIR": str(self.data_dir / "checkpoints" / name),
                **env, "SLINFER_NODE_ID": name, "SLINFER_NODE_HARDWARE": "cpu",
                # A development CPU may lack AMX; the placer's CPU rule needs the explicit override.
                "SLINFER_MATRIX_ACCEL": "true", "SLINFER_NODE_MEMORY_BYTES": str(NODE_MEMORY_BYTES)}
        return {**env, **self._child_env.get(name, {})}

    def _module(self, name: str) -> str:
        return "services.node" if name in self.node_ids else f"services.{name}"

    def _register(self) -> None:
        r = httpx.post(f"{self.url}/admin/models", headers=self.auth, timeout=30, json={
            "name": self.model, "path": str(self.model_dir), "engine": "torch", "public": True})
        if r.status_code not in (200, 201):
            raise RuntimeError(f"registering {self.model} failed: {r.status_code} {r.text}")

    def _serves_model(self) -> bool:
        r = httpx.get(f"{self.url}/v1/models", headers=self.auth, timeout=5)
        return r.status_code == 200 and any(m["id"] == self.model for m in r.json()["data"])


@contextmanager
def running_stack(data: Path, model_dir: Path, extra_env: Mapping[str, str] | None = None,
                  child_env: Mapping[str, Mapping[str, str]] | None = None,
                  profile: Profile | None = None, plan: ProfilePlan = DEFAULT_PLAN,
                  base_env: Mapping[str, str] | None = None, model: str = MODEL,
                  nodes: int = 1) -> Iterator[Stack]:
    """A started `Stack`, stopped on leaving the block (a failing test, a pytest-timeout, whose
    signal method unwinds through here, included; a killed test process takes the stack down
    through PR_SET_PDEATHSIG)."""
    stack = Stack(data, model_dir, model=model, nodes=nodes, extra_env=extra_env,
                  child_env=child_env, profile=profile, plan=plan, base_env=base_env).start()
    try:
        yield stack
    finally:
        stack.stop()

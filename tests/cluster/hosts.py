"""slinfer spread over three hosts of a `netns.segment`: each host runs a nats-server of one
JetStream cluster (3-replica streams), a valkey (the primary on h1, replicas elsewhere) and a
Sentinel; the services sit as issue 23 lays them out: gateway and a placer on h1, a placer and a
node on h2, a node on h3. Every process is known by name ("nats@h1", "valkey@h2", "gateway",
"node-0", ...) and can be killed and started again with the same command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.servers import (nats_server_binary, popen_tied, redis_server_binary,
                            refuse_writes_alone, valkey_argv)
from tests.cluster.netns import Host, Segment

REPO = Path(__file__).resolve().parents[2]
NATS_PORT, ROUTE_PORT, VALKEY_PORT, SENTINEL_PORT, GATEWAY_PORT = 4222, 6222, 6379, 26379, 8000
MASTER = "slinfer"
KEY, OPERATOR_KEY = "tenant-key", "operator-key"
# name -> (host, module) of the services, in start order
SERVICES = {"placer-a": ("h1", "services.placer"), "placer-b": ("h2", "services.placer"),
            "node-0": ("h2", "services.node"), "node-1": ("h3", "services.node"),
            "gateway": ("h1", "services.gateway")}


@dataclass
class Proc:
    name: str
    host: Host
    argv: list[str]
    env: dict[str, str] | None
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = popen_tied(self.host.argv(self.argv), env=self.env, cwd=REPO,
                                   stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Cluster:
    def __init__(self, seg: Segment, data: Path) -> None:
        self.seg, self.data = seg, data
        self.hosts = list(seg.hosts.values())
        self.procs: dict[str, Proc] = {}

    # --- addresses -------------------------------------------------------------------------------
    @property
    def nats_urls(self) -> str:
        return ",".join(f"nats://{h.ip}:{NATS_PORT}" for h in self.hosts)

    @property
    def redis_url(self) -> str:
        sentinels = ",".join(f"{h.ip}:{SENTINEL_PORT}" for h in self.hosts)
        return f"redis+sentinel://{sentinels}/{MASTER}/0"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.seg['h1'].ip}:{GATEWAY_PORT}"

    def host_of_server(self, server_name: str) -> Host:
        """The host whose nats-server is named `server_name` (servers are named by host)."""
        return self.seg[server_name]

    def host_of_service(self, name: str) -> Host:
        return self.seg[SERVICES[name][0]]

    def host_at(self, ip: str) -> Host:
        return next(h for h in self.hosts if h.ip == ip)

    # --- starting ----------------------------------------------------------------------------------
    def start_servers(self) -> None:
        for h in self.hosts:
            self._add(f"nats@{h.name}", h, self._nats_argv(h), None)
        for h in self.hosts:
            self._add(f"valkey@{h.name}", h, self._valkey_argv(h), None)
        for h in self.hosts:
            self._wait_port(h, VALKEY_PORT)
        for h in self.hosts:
            self._add(f"sentinel@{h.name}", h, self._sentinel_argv(h), None)
        for h in self.hosts:
            self._wait_port(h, NATS_PORT)
            self._wait_port(h, SENTINEL_PORT)

    def start_services(self) -> None:
        for name, (host, module) in SERVICES.items():
            self._add(name, self.seg[host], [sys.executable, "-m", module], self._env(name, host))

    def _add(self, name: str, host: Host, argv: list[str], env: dict[str, str] | None) -> None:
        proc = Proc(name, host, argv, env, self.data / "logs" / f"{name}.log")
        proc.start()
        self.procs[name] = proc

    def restart(self, name: str) -> None:
        proc = self.procs[name]
        if proc.alive():
            proc.kill()
        proc.start()

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def on_host(self, host: Host) -> list[str]:
        return [n for n, p in self.procs.items() if p.host is host]

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.kill()

    # --- probes from inside a host ---------------------------------------------------------------
    def probe(self, host: Host, *args: str, timeout_s: float = 60) -> str:
        out = host.run([sys.executable, "-m", "tests.cluster.probe", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"probe {args} in {host.name} failed: {out.stderr[-2000:]}")
        return out.stdout.strip()

    def _wait_port(self, host: Host, port: int, timeout_s: float = 30) -> None:
        self.probe(host, "port", host.ip, str(port), str(timeout_s), timeout_s=timeout_s + 10)

    # --- command lines ---------------------------------------------------------------------------
    def _nats_argv(self, h: Host) -> list[str]:
        routes = ",".join(f"nats://{o.ip}:{ROUTE_PORT}" for o in self.hosts)
        return [nats_server_binary(), "-a", h.ip, "-p", str(NATS_PORT), "-js",
                "-sd", str(self.data / h.name / "nats"), "--server_name", h.name,
                "--cluster_name", "slinfer", "--cluster", f"nats://{h.ip}:{ROUTE_PORT}",
                "--routes", routes]

    def _valkey_argv(self, h: Host) -> list[str]:
        d = self.data / h.name / "valkey"
        d.mkdir(parents=True, exist_ok=True)
        argv = valkey_argv(h.ip, VALKEY_PORT, d)
        # Three valkeys: a primary on the minority side of a cut refuses writes (its clients
        # then ask the Sentinels again) instead of taking writes the failover would discard.
        argv += refuse_writes_alone(1)
        primary = self.hosts[0]
        if h is not primary:
            argv += ["--replicaof", primary.ip, str(VALKEY_PORT)]
        return argv

    def _sentinel_argv(self, h: Host) -> list[str]:
        d = self.data / h.name / "sentinel"
        d.mkdir(parents=True, exist_ok=True)
        config = d / "sentinel.conf"
        if not config.exists():  # a restart keeps what it learned (it rewrites its config)
            config.write_text("\n".join([
                f"bind {h.ip}", f"port {SENTINEL_PORT}", f"dir {d}", "protected-mode no",
                f"sentinel monitor {MASTER} {self.hosts[0].ip} {VALKEY_PORT} 2",
                f"sentinel down-after-milliseconds {MASTER} 1000",
                f"sentinel failover-timeout {MASTER} 3000"]) + "\n")
        return [redis_server_binary(), str(config), "--sentinel"]

    def _env(self, name: str, host: str) -> dict[str, str]:
        h = self.seg[host]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SLINFER_NATS_URL": self.nats_urls,
               "SLINFER_REDIS_URL": self.redis_url, "SLINFER_STREAM_REPLICAS": "3",
               "SLINFER_DATA_DIR": str(self.data / host / name),
               "SLINFER_API_KEYS": f"{KEY}:acme", "SLINFER_OPERATOR_KEYS": OPERATOR_KEY}
        if name == "gateway":
            env |= {"SLINFER_GATEWAY_HOST": h.ip, "SLINFER_GATEWAY_PORT": str(GATEWAY_PORT)}
        if name.startswith("node-"):
            env |= {"SLINFER_NODE_ID": name, "SLINFER_NODE_HARDWARE": "cpu",
                    "SLINFER_MATRIX_ACCEL": "true", "SLINFER_NODE_MEMORY_BYTES": str(2 * 1024**3),
                    "SLINFER_NODE_BIND_HOST": h.ip, "SLINFER_NODE_ADVERTISE_HOST": h.ip,
                    "SLINFER_NODE_CHECKPOINT_DIR": str(self.data / host / name / "checkpoints")}
        return env

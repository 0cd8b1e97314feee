"""Several hosts on this one machine: network namespaces joined by a bridge.

Each host is a namespace with one interface on a private /24 segment (10.213.<k>.0/24, `k` from
the test process's pid so two runs do not meet); the bridge lives in a namespace of its own, so
nothing of the segment exists in the machine's root namespace, where a blackhole route for it
makes sure no packet to it could leave the machine even if a route appeared. `cut(host)` takes a
host's link down (a network partition), `heal(host)` brings it back. Everything created is
removed on leaving the block, also when the test fails, and so is every process still running in
a host's namespace.

Needs root (`ip netns`); `available()` says whether this process can.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None if this process can make namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    try:
        _ip("netns", "list")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


@dataclass
class Host:
    name: str  # e.g. "h1"
    netns: str  # the namespace's name
    ip: str  # its address on the segment
    port: str  # its link's end in the bridge namespace (what `cut` takes down)
    bridge_ns: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), **kw)

    def cut(self) -> None:
        """Take the host's link down: it can reach no other host, none can reach it."""
        _ip("-n", self.bridge_ns, "link", "set", self.port, "down")

    def heal(self) -> None:
        _ip("-n", self.bridge_ns, "link", "set", self.port, "up")

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> None:
        """SIGKILL every process in the host (a host that lost power)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Segment:
    prefix: str
    subnet: str
    bridge_ns: str
    hosts: dict[str, Host] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]


def _segment_octet() -> int:
    return 16 + os.getpid() % 200


@contextmanager
def segment(names: Sequence[str]) -> Iterator[Segment]:
    """Hosts `names` on a fresh private segment, removed (with their processes) afterwards."""
    prefix = f"sl{os.getpid()}"
    octet = _segment_octet()
    seg = Segment(prefix, f"10.213.{octet}.0/24", f"{prefix}br")
    created: list[str] = []
    route = False
    try:
        _ip("route", "add", "blackhole", seg.subnet)
        route = True
        _ip("netns", "add", seg.bridge_ns)
        created.append(seg.bridge_ns)
        _ip("-n", seg.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", seg.bridge_ns, "link", "set", "br0", "up")
        for k, name in enumerate(names, start=1):
            host = Host(name, f"{prefix}{name}", f"10.213.{octet}.{10 + k}", f"p{k}", seg.bridge_ns)
            _ip("netns", "add", host.netns)
            created.append(host.netns)
            _plug(host, f"{prefix}v{k}", seg.bridge_ns)
            seg.hosts[name] = host
        yield seg
    finally:
        for host in seg.hosts.values():
            host.kill_all()
        time.sleep(0.1)  # let the kernel reap them before their namespace goes
        for ns in reversed(created):
            _ip("netns", "del", ns, check=False)
        if route:
            _ip("route", "del", "blackhole", seg.subnet, check=False)


def _plug(host: Host, veth: str, bridge_ns: str) -> None:
    """One veth pair: eth0 inside the host, its peer on the bridge."""
    _ip("link", "add", veth, "type", "veth", "peer", "name", host.port + veth)
    _ip("link", "set", veth, "netns", host.netns)
    _ip("link", "set", host.port + veth, "netns", bridge_ns)
    _ip("-n", bridge_ns, "link", "set", host.port + veth, "name", host.port)
    _ip("-n", bridge_ns, "link", "set", host.port, "master", "br0")
    _ip("-n", bridge_ns, "link", "set", host.port, "up")
    _ip("-n", host.netns, "link", "set", veth, "name", "eth0")
    _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
    _ip("-n", host.netns, "link", "set", "eth0", "up")
    _ip("-n", host.netns, "link", "set", "lo", "up")

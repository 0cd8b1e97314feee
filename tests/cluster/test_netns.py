"""The multi-host harness itself: hosts reach each other over the segment, a cut host reaches
nobody and heals, the root namespace cannot reach the segment, and nothing is left afterwards."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.cluster import netns

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(netns.available()), reason=str(netns.available()))]

ECHO = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 7000)); s.listen();"
        "print('ready', flush=True)\nwhile True:\n c,_=s.accept(); c.sendall(b'hi'); c.close()")
DIAL = ("import socket,sys\ntry:\n c=socket.create_connection((sys.argv[1], 7000), timeout=1);"
        " print(c.recv(2).decode())\nexcept OSError as e: print('unreachable', e)")


def _dial(host: netns.Host, ip: str) -> str:
    return host.run([sys.executable, "-c", DIAL, ip], capture_output=True, text=True,
                    timeout=10).stdout.strip()


def test_hosts_reach_each_other_cut_heal_and_leave_nothing() -> None:
    with netns.segment(["h1", "h2"]) as seg:
        h1, h2 = seg["h1"], seg["h2"]
        server = subprocess.Popen(h1.argv([sys.executable, "-c", ECHO, h1.ip]),
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        assert _dial(h2, h1.ip) == "hi"
        h1.cut()
        assert _dial(h2, h1.ip).startswith("unreachable")
        h1.heal()
        assert _dial(h2, h1.ip) == "hi"
        with pytest.raises(OSError):  # the root namespace: blackholed, never routed out
            socket.create_connection((h1.ip, 7000), timeout=1)
        names = [seg.bridge_ns, h1.netns, h2.netns]
    server.wait(timeout=10)  # killed with its host
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    assert seg.subnet not in routes

"""Questions the multi-host test asks from inside a host (the root namespace cannot reach the
segment). One per run, answer on stdout:

    python -m tests.cluster.probe port HOST PORT [TIMEOUT]     until HOST:PORT accepts (exit 1 if not)
    python -m tests.cluster.probe leader NATS_URLS STREAM      the server name leading STREAM
    python -m tests.cluster.probe primary SENTINEL MASTER      host:port of the current primary
    python -m tests.cluster.probe answers NATS_URLS NODE [TIMEOUT]  until NODE answers a STATUS
                                                               over NATS (exit 1 if not)
    python -m tests.cluster.probe get URL KEY                  GET with a bearer key, the body
    python -m tests.cluster.probe post URL KEY                 POST (no body) with a bearer key
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request

import nats
import redis

from shared import wire
from shared.schemas import CommandKind, NodeCommand
from shared.servers import ServerStartError, wait_for_port
from shared.subjects import node_command_subject


async def stream_leader(servers: list[str], stream: str, timeout_s: float = 30) -> str:
    nc = await nats.connect(servers=servers, connect_timeout=2, max_reconnect_attempts=3)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = await nc.jetstream().stream_info(stream)
                if info.cluster and info.cluster.leader:
                    return info.cluster.leader
            except Exception:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def node_answers(servers: list[str], node_id: str, timeout_s: float) -> bool:
    """Whether `node_id` answered a STATUS command over NATS within `timeout_s` (asked again
    every half second: its NATS client may still be reconnecting)."""
    nc = await nats.connect(servers=servers, connect_timeout=2, max_reconnect_attempts=3)
    status = wire.encode(NodeCommand(CommandKind.STATUS, request_id="multihost-probe"))
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await nc.request(node_command_subject(node_id), status, timeout=0.5)
                return True
            except Exception:  # no responders, a timeout: not connected yet
                await asyncio.sleep(0.5)
        return False
    finally:
        await nc.close()


def primary(sentinel: str, master: str) -> str:
    host, port = sentinel.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port), socket_timeout=2)
    addr = client.execute_command("SENTINEL", "get-master-addr-by-name", master)
    return f"{addr[0].decode()}:{addr[1].decode()}"


def call(url: str, key: str, method: str = "GET") -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {key}"})
    with opener.open(req, timeout=15) as resp:  # past a Redis failover behind the gateway
        return resp.read().decode()


def main(argv: list[str]) -> int:
    what, args = argv[0], argv[1:]
    if what == "port":
        try:
            wait_for_port(args[0], int(args[1]), float(args[2]) if len(args) > 2 else 30)
        except ServerStartError:
            return 1
        return 0
    if what == "answers":
        timeout_s = float(args[2]) if len(args) > 2 else 60
        return 0 if asyncio.run(node_answers(args[0].split(","), args[1], timeout_s)) else 1
    if what == "leader":
        print(asyncio.run(stream_leader(args[0].split(","), args[1])))
    elif what == "primary":
        print(primary(args[0], args[1]))
    elif what in ("get", "post"):
        print(call(args[0], args[1], what.upper()))
    else:
        raise SystemExit(f"unknown probe {what!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

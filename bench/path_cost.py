"""What one warm request costs each process of the stack, against what the transport costs.

    .venv/bin/python bench/path_cost.py [--n 200] [--length 1024]

`bench/path_split.py` says where a request's time to first token goes, hop by hop (~1.2 ms
each). This says why a hop costs that much: the same stack and requests (`bench/e2e_overhead.py`'s:
nats-server, valkey, placer, one CPU node, gateway, the tiny model, streamed completions of
`--length` prompt tokens and 2 output tokens), counting per request
- the messages on the bus, by subject (a wildcard subscriber sees every publish and every
  JetStream delivery),
- the CPU time of each process (/proc, user + system), the node's split into its event-loop
  thread and the rest (the engine's threads),
and, on the same machine and minutes, the floors a hop cannot go under: a round trip between two
processes over a loopback TCP socket, and a NATS request-reply between two nats-py processes
through the stack's nats-server. Writes bench/results/path_cost.json and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from e2e_overhead import one_request, visible_prompts  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.stack import running_stack  # noqa: E402
from shared.modelgen import ensure_demo_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system seconds of a process (or of one of its threads)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def subject_class(subject: str) -> str:
    """A subject with its ids and numbers folded, so one kind of message counts as one."""
    if subject.startswith("_INBOX."):
        return "_INBOX.* (replies)"
    return re.sub(r"[0-9a-f]{8,}|\d+", "*", subject)


async def run_requests(url: str, prompt: str, n: int) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(n):
            await one_request(client, url, prompt)
            await asyncio.sleep(0.02)  # as e2e_overhead does: sequential, one at a time


async def measure(stack, prompt: str, n: int) -> dict:
    import nats
    await run_requests(stack.url, prompt, 5)  # the cold start and a few warm ones, not counted
    seen: collections.Counter[str] = collections.Counter()
    monitor = await nats.connect(stack.nats_url)

    async def count(msg) -> None:
        seen[subject_class(msg.subject)] += 1

    await monitor.subscribe(">", cb=count)
    await monitor.flush()
    pids = stack.pids()
    node = pids["node-0"]
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    node_loop_before = cpu_s(node, node)  # the main thread runs the node's event loop
    started = time.perf_counter()
    await run_requests(stack.url, prompt, n)
    wall = time.perf_counter() - started
    after = {name: cpu_s(pid) for name, pid in pids.items()}
    node_loop = cpu_s(node, node) - node_loop_before
    await asyncio.sleep(0.3)
    await monitor.close()
    per_request = {name: round((after[name] - before[name]) / n * 1e3, 2) for name in pids}
    per_request["node-0 event loop"] = round(node_loop / n * 1e3, 2)
    per_request["node-0 other threads (engine)"] = round(per_request["node-0"] - node_loop / n * 1e3, 2)
    return {"requests": n, "wall_s": round(wall, 2),
            "cpu_ms_per_request": per_request,
            "messages_per_request": {k: round(v / n, 2) for k, v in seen.most_common()}}


TCP_ECHO = """
import socket, sys
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(4096):
    conn.sendall(data)
"""


def tcp_round_trip_us(rounds: int = 3000) -> float:
    """Median round trip of 300 bytes between this process and an echoing one, loopback TCP."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    echo = subprocess.Popen([sys.executable, "-c", TCP_ECHO, str(server.getsockname()[1])])
    try:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(rounds):
            t = time.perf_counter()
            conn.sendall(b"x" * 300)
            conn.recv(4096)
            times.append(time.perf_counter() - t)
            if i % 2:
                time.sleep(0.001)  # some rounds find the other side asleep, as a service's do
        conn.close()
    finally:
        server.close()
        echo.wait(timeout=10)
    return round(statistics.median(times) * 1e6, 1)


NATS_ECHO = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg): await msg.respond(msg.data)
    await nc.subscribe("bench.echo", cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def nats_round_trip_us(url: str, rounds: int = 2000) -> float:
    """Median NATS request-reply (2,900 bytes: an admit command's size) between two nats-py
    processes through the stack's nats-server."""
    import nats
    echo = subprocess.Popen([sys.executable, "-c", NATS_ECHO, url], stdout=subprocess.PIPE, text=True)
    try:
        echo.stdout.readline()
        nc = await nats.connect(url)
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            await nc.request("bench.echo", b"x" * 2900, timeout=2)
            times.append(time.perf_counter() - t)
        await nc.close()
    finally:
        echo.kill()
        echo.wait()
    return round(statistics.median(times) * 1e6, 1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "path_cost.json"))
    args = p.parse_args()
    from transformers import AutoTokenizer

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        model_dir = Path(ensure_demo_model(data))
        prompt = visible_prompts(model_dir, AutoTokenizer.from_pretrained(model_dir),
                                 [args.length])[args.length]
        with running_stack(data, model_dir, {"SLINFER_KEEP_ALIVE_S": "600"},
                           plan=ProfilePlan(max_len=1024, max_batch=8)) as stack:
            result = asyncio.run(measure(stack, prompt, args.n))
            result["floors_us"] = {"loopback_tcp_round_trip": tcp_round_trip_us(),
                                   "nats_request_reply": asyncio.run(nats_round_trip_us(stack.nats_url))}
    result = {"command": "python bench/path_cost.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"), "load_average_before": load_before,
              "prompt_tokens": args.length, **result}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

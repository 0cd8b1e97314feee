"""The floor under the request path's overhead on this machine: the same process hops as a warm
streamed request (client -> HTTP server -> NATS request to a node -> the node's engine thread ->
a token message back over NATS -> one SSE chunk to the client), with nothing of slinfer's own in
them. A bare ASGI app under uvicorn (uvloop, httptools: the gateway's server), a bare nats-py
responder whose "prefill" is a sleep in a worker thread (`asyncio.to_thread`, as the node runs
its engine), a real nats-server.

    .venv/bin/python bench/path_floor.py [--n 200] [--prefill-ms 5 40]

Overhead is measured as `bench/e2e_overhead.py` measures it: the client's time to its first
chunk minus the prefill's own time (taken in the responder around the thread, and carried back
in the chunk). What is left over is the cost of the hops themselves: process wake-ups, socket
writes, Python's HTTP, NATS and asyncio layers. The gap between this and e2e_overhead's figure
is what slinfer adds. Two depths: `http` (the server answers at once: the HTTP hop and the
client alone) and `path` (the whole path above); and e2e_overhead's two clients, taking turns
request by request: the lean one and httpx. Writes bench/results/path_floor.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from lean_client import LeanClient  # noqa: E402

REQUEST_SUBJECT = "floor.admit"


async def responder(nats_url: str) -> None:
    """The node's part: answer the admission, run the prefill in a thread, publish a token."""
    import nats

    nc = await nats.connect(nats_url)
    tasks: set[asyncio.Task] = set()

    async def serve(msg) -> None:
        req = json.loads(msg.data)
        started = time.perf_counter()
        prefill = asyncio.ensure_future(asyncio.to_thread(time.sleep, req["prefill_s"]))
        await msg.respond(b"ok")
        await prefill
        elapsed = time.perf_counter() - started
        await nc.publish(req["reply_to"], json.dumps({"prefill_s": elapsed}).encode())

    async def on_request(msg) -> None:
        task = asyncio.create_task(serve(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(REQUEST_SUBJECT, cb=on_request)
    print("ready", flush=True)
    await asyncio.Event().wait()


def asgi_app(nats_url: str):
    """The gateway's part, as a bare ASGI app: read the body, subscribe to the request's token
    subject, ask the node, wait for the token, stream it as one SSE chunk."""
    import nats

    state: dict = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["nc"] = await nats.connect(nats_url)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await state["nc"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] != "POST":  # the readiness probe
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        nc = state["nc"]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        req = json.loads(body)
        if req["depth"] == "http":  # the HTTP hop alone: the chunk at once
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b'data: {"prefill_s": 0}\n\n',
                        "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                        "more_body": False})
            return
        inbox = nc.new_inbox()
        tokens: asyncio.Queue = asyncio.Queue()
        sub = await nc.subscribe(inbox, cb=tokens.put)
        await nc.request(REQUEST_SUBJECT, json.dumps({"prefill_s": req["prefill_s"],
                                                      "reply_to": inbox}).encode(), timeout=5)
        token = await tokens.get()
        await sub.unsubscribe()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: " + token.data + b"\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def serve_http(nats_url: str, port: int) -> None:
    import uvicorn

    uvicorn.run(asgi_app(nats_url), host="127.0.0.1", port=port, log_level="warning",
                lifespan="on")


def overhead(start: float, line: str) -> float | None:
    """The request's overhead once `line` is its first chunk (None before it)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return time.perf_counter() - start - json.loads(line[6:])["prefill_s"]


async def with_httpx(client, url: str, body: dict) -> float:
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if (seen := overhead(start, line)) is not None:
                return seen
    raise RuntimeError("no chunk")


async def with_lean(client: LeanClient, body: dict) -> float:
    start, seen = time.perf_counter(), None
    async for line in client.post_sse("/", body):  # (read to its end: the connection is reused)
        if seen is None:
            seen = overhead(start, line)
    if seen is None:
        raise RuntimeError("no chunk")
    return seen


async def measure(url: str, n: int, prefills: list[float]) -> dict[tuple, list[float]]:
    """(depth, prefill s, client) -> the overheads of n requests; the clients take turns."""
    import httpx

    cases = [("http", 0.0)] + [("path", p) for p in prefills]
    out: dict[tuple, list[float]] = {}
    async with httpx.AsyncClient(timeout=30) as client, LeanClient(url) as lean:
        for depth, prefill in cases:
            body = {"depth": depth, "prefill_s": prefill}
            for _ in range(5):  # connections, imports, the first subscription
                await with_httpx(client, url, body)
                await with_lean(lean, body)
            for i in range(n):
                for who in (("lean", "httpx") if i % 2 == 0 else ("httpx", "lean")):
                    seen = await (with_lean(lean, body) if who == "lean"
                                  else with_httpx(client, url, body))
                    out.setdefault((depth, prefill, who), []).append(seen)
                    await asyncio.sleep(0.02)  # as e2e_overhead's client does between requests
    return out


def run_role(role: str, nats_url: str, port: int) -> int:
    if role == "responder":
        asyncio.run(responder(nats_url))
    else:
        serve_http(nats_url, port)
    return 0


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url, timeout=0.5).raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--prefill-ms", type=float, nargs="+", default=[5.0, 40.0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "path_floor.json")
    p.add_argument("--role", choices=["responder", "http"], help=argparse.SUPPRESS)
    p.add_argument("--nats", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        return run_role(args.role, args.nats, args.port)
    from shared.servers import free_port, start_nats

    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats(Path(tmp))
        port = free_port()
        me = [sys.executable, __file__, "--nats", server.url, "--port", str(port)]
        children = [subprocess.Popen(me + ["--role", "responder"], stdout=subprocess.PIPE,
                                     text=True),
                    subprocess.Popen(me + ["--role", "http"])]
        try:
            assert children[0].stdout.readline().strip() == "ready"
            wait_ready(f"http://127.0.0.1:{port}/")
            raw = asyncio.run(measure(f"http://127.0.0.1:{port}/", args.n,
                                      [ms / 1e3 for ms in args.prefill_ms]))
        finally:
            for child in children:
                child.terminate()
                child.wait(timeout=10)
            server.stop()
    rows = [{"depth": depth, "prefill_ms": round(prefill * 1e3, 1), "client": who,
             "overhead_ms_p50": round(statistics.median(o) * 1e3, 2),
             "overhead_ms_p90": round(statistics.quantiles(o, n=10)[-1] * 1e3, 2)}
            for (depth, prefill, who), o in raw.items()]
    result = {"command": "python bench/path_floor.py " + " ".join(sys.argv[1:]), "n": args.n,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

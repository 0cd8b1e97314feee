"""The client side of the multi-host test, run inside one of its hosts (the test process sits in
the root namespace, which cannot reach the segment): it stores the model's profile, registers
the model, waits for the nodes, takes the fault-free references, multicasts the model from one
node to the other (λScale, across hosts), then sends a steady load and
records every token message on NATS until the test creates the stop file. Progress (completed
requests) goes to `<out>.progress` as it happens; everything else to `<out>` at the end (JSON).

    python -m tests.cluster.driver --gateway URL --key KEY --nats URLS --redis URL \
        --model NAME --model-dir DIR --profile FILE --nodes node-0,node-1 --out FILE --stop FILE
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import httpx

from shared.settings import nats_servers
from services.placer.multicast import multicast
from shared.bus import connect_nats
from shared.cluster import profile_from_json, save_profile
from shared.redis_client import open_redis
from tests.faults.load import PROMPTS, Load, Outcome, TokenRecorder, client_for, references

CLIENTS = 3
MAX_TOKENS = 24  # short answers: many requests cross each fault
LONG_TOKENS = 1500  # the request a drain moves: seconds long, so it is moved mid-way


async def prepare(a: argparse.Namespace) -> None:
    """The profile in Redis, the model registered, every node in the cluster view."""
    redis = open_redis(a.redis, timeout_s=5)
    try:
        await save_profile(redis, profile_from_json(Path(a.profile).read_text()))
    finally:
        await redis.aclose()
    auth = {"Authorization": f"Bearer {a.key}"}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        await _until_healthy(http, a.gateway)
        r = await http.post(f"{a.gateway}/admin/models", headers=auth, json={
            "name": a.model, "path": a.model_dir, "engine": "torch", "public": True,
            "slo_class": "batch"})
        r.raise_for_status()
        wanted = set(a.nodes.split(","))
        deadline = time.monotonic() + 180
        while True:
            r = await http.get(f"{a.gateway}/admin/nodes", headers=auth)
            if r.status_code == 200 and wanted <= {n["node_id"] for n in r.json()["data"]}:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(wanted)} never joined: {r.text}")
            await asyncio.sleep(0.5)


async def _until_healthy(http: httpx.AsyncClient, gateway: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await http.get(f"{gateway}/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway at {gateway} never became healthy")
        await asyncio.sleep(0.5)


async def run(a: argparse.Namespace) -> None:
    await prepare(a)
    refs = await references(a.gateway, a.model, a.key, MAX_TOKENS)
    scaleout = await _multicast(a)
    recorder = TokenRecorder(nats_servers(a.nats))
    await recorder.start()
    load = Load(a.gateway, a.model, clients=CLIENTS, timeout_s=120, api_key=a.key,
                max_tokens=MAX_TOKENS)
    load.start()
    long = asyncio.create_task(_long_request(a))
    print("ready", flush=True)
    progress = Path(f"{a.out}.progress")
    while not Path(a.stop).exists():
        progress.write_text(str(load.completed()))
        await asyncio.sleep(0.2)
    outcomes = await load.stop()
    long_outcome = await long
    await asyncio.sleep(1.0)  # the last token messages
    await recorder.close()
    Path(a.out).write_text(json.dumps({
        "refs": [[p, chat, text] for (p, chat), text in refs.items()],
        "outcomes": [dataclasses.asdict(o) for o in outcomes],
        "long": dataclasses.asdict(long_outcome) if long_outcome else None,
        "multicast": scaleout,
        "ran_twice": recorder.ran_twice(),
        # requests whose token messages came from more than one (attempt, node): moved or resumed
        "moved": {rid: path for rid in {m.request_id for m in recorder.messages}
                  if len(path := recorder.nodes_of(rid)) > 1},
    }))


async def _multicast(a: argparse.Namespace) -> dict:
    """λScale's transfer of the model from node-0 (h2) to node-1 (h3), over the TCP endpoints
    they advertise on the segment."""
    nc = await connect_nats(a.nats, "multihost-driver")
    try:
        report = await multicast(nc, a.model_dir, "node-0", ["node-1"], timeout_s=120)
    finally:
        await nc.close()
    (dest,) = report.destinations
    return {"ok": report.ok, "bytes": report.bytes, "seconds": report.seconds,
            "error": dest.error, "block_sources": sorted(set(dest.block_sources.values())),
            "blocks_received": len(dest.block_seconds)}


async def _drain_holder(a: argparse.Namespace, request_id: str) -> None:
    """Drain the node that holds `request_id` (as soon as the cluster view shows it); the node
    and the drain's answer go to `<out>.long.drain`."""
    auth = {"Authorization": f"Bearer {a.key}"}
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        deadline = time.monotonic() + 30
        while True:
            r = await http.get(f"{a.gateway}/admin/instances", headers=auth)
            holders = {i["node_id"] for i in r.json()["data"] if request_id in i["requests"]}
            if holders:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no node holds {request_id}")
            await asyncio.sleep(0.05)
        (node,) = holders
        r = await http.post(f"{a.gateway}/admin/nodes/{node}/drain", headers=auth)
    Path(f"{a.out}.long.drain").write_text(json.dumps({"node": node, "reply": r.json(),
                                                       "request_id": request_id}))


async def _long_request(a: argparse.Namespace) -> Outcome | None:
    """Once `<out>.long` exists: one streamed completion of LONG_TOKENS tokens whose node is
    drained as soon as its first token came (`_drain_holder`)."""
    trigger = Path(f"{a.out}.long")
    while not trigger.exists():
        if Path(a.stop).exists():
            return None
        await asyncio.sleep(0.1)
    client = client_for(a.gateway, 180, a.key)
    out = Outcome(-1, "a long one", False, True, time.monotonic(), 0.0)
    try:
        parts = []
        async for c in await client.completions.create(
                model=a.model, prompt=PROMPTS[0], max_tokens=LONG_TOKENS, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}):
            if out.request_id is None:
                drain = asyncio.create_task(_drain_holder(a, c.id))
            out.request_id = c.id
            if c.choices:
                parts.append(c.choices[0].text or "")
                out.finish = c.choices[0].finish_reason or out.finish
            if c.usage:
                out.tokens = c.usage.completion_tokens
        out.text = "".join(parts)
        await drain
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        await client.close()
    out.ended = time.monotonic()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("gateway", "key", "nats", "redis", "model", "model-dir", "profile", "nodes",
                 "out", "stop"):
        p.add_argument(f"--{flag}", required=True)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()

"""The client side of the multi-host test, run inside one of its hosts (the test process sits in
the root namespace, which cannot reach the segment): it stores the model's profile, registers
the model, waits for the nodes, takes the fault-free references, then sends a steady load and
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
from shared.cluster import profile_from_json, save_profile
from shared.redis_client import open_redis
from tests.faults.load import Load, TokenRecorder, references

CLIENTS = 3
MAX_TOKENS = 24  # short answers: many requests cross each fault


async def prepare(a: argparse.Namespace) -> None:
    """The profile in Redis, the model registered, every node in the cluster view."""
    redis = open_redis(a.redis, timeout_s=5)
    try:
        await save_profile(redis, profile_from_json(Path(a.profile).read_text()))
    finally:
        await redis.aclose()
    auth = {"Authorization": f"Bearer {a.key}"}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
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


async def run(a: argparse.Namespace) -> None:
    await prepare(a)
    refs = await references(a.gateway, a.model, a.key, MAX_TOKENS)
    recorder = TokenRecorder(nats_servers(a.nats))
    await recorder.start()
    load = Load(a.gateway, a.model, clients=CLIENTS, timeout_s=120, api_key=a.key,
                max_tokens=MAX_TOKENS)
    load.start()
    print("ready", flush=True)
    progress = Path(f"{a.out}.progress")
    while not Path(a.stop).exists():
        progress.write_text(str(load.completed()))
        await asyncio.sleep(0.2)
    outcomes = await load.stop()
    await asyncio.sleep(1.0)  # the last token messages
    await recorder.close()
    Path(a.out).write_text(json.dumps({
        "refs": [[p, chat, text] for (p, chat), text in refs.items()],
        "outcomes": [dataclasses.asdict(o) for o in outcomes],
        "ran_twice": recorder.ran_twice(),
    }))


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("gateway", "key", "nats", "redis", "model", "model-dir", "profile", "nodes",
                 "out", "stop"):
        p.add_argument(f"--{flag}", required=True)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()

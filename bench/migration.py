"""Live migration (token-based, multi-round; services/node/migration.py): the pause a client sees
(last token from the source A -> first token from the destination B) and the whole migration's
time, against the profile's estimate of a stop-and-resume migration, a*(t_in+t_out)+b
(Profile.migration_s: the destination re-prefills every token so far).

Two node workers with torch engines in this process (one CPU: A's decoding and B's catch-up share
its cores), real nats-server and valkey from the wheels. For each prompt length a request starts on
A, streams `--after` tokens, then A is told to migrate it to B, which loads the model for it (cold,
as a drain onto an empty node would be); once B streamed a few tokens the request is cancelled.
The model is profiled first (the nodes' admission needs the profile).

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/migration.py --shape small --prompts 256,1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from redis.asyncio import Redis  # noqa: E402

from bench.engines_cpu import machine  # noqa: E402
from services.node.settings import NodeSettings  # noqa: E402
from services.node.worker import NodeWorker  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from shared import wire  # noqa: E402
from shared.cluster import profile_from_json, profile_to_json, save_profile  # noqa: E402
from shared.core.config import CoreConfig  # noqa: E402
from shared.modelgen import SHAPES, ensure_model  # noqa: E402
from shared.registry import model_record_from_dir  # noqa: E402
from shared.schemas import (CancelNotice, CommandKind, InferenceRequest, NodeCommand,  # noqa: E402
                            NodeReply, TokenMessage)
from shared.servers import start_nats, start_redis  # noqa: E402
from shared.subjects import CANCEL_SUBJECT, node_command_subject, token_subject  # noqa: E402

MEMORY = 12 << 30
B_TOKENS = 5  # tokens streamed from B before the request is cancelled


def _settings(node_id: str) -> NodeSettings:
    return NodeSettings(node_id=node_id, hardware="cpu", device="cpu", memory_bytes=MEMORY,
                        matrix_accel=True, nats_url="", redis_url="",
                        core=CoreConfig(keep_alive_s=600.0), heartbeat_s=0.25, calibrate=False)


async def _warm(nc, b: NodeWorker, record) -> str:
    """An instance of the model on B, loaded by a short request: the migrations that follow
    measure the catch-up alone (the estimate has no load in it either)."""
    req = InferenceRequest(f"warm-{time.time_ns()}", "t", record.name, [5] * 8, 2, time.time(),
                           600.0, 30.0, temperature=0.0, ignore_eos=True)
    cmd = NodeCommand(CommandKind.ADMIT, request=req, instance_id=None, model=record)
    reply = wire.decode(NodeReply, (await nc.request(node_command_subject("mig-b"),
                                                     wire.encode(cmd), timeout=30)).data)
    assert reply.accepted, reply.reason
    while req.request_id in b.live:
        await asyncio.sleep(0.05)
    return reply.instance_id


async def _one(nc, a: NodeWorker, record, prompt_len: int, after: int, b_instance: str | None) -> dict:
    # Onto A's instance once it has one: a second instance of a real-size model with its KV sized
    # for the model's whole context does not fit beside the first (and is not what is measured).
    a_instance = next((i.instance_id for i in a.sched.node.instances
                       if i.model.name == record.name), None)
    rid = f"mig-{prompt_len}-{time.time_ns()}"
    max_tokens = min(4096, record.max_context - prompt_len - 1)  # cancelled well before that
    req = InferenceRequest(rid, "t", record.name, [5 + (i % 1000) for i in range(prompt_len)],
                           max_tokens, time.time(), 3600.0, 30.0, temperature=0.0, ignore_eos=True)
    arrivals: list[tuple[float, str, int]] = []  # (time, node, tokens) per token message
    done = asyncio.Event()

    async def on_token(msg):
        m = wire.decode(TokenMessage, msg.data)
        if m.token_ids:
            arrivals.append((time.time(), m.node_id, len(m.token_ids)))
        if m.finished:
            done.set()

    sub = await nc.subscribe(token_subject(rid), cb=on_token)
    cmd = NodeCommand(CommandKind.ADMIT, request=req, instance_id=a_instance, model=record)
    reply = wire.decode(NodeReply, (await nc.request(node_command_subject("mig-a"),
                                                     wire.encode(cmd), timeout=30)).data)
    assert reply.accepted, reply.reason
    while sum(n for _, node, n in arrivals) < after:
        await asyncio.sleep(0.005)
    log = await a.migrate_out(rid, "mig-b", b_instance)
    assert log.ok, log.reason
    while sum(n for _, node, n in arrivals if node == "mig-b") < B_TOKENS:
        await asyncio.sleep(0.005)
    await nc.publish(CANCEL_SUBJECT, wire.encode(CancelNotice(rid, "benchmark done")))
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    last_a = max(t for t, node, _ in arrivals if node == "mig-a")
    first_b = min(t for t, node, _ in arrivals if node == "mig-b")
    a_times = [t for t, node, _ in arrivals if node == "mig-a"]
    gaps = [y - x for x, y in zip(a_times, a_times[1:])]
    return {"prompt_tokens": prompt_len, "context_at_begin": log.context_tokens,
            "pause_s": first_b - last_a, "total_s": log.total_s, "begin_s": log.begin_s,
            "rounds": [{"tokens": n, "seconds": s} for n, s in log.rounds],
            "commit_s": log.commit_s, "tokens_from_a": sum(n for _, node, n in arrivals if node == "mig-a"),
            "a_median_token_gap_s": statistics.median(gaps) if gaps else None}


async def run(shape: str, prompts: list[int], after: int, repeats: int, cold: bool,
              profile_path: Path | None) -> dict:
    model_dir = ensure_model(ROOT / ".data", shape, shape)
    record = model_record_from_dir(shape, model_dir)
    started = time.perf_counter()
    if profile_path is not None and profile_path.exists():  # a 1B profile takes ~20 min here
        profile = profile_from_json(profile_path.read_text())
    else:
        plan = ProfilePlan(max_len=min(max(prompts) + 512, record.max_context - 1), max_batch=1,
                           repeats=1, passes=1)
        profile = profile_model(model_dir, shape, plan=plan)[0]
        if profile_path is not None:
            profile_path.parent.mkdir(parents=True, exist_ok=True)
            profile_path.write_text(profile_to_json(profile))
    profile_s = time.perf_counter() - started
    tmp = Path(tempfile.mkdtemp(prefix="slinfer-mig-"))
    nats_server, redis_server = start_nats(tmp / "nats"), start_redis(tmp / "redis")
    nc = await nats.connect(nats_server.url)
    redis = Redis.from_url(redis_server.url)
    await save_profile(redis, replace(profile, model=record.name))
    a, b = NodeWorker(_settings("mig-a"), nc, redis), NodeWorker(_settings("mig-b"), nc, redis)
    await a.start()
    await b.start()
    results = []
    try:
        b_instance = None if cold else await _warm(nc, b, record)
        for prompt_len in prompts:
            for _ in range(repeats):
                row = await _one(nc, a, record, prompt_len, after, b_instance)
                row["estimate_s"] = profile.migration_s(row["context_at_begin"])
                row["destination"] = "cold (B loads the model)" if cold else "warm instance on B"
                results.append(row)
                print(json.dumps(row), flush=True)
                if cold:  # unload B's instance: the next run loads again
                    await _reset_b(b)
    finally:
        await a.stop()
        await b.stop()
        await nc.close()
        await redis.aclose()
        nats_server.stop()
        redis_server.stop()
    return {"shape": shape, "profile_s": profile_s, "after_tokens": after, "policy": vars(a.migration_policy),
            "prefill_table": {"lengths": profile.prefill.lengths, "seconds": profile.prefill.seconds},
            "results": results}


async def _reset_b(b: NodeWorker) -> None:
    """Unload B's instances, so the next migration loads the model again (a cold destination)."""
    ops = b.sched.preempt([i.instance_id for i in b.sched.node.instances], time.time())[1]
    b._start_ops(ops)
    deadline = time.monotonic() + 60
    while b.sched.node.instances and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=SHAPES)
    p.add_argument("--prompts", default="256,1024")
    p.add_argument("--after", type=int, default=16, help="tokens A streams before the migration")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="B loads the model for each migration")
    p.add_argument("--out", default=str(ROOT / "bench/results/migration.json"))
    p.add_argument("--profile", type=Path, default=None,
                   help="reuse the profile stored at this path (measured and stored there if absent)")
    args = p.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    load_before = os.getloadavg()
    result = asyncio.run(run(args.shape, prompts, args.after, args.repeats, args.cold,
                             args.profile))
    result["machine"] = {**machine(), "load_average_before": load_before,
                         "load_average_after": os.getloadavg()}
    result["command"] = "python bench/migration.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[args.shape + ("-cold" if args.cold else "")] = result  # one entry per shape and mode
    out.write_text(json.dumps(previous, indent=1) + "\n")


if __name__ == "__main__":
    main()

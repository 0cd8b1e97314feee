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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402

from bench.engines_cpu import machine  # noqa: E402
from services.node.settings import NodeSettings  # noqa: E402
from services.node.worker import NodeWorker  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from shared import wire  # noqa: E402
from shared.bus import connect_nats  # noqa: E402
from shared.cluster import profile_from_json, profile_to_json, save_profile  # noqa: E402
from shared.core.config import CoreConfig  # noqa: E402
from shared.core.perf_model import Profile  # noqa: E402
from shared.modelgen import SHAPES, ensure_model  # noqa: E402
from shared.redis_client import open_redis  # noqa: E402
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


async def admit(nc, node_id: str, req: InferenceRequest, record, instance_id: str | None) -> str:
    """Admit `req` on the node, as the placer would (onto `instance_id`, else onto a new instance
    of `record`): the instance it runs on."""
    cmd = NodeCommand(CommandKind.ADMIT, request=req, instance_id=instance_id,
                      model=None if instance_id else record)
    reply = wire.decode(NodeReply, (await nc.request(node_command_subject(node_id),
                                                     wire.encode(cmd), timeout=60)).data)
    assert reply.accepted, reply.reason
    return reply.instance_id


async def _warm(nc, b: NodeWorker, record) -> str:
    """An instance of the model on B, loaded by a short request: the migrations that follow
    measure the catch-up alone (the estimate has no load in it either)."""
    req = InferenceRequest(f"warm-{time.time_ns()}", "t", record.name, [5] * 8, 2, time.time(),
                           600.0, 30.0, temperature=0.0, ignore_eos=True)
    instance = await admit(nc, "mig-b", req, record, None)
    while req.request_id in b.live:
        await asyncio.sleep(0.05)
    return instance


class TokenArrivals:
    """Token arrivals per request, from its real token subject: (time, node, tokens) per token
    message. Shared by this benchmark and bench/preempt_migration.py (the same pause, measured
    after a migration that a drain or a preemption started)."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.arrivals: dict[str, list[tuple[float, str, int]]] = {}
        self.finished: dict[str, asyncio.Event] = {}
        self._subs: dict[str, object] = {}

    async def watch(self, rid: str) -> None:
        self.arrivals[rid], self.finished[rid] = [], asyncio.Event()

        async def on_token(msg, rid=rid):
            m = wire.decode(TokenMessage, msg.data)
            if m.token_ids:
                self.arrivals[rid].append((time.time(), m.node_id, len(m.token_ids)))
            if m.finished:
                self.finished[rid].set()

        self._subs[rid] = await self.nc.subscribe(token_subject(rid), cb=on_token)

    def count(self, rid: str, node: str | None = None, before: float | None = None) -> int:
        """Tokens of `rid` (from `node`; that arrived before `before`) so far."""
        return sum(n for t, where, n in self.arrivals[rid]
                   if (node is None or where == node) and (before is None or t < before))

    def pause(self, rid: str, source: str, destination: str) -> dict:
        """What the client of a migrated request saw: the pause from its last token from `source`
        to its first from `destination`, and its median gap between tokens from `source`."""
        arrivals = self.arrivals[rid]
        from_source = [t for t, node, _ in arrivals if node == source]
        first_dest = min(t for t, node, _ in arrivals if node == destination)
        gaps = [y - x for x, y in zip(from_source, from_source[1:])]
        return {"pause_s": first_dest - max(from_source),
                "a_median_token_gap_s": statistics.median(gaps) if gaps else None}

    async def cancel(self, rids: list[str] | None = None, wait_s: float = 0.0) -> None:
        """Cancel these requests (default: every one watched); with `wait_s`, wait that long at
        most for each one's final message. Their token subjects are then left."""
        rids = list(self.arrivals) if rids is None else rids
        for rid in rids:
            await self.nc.publish(CANCEL_SUBJECT, wire.encode(CancelNotice(rid, "benchmark done")))
        if wait_s:
            for rid in rids:
                await asyncio.wait_for(self.finished[rid].wait(), wait_s)
        for rid in rids:
            sub = self._subs.pop(rid, None)
            if sub is not None:
                await sub.unsubscribe()


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.005)


def stored_or_measured_profile(model_dir: Path, name: str, plan: ProfilePlan,
                               path: Path | None) -> tuple[Profile, float]:
    """The profile stored at `path`, else measured with `plan` (and stored there): a real-size
    model's profile takes many minutes here. With the seconds it took."""
    started = time.perf_counter()
    if path is not None and path.exists():
        return profile_from_json(path.read_text()), time.perf_counter() - started
    profile = profile_model(model_dir, name, plan=plan)[0]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(profile_to_json(profile))
    return profile, time.perf_counter() - started


@asynccontextmanager
async def bench_servers(prefix: str) -> AsyncIterator[tuple[tuple[str, str], object, Redis]]:
    """A real nats-server and valkey of the run's own: ((nats url, redis url), nats, redis)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    nats_server = start_nats(tmp / "nats")
    try:
        redis_server = start_redis(tmp / "redis")
        try:
            nc = await connect_nats(nats_server.url, "bench-migration")
            redis = open_redis(redis_server.url)
            try:
                yield (nats_server.url, redis_server.url), nc, redis
            finally:
                await nc.close()
                await redis.aclose()
        finally:
            redis_server.stop()
    finally:
        nats_server.stop()


def write_result(out: Path, key: str, result: dict, script: str, load_before: tuple) -> None:
    """`result` under `key` in `out` (one entry per shape and mode, the others kept), with the
    machine, the load around the run and the command."""
    result["machine"] = {**machine(), "load_average_before": load_before,
                         "load_average_after": os.getloadavg()}
    result["command"] = f"python bench/{script} " + " ".join(sys.argv[1:])
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[key] = result
    out.write_text(json.dumps(previous, indent=1) + "\n")


async def _one(nc, a: NodeWorker, record, prompt_len: int, after: int, b_instance: str | None) -> dict:
    # Onto A's instance once it has one: a second instance of a real-size model with its KV sized
    # for the model's whole context does not fit beside the first (and is not what is measured).
    a_instance = next((i.instance_id for i in a.sched.node.instances
                       if i.model.name == record.name), None)
    rid = f"mig-{prompt_len}-{time.time_ns()}"
    max_tokens = min(4096, record.max_context - prompt_len - 1)  # cancelled well before that
    req = InferenceRequest(rid, "t", record.name, [5 + (i % 1000) for i in range(prompt_len)],
                           max_tokens, time.time(), 3600.0, 30.0, temperature=0.0, ignore_eos=True)
    streams = TokenArrivals(nc)
    await streams.watch(rid)
    await admit(nc, "mig-a", req, record, a_instance)
    await until(lambda: streams.count(rid) >= after, 600, "A's tokens")
    log = await a.migrate_out(rid, "mig-b", b_instance)
    assert log.ok, log.reason
    await until(lambda: streams.count(rid, "mig-b") >= B_TOKENS, 600, "B's tokens")
    await streams.cancel([rid], wait_s=60)
    return {"prompt_tokens": prompt_len, "context_at_begin": log.context_tokens,
            **streams.pause(rid, "mig-a", "mig-b"), "total_s": log.total_s, "begin_s": log.begin_s,
            "rounds": [{"tokens": n, "seconds": s} for n, s in log.rounds],
            "commit_s": log.commit_s, "tokens_from_a": streams.count(rid, "mig-a")}


async def run(shape: str, prompts: list[int], after: int, repeats: int, cold: bool,
              profile_path: Path | None) -> dict:
    model_dir = ensure_model(ROOT / ".data", shape, shape)
    record = model_record_from_dir(shape, model_dir)
    plan = ProfilePlan(max_len=min(max(prompts) + 512, record.max_context - 1), max_batch=1,
                       repeats=1, passes=1)
    profile, profile_s = stored_or_measured_profile(model_dir, shape, plan, profile_path)
    results = []
    async with bench_servers("slinfer-mig-") as (_, nc, redis):
        await save_profile(redis, replace(profile, model=record.name))
        a, b = NodeWorker(_settings("mig-a"), nc, redis), NodeWorker(_settings("mig-b"), nc, redis)
        await a.start()
        await b.start()
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
    return {"shape": shape, "profile_s": profile_s, "after_tokens": after, "policy": vars(a.migration_policy),
            "prefill_table": {"lengths": profile.prefill.lengths, "seconds": profile.prefill.seconds},
            "results": results}


async def _reset_b(b: NodeWorker) -> None:
    """Unload B's instances, so the next migration loads the model again (a cold destination)."""
    ops = b.sched.preempt([i.instance_id for i in b.sched.node.instances], time.time())[1]
    b.rt.start_ops(ops)
    deadline = time.monotonic() + 60
    while b.sched.node.instances and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def arguments(doc: str, out: str, prompts_help: str) -> argparse.ArgumentParser:
    """The options this benchmark and bench/preempt_migration.py share."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=SHAPES)
    p.add_argument("--prompts", default="256,1024", help=prompts_help)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench/results" / out))
    p.add_argument("--profile", type=Path, default=None,
                   help="reuse the profile stored at this path (measured and stored there if absent)")
    return p


def main() -> None:
    p = arguments(__doc__, "migration.json", "the migrated request's prompt lengths")
    p.add_argument("--after", type=int, default=16, help="tokens A streams before the migration")
    p.add_argument("--cold", action="store_true", help="B loads the model for each migration")
    args = p.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    load_before = os.getloadavg()
    result = asyncio.run(run(args.shape, prompts, args.after, args.repeats, args.cold,
                             args.profile))
    write_result(Path(args.out), args.shape + ("-cold" if args.cold else ""), result,
                 "migration.py", load_before)


if __name__ == "__main__":
    main()

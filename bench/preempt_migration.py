"""Preemption carried out by live migration vs stop-and-resume (SLINFER §VIII-A with
ServerlessLLM §5): the pause the victim's client sees, and what the newcomer pays for it.

The scenario of tests/node/test_preemption.py, on real services: node A holds two requests of
model alpha (the preemptor) and one long request of beta (the smaller neighbour, the victim), with
memory for exactly that; node B holds an instance of beta. A newcomer for alpha needs alpha's KV
cache to grow, so the real placer plans a preemption of beta on A, its request moving to B's beta
instance. With `live_preemption` the plan is carried out live (the victim keeps streaming on A
while B recomputes its KV cache; the newcomer's instance waits for the handover); without it,
stop-and-resume (beta is unloaded at once, its request goes back through the request stream and
B re-prefills it while the stream is stopped).

Measured per run: the victim's **pause** (arrival of its last token from A -> its first token
from B), the victim's tokens from A after the preemption decision, and the newcomer's TTFT (its
publish -> its first token). Two node workers and the placer in this process (one CPU: the
nodes share its cores), real nats-server and valkey from the wheels; the model is profiled
first (admission needs the profile; `--profile` reuses a stored one).

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/preempt_migration.py --shape small
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
from services.placer.placer import Placer  # noqa: E402
from services.placer.settings import PlacerSettings  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from shared import wire  # noqa: E402
from shared.bus import ensure_streams  # noqa: E402
from shared.cluster import (model_spec, profile_from_json, profile_to_json, request_view,  # noqa: E402
                            save_profile)
from shared.core.config import CoreConfig  # noqa: E402
from shared.core.memory import kv_demand, watermark_target  # noqa: E402
from shared.modelgen import SHAPES, ensure_model  # noqa: E402
from shared.registry import ModelRegistry, model_record_from_dir  # noqa: E402
from shared.schemas import (CancelNotice, CommandKind, InferenceRequest, NodeCommand,  # noqa: E402
                            NodeReply, TokenMessage)
from shared.servers import start_nats, start_redis  # noqa: E402
from shared.subjects import (CANCEL_SUBJECT, REQUEST_SUBJECT, node_command_subject,  # noqa: E402
                             token_subject)

ALPHA_PROMPT, ALPHA_OUT = 900, 250  # three such prompts need more KV than the 2048-token floor
VICTIM_OUT = 4000  # the victim outlives the preemption (cancelled once B streamed a few tokens)
BEFORE = 16  # tokens the victim streams on A before the newcomer arrives
B_TOKENS = 5  # tokens the victim streams from B before it is cancelled


class Streams:
    """Token arrivals per request: (time, node, tokens) per token message."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.arrivals: dict[str, list[tuple[float, str, int]]] = {}

    async def watch(self, rid: str) -> None:
        self.arrivals[rid] = []

        async def on_token(msg, rid=rid):
            m = wire.decode(TokenMessage, msg.data)
            if m.token_ids:
                self.arrivals[rid].append((time.time(), m.node_id, len(m.token_ids)))

        await self.nc.subscribe(token_subject(rid), cb=on_token)

    def count(self, rid: str, node: str | None = None) -> int:
        return sum(n for _, where, n in self.arrivals[rid] if node is None or where == node)


def _request(model: str, prompt: int, out: int) -> InferenceRequest:
    rid = f"{model}-{time.time_ns()}"
    return InferenceRequest(rid, "t", model, [5 + (i % 1000) for i in range(prompt)], out,
                            time.time(), 60.0, 30.0, temperature=0.0, ignore_eos=True)


def _kv_after(record, reqs) -> int:
    """The KV size an instance has once these requests joined it one by one (§VII-B)."""
    spec, kv = model_spec(record), 0
    for k in range(1, len(reqs) + 1):
        need = kv_demand(spec, [request_view(r) for r in reqs[:k]])
        kv = max(kv, watermark_target(kv, need, CoreConfig().watermark) or kv)
    return kv


def _settings(node_id: str, memory: int, core: CoreConfig) -> NodeSettings:
    return NodeSettings(node_id=node_id, hardware="cpu", device="cpu", memory_bytes=memory,
                        matrix_accel=True, nats_url="", redis_url="", core=core, heartbeat_s=0.05,
                        calibrate=False)


async def _admit(nc, node: str, req: InferenceRequest, record, instance: str | None) -> str:
    cmd = NodeCommand(CommandKind.ADMIT, request=req, instance_id=instance,
                      model=None if instance else record)
    reply = wire.decode(NodeReply, (await nc.request(node_command_subject(node), wire.encode(cmd),
                                                     timeout=60)).data)
    assert reply.accepted, reply.reason
    return reply.instance_id


async def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.005)


async def _one(nc, redis, urls, records: dict, live: bool, victim_prompt: int, run: int) -> dict:
    core = CoreConfig(keep_alive_s=60.0, live_preemption=live)
    alpha, beta = records["alpha"], records["beta"]
    alphas = [_request("alpha", ALPHA_PROMPT, ALPHA_OUT) for _ in range(2)]
    victim = _request("beta", victim_prompt, min(VICTIM_OUT, beta.max_context - victim_prompt - 1))
    memory = alpha.weight_bytes + beta.weight_bytes + _kv_after(alpha, alphas) + _kv_after(beta, [victim])
    a_id, b_id = f"pa-{run}", f"pb-{run}"
    a = NodeWorker(_settings(a_id, memory + 64 * 1024, core), nc, redis)
    b = NodeWorker(_settings(b_id, 2 * memory, core), nc, redis)
    placer = Placer(PlacerSettings(*urls, core), nc, redis)
    stop = asyncio.Event()
    streams = Streams(nc)
    await a.start()
    await b.start()
    runner = None
    try:
        for r in (*alphas, victim):
            await streams.watch(r.request_id)
        inst = await _admit(nc, a_id, alphas[0], alpha, None)
        await _admit(nc, a_id, alphas[1], alpha, inst)
        await _admit(nc, a_id, victim, beta, None)
        b_beta = _request("beta", 64, min(VICTIM_OUT, beta.max_context - 65))
        await _admit(nc, b_id, b_beta, beta, None)
        vid = victim.request_id
        await _until(lambda: streams.count(vid) >= BEFORE, 120, "the victim to stream")
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        newcomer = _request("alpha", ALPHA_PROMPT, 8)
        await streams.watch(newcomer.request_id)
        published = time.time()
        await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(newcomer),
                                     headers={"Nats-Msg-Id": newcomer.request_id})
        await _until(lambda: streams.count(newcomer.request_id) >= 1, 300, "the newcomer's token")
        await _until(lambda: streams.count(vid, b_id) >= B_TOKENS, 300, "the victim on B")
        arrivals = streams.arrivals[vid]
        last_a = max(t for t, node, _ in arrivals if node == a_id)
        first_b = min(t for t, node, _ in arrivals if node == b_id)
        a_times = [t for t, node, _ in arrivals if node == a_id]
        gaps = [y - x for x, y in zip(a_times, a_times[1:])]
        log = next((m for m in a.migrations if m.request_id == vid), None)
        assert placer.decisions.get("preempt_and_route") == 1, placer.decisions
        assert (log is not None and log.ok) == live, (live, log)
        return {"mode": "live" if live else "stop-and-resume", "victim_prompt": victim_prompt,
                "context_at_preemption": victim_prompt + sum(n for t, _, n in arrivals if t < published),
                "pause_s": first_b - last_a,
                "victim_tokens_from_a_after_newcomer": sum(n for t, node, n in arrivals
                                                           if node == a_id and t >= published),
                "newcomer_ttft_s": streams.arrivals[newcomer.request_id][0][0] - published,
                "a_median_token_gap_s": statistics.median(gaps) if gaps else None,
                "migration_total_s": log.total_s if log else None,
                "migration_begin_s": log.begin_s if log else None}
    finally:
        stop.set()
        if runner is not None:
            await runner
        for rid in list(streams.arrivals):
            await nc.publish(CANCEL_SUBJECT, wire.encode(CancelNotice(rid, "benchmark done")))
        await a.stop()
        await b.stop()


async def run(shape: str, prompts: list[int], repeats: int, profile_path: Path | None,
              data_dir: Path) -> dict:
    model_dir = ensure_model(data_dir, shape, shape)
    records = {m: model_record_from_dir(m, model_dir) for m in ("alpha", "beta")}
    started = time.perf_counter()
    if profile_path is not None and profile_path.exists():
        profile = profile_from_json(profile_path.read_text())
    else:
        plan = ProfilePlan(max_len=min(max(prompts) + 512, records["alpha"].max_context - 1),
                           max_batch=4, repeats=1, passes=1)
        profile = profile_model(model_dir, shape, plan=plan)[0]
        if profile_path is not None:
            profile_path.parent.mkdir(parents=True, exist_ok=True)
            profile_path.write_text(profile_to_json(profile))
    profile_s = time.perf_counter() - started
    tmp = Path(tempfile.mkdtemp(prefix="slinfer-preempt-"))
    nats_server, redis_server = start_nats(tmp / "nats"), start_redis(tmp / "redis")
    nc = await nats.connect(nats_server.url)
    redis = Redis.from_url(redis_server.url)
    await ensure_streams(nc.jetstream())
    for name, record in records.items():
        await ModelRegistry(redis).register(record, replace=True)
        await save_profile(redis, replace(profile, model=name))
    results = []
    try:
        run_id = 0
        for prompt in prompts:
            for _ in range(repeats):
                for live in (True, False):
                    run_id += 1
                    row = await _one(nc, redis, (nats_server.url, redis_server.url), records, live,
                                     prompt, run_id)
                    row["estimate_s"] = profile.migration_s(row["context_at_preemption"])
                    results.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        await nc.close()
        await redis.aclose()
        nats_server.stop()
        redis_server.stop()
    return {"shape": shape, "profile_s": profile_s, "results": results,
            "prefill_table": {"lengths": profile.prefill.lengths, "seconds": profile.prefill.seconds}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=SHAPES)
    p.add_argument("--prompts", default="256,1024", help="the victim's prompt lengths")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--data-dir", type=Path, default=ROOT / ".data")
    p.add_argument("--out", default=str(ROOT / "bench/results/preempt_migration.json"))
    p.add_argument("--profile", type=Path, default=None,
                   help="reuse the profile stored at this path (measured and stored there if absent)")
    args = p.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    load_before = os.getloadavg()
    result = asyncio.run(run(args.shape, prompts, args.repeats, args.profile, args.data_dir))
    result["machine"] = {**machine(), "load_average_before": load_before,
                         "load_average_after": os.getloadavg()}
    result["command"] = "python bench/preempt_migration.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[args.shape] = result
    out.write_text(json.dumps(previous, indent=1) + "\n")


if __name__ == "__main__":
    main()

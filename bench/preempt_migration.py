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

import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.migration import (TokenArrivals, admit, arguments, bench_servers,  # noqa: E402
                             stored_or_measured_profile, until, write_result)
from services.node.settings import NodeSettings  # noqa: E402
from services.node.worker import NodeWorker  # noqa: E402
from services.placer.placer import Placer  # noqa: E402
from services.placer.settings import PlacerSettings  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from shared import wire  # noqa: E402
from shared.bus import ensure_streams  # noqa: E402
from shared.cluster import model_spec, request_view, save_profile  # noqa: E402
from shared.core.config import CoreConfig  # noqa: E402
from shared.core.cost import kv_demand  # noqa: E402
from shared.core.memory import watermark_target  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402
from shared.registry import ModelRegistry, model_record_from_dir  # noqa: E402
from shared.schemas import InferenceRequest  # noqa: E402
from shared.subjects import REQUEST_SUBJECT  # noqa: E402

ALPHA_PROMPT, ALPHA_OUT = 900, 250  # three such prompts need more KV than the 2048-token floor
VICTIM_OUT = 4000  # the victim outlives the preemption (cancelled once B streamed a few tokens)
BEFORE = 16  # tokens the victim streams on A before the newcomer arrives
B_TOKENS = 5  # tokens the victim streams from B before it is cancelled


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
    streams = TokenArrivals(nc)
    await a.start()
    await b.start()
    runner = None
    try:
        for r in (*alphas, victim):
            await streams.watch(r.request_id)
        inst = await admit(nc, a_id, alphas[0], alpha, None)
        await admit(nc, a_id, alphas[1], alpha, inst)
        await admit(nc, a_id, victim, beta, None)
        b_beta = _request("beta", 64, min(VICTIM_OUT, beta.max_context - 65))
        await admit(nc, b_id, b_beta, beta, None)
        vid = victim.request_id
        await until(lambda: streams.count(vid) >= BEFORE, 120, "the victim to stream")
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        newcomer = _request("alpha", ALPHA_PROMPT, 8)
        await streams.watch(newcomer.request_id)
        published = time.time()
        await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(newcomer),
                                     headers={"Nats-Msg-Id": newcomer.request_id})
        await until(lambda: streams.count(newcomer.request_id) >= 1, 300, "the newcomer's token")
        await until(lambda: streams.count(vid, b_id) >= B_TOKENS, 300, "the victim on B")
        log = next((m for m in a.migrations if m.request_id == vid), None)
        assert placer.decisions.get("preempt_and_route") == 1, placer.decisions
        assert (log is not None and log.ok) == live, (live, log)
        return {"mode": "live" if live else "stop-and-resume", "victim_prompt": victim_prompt,
                "context_at_preemption": victim_prompt + streams.count(vid, before=published),
                **streams.pause(vid, a_id, b_id),
                "victim_tokens_from_a_after_newcomer": streams.count(vid, a_id) -
                streams.count(vid, a_id, before=published),
                "newcomer_ttft_s": streams.arrivals[newcomer.request_id][0][0] - published,
                "migration_total_s": log.total_s if log else None,
                "migration_begin_s": log.begin_s if log else None}
    finally:
        stop.set()
        if runner is not None:
            await runner
        await streams.cancel()
        await a.stop()
        await b.stop()


async def run(shape: str, prompts: list[int], repeats: int, profile_path: Path | None,
              data_dir: Path) -> dict:
    model_dir = ensure_model(data_dir, shape, shape)
    records = {m: model_record_from_dir(m, model_dir) for m in ("alpha", "beta")}
    plan = ProfilePlan(max_len=min(max(prompts) + 512, records["alpha"].max_context - 1),
                       max_batch=4, repeats=1, passes=1)
    profile, profile_s = stored_or_measured_profile(model_dir, shape, plan, profile_path)
    results = []
    async with bench_servers("slinfer-preempt-") as (urls, nc, redis):
        await ensure_streams(nc.jetstream())
        for name, record in records.items():
            await ModelRegistry(redis).register(record, replace=True)
            await save_profile(redis, replace(profile, model=name))
        run_id = 0
        for prompt in prompts:
            for _ in range(repeats):
                for live in (True, False):
                    run_id += 1
                    row = await _one(nc, redis, urls, records, live, prompt, run_id)
                    row["estimate_s"] = profile.migration_s(row["context_at_preemption"])
                    results.append(row)
                    print(json.dumps(row), flush=True)
    return {"shape": shape, "profile_s": profile_s, "results": results,
            "prefill_table": {"lengths": profile.prefill.lengths, "seconds": profile.prefill.seconds}}


def main() -> None:
    p = arguments(__doc__, "preempt_migration.json", "the victim's prompt lengths")
    p.add_argument("--data-dir", type=Path, default=ROOT / ".data")
    args = p.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    load_before = os.getloadavg()
    result = asyncio.run(run(args.shape, prompts, args.repeats, args.profile, args.data_dir))
    write_result(Path(args.out), args.shape, result, "preempt_migration.py", load_before)


if __name__ == "__main__":
    main()

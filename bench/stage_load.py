"""CoCoServe's host compute on real processes: the share of a host's time a moved layers' stage
takes while its owner's request streams, as the host measures and reports it
(`NodeView.stage_load`, services/node/layer_moves.py), against the k/L ceiling the planner used
to assume and the prediction it makes now (the owner's measured busy fraction times the stage's
share of a step, `module_scaling.predicted_load`).

Two node workers in this process (torch engines, one CPU: their work shares its cores), real
nats-server and valkey. A runs an instance with one streaming request; B hosts the second half
of its layers (HOST_LAYERS with the ceiling as the planned load) and A sheds them there
(SHED_LAYERS), as the placer's plan would. Then every `--sample` seconds for `--serve` seconds:
B's reported stage load, its meter, A's instance's busy fraction; then the request is cancelled
and B is sampled for `--idle` seconds more. The nodes' measurement window is `--window`. The
profile is a stand-in (admission only: nothing measured here depends on it).

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/stage_load.py --shape small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Before torch starts OpenMP: the owner waits for its stage and the stage for the owner; idle
# OpenMP threads must not spin on the cores the other computes on (see bench/modules.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.migration import TokenArrivals, admit, bench_servers, until, write_result  # noqa: E402
from services.node.settings import NodeSettings  # noqa: E402
from services.node.worker import NodeWorker  # noqa: E402
from shared import wire  # noqa: E402
from shared.cluster import model_spec, save_profile  # noqa: E402
from shared.core.config import CoreConfig  # noqa: E402
from shared.core.cost import layer_weight_bytes  # noqa: E402
from shared.core.modules import stage_key  # noqa: E402
from shared.core.perf_model import DecodeTable, PrefillTable, Profile  # noqa: E402
from shared.core.types import Hardware  # noqa: E402
from shared.modelgen import SHAPES, ensure_model  # noqa: E402
from shared.registry import model_record_from_dir  # noqa: E402
from shared.schemas import CommandKind, InferenceRequest, NodeCommand, NodeReply  # noqa: E402
from shared.subjects import node_command_subject  # noqa: E402

MEMORY = 12 << 30
PROMPT = 64


def _settings(node_id: str, window_s: float) -> NodeSettings:
    return NodeSettings(node_id=node_id, hardware="cpu", device="cpu", memory_bytes=MEMORY,
                        matrix_accel=True, nats_url="", redis_url="",
                        core=CoreConfig(keep_alive_s=600.0, busy_window_s=window_s),
                        heartbeat_s=0.1, calibrate=False)


def _stand_in(name: str) -> Profile:
    return Profile(name, Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]),
                   load_s=0.5, engine_init_s=0.05)


async def _command(nc, node_id: str, cmd: NodeCommand) -> NodeReply:
    msg = await nc.request(node_command_subject(node_id), wire.encode(cmd), timeout=120)
    reply = wire.decode(NodeReply, msg.data)
    assert reply.accepted, f"{cmd.kind.value}: {reply.reason}"
    return reply


def _sample(a: NodeWorker, b: NodeWorker, iid: str, key: str, started: float) -> dict:
    now = time.time()
    inst = a.sched.node.instance(iid)
    hosted = b.layers.host.get(key)
    return {"t": round(now - started, 2), "reported": b.sched.node.stage_load,
            "measured": b.layers.measured(key, now),
            "owner_busy": inst.busy.fraction(now) if inst is not None and inst.busy else None,
            "forward_s": hosted.server.stage.forward_s if hosted is not None else None}


async def run(shape: str, window_s: float, serve_s: float, idle_s: float, sample_s: float) -> dict:
    model_dir = ensure_model(ROOT / ".data", shape, shape)
    record = model_record_from_dir(shape, model_dir)
    spec = model_spec(record)
    start, end = spec.layers // 2, spec.layers
    ceiling = (end - start) / spec.layers  # k/L: the share of a step's layers the stage runs
    async with bench_servers("slinfer-stage-load-") as (_, nc, redis):
        await save_profile(redis, _stand_in(record.name))
        a, b = (NodeWorker(_settings(n, window_s), nc, redis) for n in ("load-a", "load-b"))
        await a.start()
        await b.start()
        try:
            rid = f"stage-load-{time.time_ns()}"
            req = InferenceRequest(rid, "t", record.name, [5 + i for i in range(PROMPT)],
                                   record.max_context - PROMPT - 1, time.time(), 3600.0, 30.0,
                                   temperature=0.0, ignore_eos=True)
            streams = TokenArrivals(nc)
            await streams.watch(rid)
            iid = await admit(nc, "load-a", req, record, None)
            await until(lambda: streams.count(rid) >= 8, 600, "A's tokens")
            layer = layer_weight_bytes(spec, spec.layers, spec.head_bytes)
            inst = a.sched.node.instance(iid)
            stage_bytes = (end - start) * (layer + inst.kv_bytes // spec.layers) + (64 << 20)
            hosted = await _command(nc, "load-b", NodeCommand(
                CommandKind.HOST_LAYERS, model=record, instance_id=iid, layer_start=start,
                layer_end=end, stage_node="load-a", stage_bytes=stage_bytes, stage_load=ceiling))
            await _command(nc, "load-a", NodeCommand(
                CommandKind.SHED_LAYERS, instance_id=iid, layer_start=start, layer_end=end,
                stage_address=hosted.stage_address, stage_node="load-b", hop_latency_s=1e-3,
                hop_bytes_per_s=1e9))
            key = stage_key(iid, start, end)
            shed_at, tokens_at_shed = time.time(), streams.count(rid)
            serving = []
            while time.time() - shed_at < serve_s:
                await asyncio.sleep(sample_s)
                serving.append(_sample(a, b, iid, key, shed_at))
            tokens = streams.count(rid) - tokens_at_shed
            elapsed = time.time() - shed_at
            await streams.cancel([rid], wait_s=60)
            stopped_at = time.time()
            idle = []
            while time.time() - stopped_at < idle_s:
                await asyncio.sleep(sample_s)
                idle.append(_sample(a, b, iid, key, shed_at))
        finally:
            await a.stop()
            await b.stop()
    warm = [s for s in serving if s["t"] >= window_s]  # reported = measured from here on
    direct = (serving[-1]["forward_s"] - serving[0]["forward_s"]) / \
        (serving[-1]["t"] - serving[0]["t"])
    return {
        "shape": shape, "layers": spec.layers, "stage_layers": [start, end],
        "window_s": window_s, "ceiling_k_over_l": ceiling,
        "tokens_per_s_while_split": tokens / elapsed,
        "stage_share_direct": direct,  # forward seconds over wall seconds, the whole serve period
        "reported_median_after_a_window": statistics.median(s["reported"] for s in warm),
        "reported_range_after_a_window": [min(s["reported"] for s in warm),
                                          max(s["reported"] for s in warm)],
        "owner_busy_median": statistics.median(s["owner_busy"] for s in warm),
        "predicted_from_owner_busy": ceiling * statistics.median(s["owner_busy"] for s in warm),
        "reported_idle_last": idle[-1]["reported"], "idle_s": idle_s,
        "samples": {"serving": serving, "idle": idle}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=SHAPES)
    p.add_argument("--window", type=float, default=10.0, help="the nodes' busy_window_s")
    p.add_argument("--serve", type=float, default=40.0)
    p.add_argument("--idle", type=float, default=40.0)
    p.add_argument("--sample", type=float, default=0.5)
    p.add_argument("--out", default=str(ROOT / "bench/results/stage_load.json"))
    args = p.parse_args()
    load_before = os.getloadavg()
    result = asyncio.run(run(args.shape, args.window, args.serve, args.idle, args.sample))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    write_result(Path(args.out), args.shape, result, "stage_load.py", load_before)


if __name__ == "__main__":
    main()

"""Scheduling overhead of the policy core (SLINFER Fig. 33): placement decision time and the
per-iteration token-level pick.

    .venv/bin/python bench/core_overhead.py [--nodes 8 16 32 64] [--models 128] [--samples 2000]
                                            [--sim-duration 300]

Placement is timed two ways:
- "placement" (stress): random cluster states, half CPU and half GPU nodes, 7B-shaped models
  (KV 512 KiB/token), each node holding 2-8 instances with 0-16 requests at random stages;
  profiles in the paper's magnitudes (CPU 7B: ~0.55 ms/token prefill, 71 ms decode at batch 1;
  GPU ~10x faster). Most CPU nodes are already past their TPOT budget, a state admission never
  lets a real node reach, so every placement probes every node: an upper bound.
- "placement_in_operation": every place() call the simulator makes while SLINFER serves the
  paper's workload (16 models per node, i.e. 128 on 8 nodes, 3B/7B/13B mix, 0.02 req/s per model,
  CV 8), so the cluster states are the ones the system really reaches.
Writes bench/results/core_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.core.config import CoreConfig  # noqa: E402
from shared.core.context import DecisionContext  # noqa: E402
from shared.core.iteration import choose_iteration  # noqa: E402
from shared.core.memory import MemOpKind  # noqa: E402
from shared.core.node_scheduler import NodeScheduler  # noqa: E402
from shared.core.perf_model import DecodeTable, PerfModel, PrefillTable, Profile  # noqa: E402
from shared.core.placement import place  # noqa: E402
from shared.core.types import (SLO, Hardware, InstanceView, ModelSpec, NodeView,  # noqa: E402
                               RequestView, slo_for_input)

GB = 1024**3
LENGTHS = [2**k for k in range(4, 13)]
BATCHES = [2**i for i in range(0, 8)]


def profile(model: str, hw: Hardware) -> Profile:
    speed = 1.0 if hw is Hardware.CPU else 0.1
    prefill = [speed * (0.02 + 0.00055 * n) for n in LENGTHS]
    decode = [[speed * (0.07 + 0.004 * b + 2e-6 * b * n) for n in LENGTHS] for b in BATCHES]
    return Profile(model, hw, PrefillTable(LENGTHS, prefill), DecodeTable(BATCHES, LENGTHS, decode),
                   load_s=1.0)


def cluster(n_nodes: int, n_models: int, rng: random.Random) -> tuple[list[NodeView], dict, PerfModel]:
    specs = {f"m{i}": ModelSpec(f"m{i}", 13 * GB, 512 * 1024, 4096, 211.0) for i in range(n_models)}
    perf = PerfModel()
    for name in specs:
        perf.add(profile(name, Hardware.CPU))
        perf.add(profile(name, Hardware.GPU))
    nodes = []
    for k in range(n_nodes):
        hw = Hardware.CPU if k % 2 == 0 else Hardware.GPU
        node = NodeView(f"n{k}", hw, (256 if hw is Hardware.CPU else 80) * GB, matrix_accel=True)
        for j in range(rng.randint(2, 8)):
            name = rng.choice(list(specs))
            reqs = [RequestView(f"r{k}-{j}-{q}", name, rng.randint(64, 2048), -rng.uniform(0, 5),
                                slo_for_input(1024), generated=rng.randint(0, 200), max_tokens=512,
                                prefilled=True) for q in range(rng.randint(0, 16))]
            node.instances.append(InstanceView(f"{name}@n{k}#{j}", specs[name], node.node_id,
                                               kv_bytes=2 * GB, requests=reqs))
        node.budget_bytes = sum(i.model.weight_bytes + i.kv_bytes for i in node.instances)
        nodes.append(node)
    return nodes, specs, perf


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def by_action(samples: list[tuple[str, float]]) -> dict:
    """Count and p50/p99 (us) per decision: a QUEUE or DROP has probed every node, a ROUTE
    usually only the model's own instances."""
    groups: dict[str, list[float]] = {}
    for action, seconds in samples:
        groups.setdefault(action, []).append(seconds)
    return {a: {"n": len(ts), "p50_us": round(statistics.median(ts) * 1e6, 1),
                "p99_us": round(percentile(ts, 0.99) * 1e6, 1)} for a, ts in sorted(groups.items())}


def bench_placement(n_nodes: int, n_models: int, samples: int, seed: int) -> dict:
    rng = random.Random(seed)
    nodes, specs, perf = cluster(n_nodes, n_models, rng)
    config = CoreConfig()
    times, decided = [], []
    for s in range(samples):
        name = rng.choice(list(specs))
        length = rng.randint(16, 4096)
        req = RequestView(f"new{s}", name, length, 0.0, slo_for_input(length), max_tokens=256)
        start = time.perf_counter()
        plan = place(req, specs[name], DecisionContext(nodes, perf, 0.0, config, specs))
        times.append(time.perf_counter() - start)
        decided.append((plan.action.value, times[-1]))
    instances = sum(len(n.instances) for n in nodes)
    return {"nodes": n_nodes, "models": n_models, "instances": instances, "samples": samples,
            "place_us_p50": round(statistics.median(times) * 1e6, 1),
            "place_us_p99": round(percentile(times, 0.99) * 1e6, 1), "by_action": by_action(decided)}


def bench_in_operation(n_nodes: int, duration: float, seed: int) -> dict:
    """Time each placement the simulated SLINFER cluster makes (the simulator itself is untimed)."""
    from sim import slinfer_system
    from sim.config import SimConfig
    from sim.simulate import simulate

    times: list[float] = []
    decided: list[tuple[str, float]] = []
    instances: list[int] = []

    def timed_place(request, model, ctx, *args, **kwargs):
        start = time.perf_counter()
        plan = place(request, model, ctx, *args, **kwargs)
        times.append(time.perf_counter() - start)
        decided.append((plan.action.value, times[-1]))
        instances.append(sum(len(n.instances) for n in ctx.nodes))
        return plan

    cfg = SimConfig(system="slinfer", models=16 * n_nodes, model_size="mix", cpu_nodes=n_nodes // 2,
                    gpu_nodes=n_nodes - n_nodes // 2, duration=duration, seed=seed,
                    arrivals="synthetic", cv=2.0)
    slinfer_system.place = timed_place  # the simulator's placer, wrapped for timing only
    try:
        report = simulate(cfg).report
    finally:
        slinfer_system.place = place
    return {"nodes": n_nodes, "models": cfg.models, "sim_duration_s": duration,
            "placements": len(times), "instances_mean": round(statistics.mean(instances), 1),
            "instances_max": max(instances),
            "place_us_p50": round(statistics.median(times) * 1e6, 1),
            "place_us_p99": round(percentile(times, 0.99) * 1e6, 1),
            "place_us_max": round(max(times) * 1e6, 1), "by_action": by_action(decided),
            "requests": report["requests"], "slo_attainment": round(report["slo_attainment"], 3)}


def bench_pick(samples: int, seed: int) -> dict:
    """The per-cycle pick on one busy node: 8 instances, 64 requests."""
    rng = random.Random(seed)
    nodes, specs, perf = cluster(1, 8, rng)
    node = nodes[0]
    while sum(i.batch_size for i in node.instances) < 64:
        inst = rng.choice(node.instances)
        inst.requests.append(RequestView(f"x{rng.random()}", inst.model.name, 512, 0.0, SLO(2.0, 0.25),
                                         generated=5, prefilled=True))
    choose, step = [], []
    sched = NodeScheduler(node, perf, CoreConfig())
    for inst in node.instances:  # every instance loaded, no memory op in flight
        for op in sched.ledger.request(MemOpKind.LOAD, inst.instance_id,
                                       inst.model.weight_bytes + inst.kv_bytes, 0.0)[1]:
            sched.ledger.complete(op.instance_id, op.op_id, 0.0)
    for _ in range(samples):
        start = time.perf_counter()
        choose_iteration(node.instances, 1.0)
        choose.append(time.perf_counter() - start)
        start = time.perf_counter()
        sched.step(1.0)
        step.append(time.perf_counter() - start)
    return {"instances": len(node.instances), "requests": sum(i.batch_size for i in node.instances),
            "pick_us_p50": round(statistics.median(choose) * 1e6, 2),
            "pick_us_p99": round(percentile(choose, 0.99) * 1e6, 2),
            "step_us_p50": round(statistics.median(step) * 1e6, 2),
            "step_us_p99": round(percentile(step, 0.99) * 1e6, 2)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--models", type=int, default=128)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-duration", type=float, default=300.0,
                   help="seconds of simulated arrivals per cluster size (0: skip)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "core_overhead.json"))
    args = p.parse_args()
    result = {
        "command": "python bench/core_overhead.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "placement": [bench_placement(n, args.models, args.samples, args.seed) for n in args.nodes],
        "placement_in_operation": [bench_in_operation(n, args.sim_duration, args.seed)
                                   for n in args.nodes] if args.sim_duration > 0 else [],
        "pick": bench_pick(args.samples * 5, args.seed),
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

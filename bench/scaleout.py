"""Scale-out of one model to k nodes at once (λScale §4): the multicast plan's time against every
node reading the checkpoint from storage, at datacenter link speeds (modelled, not measured:
this box has no network). The plan is the one the node workers would carry out
(`shared.core.multicast`); its steps are timed as block bytes over the link plus a per-step
latency.

    .venv/bin/python bench/scaleout.py [--out bench/results/scaleout_sim.json]

Figures: time until all k nodes hold the model (multicast vs storage), and time until the first
execution pipeline holds a full model across its nodes (execute-while-load can serve then).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.core.multicast import (binomial_schedule, execution_pipelines, kway_orders,  # noqa: E402
                                   steps_of, subgroups)

GB = 1e9
MODELS = {"7b": 13.48 * GB, "13b": 26.03 * GB}  # 16-bit weights (sim/profiles.py shapes)
LINKS_GBPS = (100, 400)
STEP_LATENCY_S = 50e-6  # one RDMA round trip and block bookkeeping per step (ASSUMPTION)
NVME_BYTES_PER_S = 5 * GB  # every node reading its own local copy in parallel (λScale's SSDs)
REGISTRY_BYTES_PER_S = 1.25 * GB  # one 10 Gb/s link out of the registry, shared by all readers


def first_pipeline_steps(n: int, k: int, blocks: int) -> int:
    """Steps until some execution pipeline's nodes hold every block between them (one source
    per sub-group, k-way orders): the earliest step after which a request can be served."""
    groups = subgroups(n, k)
    orders = kway_orders(blocks, k)
    held: dict[int, dict[int, int]] = {}  # node -> block -> step it arrived
    for group, order in zip(groups, orders):
        for t in binomial_schedule(len(group), order):
            held.setdefault(group[t.dst], {})[t.block] = t.step
    best = None
    for pipe in execution_pipelines(groups):
        arrival = {}
        for node in pipe:
            for block, step in held.get(node, {}).items():
                arrival[block] = min(arrival.get(block, step), step)
        if len(arrival) == blocks:
            done = max(arrival.values()) + 1
            best = done if best is None else min(best, done)
    return best if best is not None else steps_of([t for g, o in zip(groups, orders)
                                                   for t in binomial_schedule(len(g), o)])


def row(model: str, n_dest: int, gbps: float, blocks: int) -> dict:
    size = MODELS[model]
    link = gbps * GB / 8
    step_s = size / blocks / link + STEP_LATENCY_S
    n = n_dest + 1  # the source holds the model
    steps = steps_of(binomial_schedule(n, list(range(blocks))))
    two_src = first_pipeline_steps(n_dest + 2, 2, blocks) if n_dest >= 2 else None
    return {"model": model, "destinations": n_dest, "link_gbps": gbps, "blocks": blocks,
            "multicast_steps": steps, "multicast_s": round(steps * step_s, 3),
            "first_pipeline_s_2_sources": round(two_src * step_s, 3) if two_src else None,
            "nvme_each_s": round(size / NVME_BYTES_PER_S, 3),
            "registry_shared_s": round(n_dest * size / REGISTRY_BYTES_PER_S, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaleout_sim.json"))
    p.add_argument("--blocks", type=int, default=32, help="model blocks (λScale's elbow: tens)")
    args = p.parse_args(argv)
    rows = [row(m, k, g, args.blocks) for m in MODELS for k in (2, 4, 8) for g in LINKS_GBPS]
    result = {"command": "python bench/scaleout.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores (a model, no network used)",
              "date": time.strftime("%Y-%m-%d"), "step_latency_s": STEP_LATENCY_S,
              "nvme_bytes_per_s": NVME_BYTES_PER_S, "registry_bytes_per_s": REGISTRY_BYTES_PER_S,
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

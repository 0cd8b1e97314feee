"""Reproduce SLINFER §IX with the cluster simulator: end-to-end (§IX-B), ablation (§IX-C) and the
watermark sweep (§IX-I5). One process, runs one after another (the box has 2 cores).

    .venv/bin/python -m bench.sim.reproduce --out bench/results/sim [--duration 1800] [--cv 8 2]

Writes one JSON report per run under OUT/<cv>/..., a summary.json with every run's headline
numbers and wall time, and plots (SLO-met, nodes used, decode speed, TTFT CDFs).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sim.plots import ttft_cdf
from sim.report import dumps
from sim.simulate import SimConfig, simulate

SYSTEMS = ("sllm", "sllm+c", "sllm+c+s", "slinfer")
SIZES = ("3b", "7b", "13b")
COUNTS = (32, 64, 128)
RPS_PER_MODEL = 0.02


def headline(rep: dict) -> dict:
    keys = ("requests", "slo_met", "slo_attainment", "dropped", "avg_cpu_nodes_used",
            "avg_gpu_nodes_used", "ttft_p50", "ttft_p99", "tpot_p50", "avg_batch_size",
            "kv_utilization", "scaling_time_fraction", "preemptions", "evictions", "cold_starts",
            "decode_tokens_per_s_per_node")
    return {k: rep[k] for k in keys}


def run_one(cfg: SimConfig, path: Path, cdfs: dict, key: str) -> dict:
    t0 = time.perf_counter()
    outcome = simulate(cfg)
    wall = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(outcome.report))
    xs, ys = ttft_cdf(outcome)
    step = max(1, len(xs) // 200)
    cdfs[key] = (xs[::step], ys[::step])
    row = headline(outcome.report)
    row["wall_s"] = round(wall, 2)
    row["sim_s_per_wall_s"] = round(outcome.report["sim_seconds"] / max(wall, 1e-9), 1)
    print(f"{key:40s} slo_met={row['slo_met']:6d}/{row['requests']:6d} "
          f"cpu={row['avg_cpu_nodes_used']:.2f} gpu={row['avg_gpu_nodes_used']:.2f} "
          f"wall={wall:.1f}s", flush=True)
    return row


def end_to_end(out: Path, base: dict, cdfs: dict) -> dict:
    rows = {}
    for size in SIZES:
        for n in COUNTS:
            for system in SYSTEMS:
                cfg = SimConfig(system=system, models=n, model_size=size, rps=RPS_PER_MODEL * n, **base)
                key = f"e2e/{size}/{n}/{system}"
                rows[key] = run_one(cfg, out / f"{key}.json", cdfs, key)
    return rows


def ablation(out: Path, base: dict, cdfs: dict) -> dict:
    rows = {}
    variants = {"full": {}, "no-cpu": {"no_cpu": True}, "no-sharing": {"no_sharing": True},
                "no-consolidation": {"no_consolidation": True}}
    for name, flags in variants.items():
        cfg = SimConfig(system="slinfer", models=64, model_size="7b", rps=RPS_PER_MODEL * 64,
                        **base, **flags)
        key = f"ablation/{name}"
        rows[key] = run_one(cfg, out / f"{key}.json", cdfs, key)
    for w in (0.0, 0.25, 0.5, 1.0):
        cfg = SimConfig(system="slinfer", models=64, model_size="7b", rps=RPS_PER_MODEL * 64,
                        watermark=w, **base)
        key = f"watermark/{int(w * 100)}"
        rows[key] = run_one(cfg, out / f"{key}.json", cdfs, key)
    return rows


def plot(out: Path, rows: dict, cdfs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("slo_met", "SLO-met requests"), ("avg_gpu_nodes_used", "GPUs used"),
               ("avg_cpu_nodes_used", "CPUs used")]
    fig, axes = plt.subplots(len(metrics) + 1, len(SIZES), figsize=(13, 12))
    for j, size in enumerate(SIZES):
        for i, (metric, label) in enumerate(metrics):
            ax = axes[i][j]
            for k, system in enumerate(SYSTEMS):
                vals = [rows[f"e2e/{size}/{n}/{system}"][metric] for n in COUNTS]
                ax.bar([x + k * 0.2 for x in range(len(COUNTS))], vals, width=0.2, label=system)
            ax.set_xticks([x + 0.3 for x in range(len(COUNTS))], [str(n) for n in COUNTS])
            ax.set_title(f"{size}: {label}")
        ax = axes[-1][j]
        for system in SYSTEMS:
            xs, ys = cdfs[f"e2e/{size}/128/{system}"]
            ax.plot(xs, ys, label=system)
        ax.set_xscale("log")
        ax.set_title(f"{size}, 128 models: TTFT CDF")
        ax.set_xlabel("TTFT (s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [k for k in rows if k.startswith("ablation/")]
    axes[0].bar([n.split("/")[1] for n in names], [rows[n]["avg_gpu_nodes_used"] for n in names])
    axes[0].set_ylabel("GPUs used")
    ax2 = axes[0].twinx()
    ax2.plot([n.split("/")[1] for n in names], [rows[n]["slo_attainment"] for n in names], "ko-")
    ax2.set_ylabel("SLO attainment")
    axes[0].set_title("Ablation, 64 x 7B")
    wm = [k for k in rows if k.startswith("watermark/")]
    axes[1].plot([int(k.split("/")[1]) for k in wm], [rows[k]["kv_utilization"] for k in wm], "o-",
                 label="KV utilization")
    axes[1].plot([int(k.split("/")[1]) for k in wm], [rows[k]["scaling_time_fraction"] for k in wm],
                 "s-", label="scaling time fraction")
    axes[1].set_xlabel("watermark (%)")
    axes[1].legend()
    axes[1].set_title("Watermark sweep, 64 x 7B")
    fig.tight_layout()
    fig.savefig(out / "ablation_watermark.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/sim")
    p.add_argument("--duration", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cv", type=float, nargs="+", default=[8.0, 2.0])
    args = p.parse_args(argv)
    summary = {}
    for cv in args.cv:
        out = Path(args.out) / f"cv{cv:g}"
        out.mkdir(parents=True, exist_ok=True)
        base = dict(duration=args.duration, seed=args.seed, cv=cv, cpu_nodes=4, gpu_nodes=4)
        cdfs: dict = {}
        rows = {**end_to_end(out, base, cdfs), **ablation(out, base, cdfs)}
        plot(out, rows, cdfs)
        summary[f"cv{cv:g}"] = rows
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Reproduce SLINFER §IX with the cluster simulator, on the paper's own workload shape.

    .venv/bin/python -m bench.sim.reproduce --out bench/results/sim --seeds 0 1 2 --jobs 2
    .venv/bin/python -m bench.sim.table --write bench/BENCHMARKS.md

Groups of runs (each a `SimConfig`; every report is written to OUT/<group>/...json):
- headline (§IX-B): the Azure Functions sample (one function per model, Poisson within a minute)
  for 3B/7B/13B at 32/64/128 models, the four systems, every seed;
the rest are sensitivity runs on the first `--sensitivity-seeds` seeds (default 1):
- startup: the 128-model headline again with a 2 s engine start-up on every cold start;
- cv2 / cv8: the synthetic workload (log-normal popularity, Gamma bursts) at 128 models,
  0.02 req/s per model;
- ablation (§IX-C, plus packing): 64 x 7B and 32 x 7B on the trace with parts of SLINFER off;
- watermark (§IX-I5): 64 x 7B at 0/25/50/100%;
- noise: 128 x 7B SLINFER with the iteration noise off, default, doubled;
- storage: 128 x 7B with checkpoint tiers (DRAM and disk caches, cold at the start) and with
  every load from the registry, against the headline's all-in-DRAM;
- past (issue 26, every seed): SLINFER at 128 models of each size with chunked prefill, with
  predictive pre-warming, and with both, against the headline's baselines of the same seed; and
  (first seeds) the same with the 2 s start-up, against the start-up group's baselines.
A stopped reproduction goes on where it stopped (summary.json is written after every run).
summary.json holds every run's headline numbers; the table module turns it into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from bench.sim.runner import run_plan
from sim.plots import ttft_cdf
from sim.config import SimConfig

SYSTEMS = ("sllm", "sllm+c", "sllm+c+s", "slinfer")
SIZES = ("3b", "7b", "13b")
COUNTS = (32, 64, 128)
RPS_PER_MODEL = 0.02  # the synthetic workload's load (sensitivity runs)
# Issue 26's mechanisms (each off in the headline): the smallest prefill chunk, 64 tokens as the
# real stack's `SLINFER_PREFILL_CHUNK_TOKENS`; pre-warming with 1 s idle-time bins (the trace is
# 30 minutes: the paper's 1-minute bins would hold too few idle times to be representative).
PAST_VARIANTS = {"chunked": {"prefill_chunk_tokens": 64}, "prewarm": {"prewarm": True},
                 "both": {"prefill_chunk_tokens": 64, "prewarm": True}}
HEADLINE_KEYS = ("requests", "slo_met", "slo_attainment", "slo_attainment_mean_tpot", "dropped",
                 "ttft_cold_start_p50", "ttft_cold_start_p99", "loads_by_tier", "avg_cpu_nodes_used",
                 "avg_gpu_nodes_used", "ttft_p50", "ttft_p99", "tpot_p50", "avg_batch_size",
                 "kv_utilization", "scaling_time_fraction", "preemptions", "migrations",
                 "evictions", "cold_starts", "decode_tokens_per_s_per_node", "node_rejections",
                 "migration_refusals", "admission_answers")


def plan(seeds: list[int], groups: set[str], sensitivity_seeds: int = 1) -> dict[str, SimConfig]:
    """Every run, by key: group/size/models/system[/variant]/s<seed>. The headline runs every
    seed; the other groups the first `sensitivity_seeds` of them (they compare variants of one
    system on the same arrivals, so a seed's noise is common to the variants)."""
    runs: dict[str, SimConfig] = {}
    base = dict(cpu_nodes=4, gpu_nodes=4, duration=1800.0)
    for seed in seeds:
        extra = seed in seeds[:sensitivity_seeds]
        for size in SIZES:
            for n in COUNTS:
                for system in SYSTEMS:
                    if "headline" in groups:
                        runs[f"headline/{size}/{n}/{system}/s{seed}"] = SimConfig(
                            system=system, models=n, model_size=size, seed=seed, **base)
                    if "startup" in groups and n == 128 and extra:
                        runs[f"startup/{size}/{n}/{system}/s{seed}"] = SimConfig(
                            system=system, models=n, model_size=size, seed=seed,
                            engine_startup=2.0, **base)
                    if "storage" in groups and n == 128 and size == "7b" and extra:
                        for mode in ("tiered", "registry"):
                            runs[f"storage/{size}/{n}/{system}/{mode}/s{seed}"] = SimConfig(
                                system=system, models=n, model_size=size, seed=seed,
                                storage=mode, **base)
                    for cv in (2.0, 8.0):
                        if f"cv{cv:g}" in groups and n == 128 and extra:
                            runs[f"cv{cv:g}/{size}/{n}/{system}/s{seed}"] = SimConfig(
                                system=system, models=n, model_size=size, seed=seed,
                                arrivals="synthetic", cv=cv, rps=RPS_PER_MODEL * n, **base)
        if "past" in groups:
            for size in SIZES:
                for name, flags in PAST_VARIANTS.items():
                    runs[f"past/{size}/128/slinfer-{name}/s{seed}"] = SimConfig(
                        system="slinfer", models=128, model_size=size, seed=seed, **flags, **base)
                    if extra:
                        runs[f"past-startup/{size}/128/slinfer-{name}/s{seed}"] = SimConfig(
                            system="slinfer", models=128, model_size=size, seed=seed,
                            engine_startup=2.0, **flags, **base)
        if not extra:
            continue
        if "ablation" in groups:
            for n in (32, 64):
                for name, flags in {"full": {}, "no-cpu": {"no_cpu": True},
                                    "no-sharing": {"no_sharing": True},
                                    "no-consolidation": {"no_consolidation": True},
                                    "no-packing": {"no_packing": True}}.items():
                    runs[f"ablation/7b/{n}/{name}/s{seed}"] = SimConfig(
                        system="slinfer", models=n, model_size="7b", seed=seed, **flags, **base)
        if "watermark" in groups:
            for w in (0.0, 0.25, 0.5, 1.0):
                runs[f"watermark/7b/64/{int(w * 100)}/s{seed}"] = SimConfig(
                    system="slinfer", models=64, model_size="7b", seed=seed, watermark=w, **base)
        if "noise" in groups:
            for sigma in (0.0, 0.07, 0.14):
                runs[f"noise/7b/128/{sigma:g}/s{seed}"] = SimConfig(
                    system="slinfer", models=128, model_size="7b", seed=seed, noise=sigma, **base)
    return runs


def row_of(key: str, cfg: SimConfig, outcome) -> dict:
    del key, cfg
    return {k: outcome.report[k] for k in HEADLINE_KEYS}


def cdf_of(key: str, outcome) -> tuple[str, tuple] | None:
    """The TTFT CDF (about 200 points) of the 128-model headline runs of seed 0, for the plots."""
    if not (key.startswith("headline/") and "/128/" in key and key.endswith("/s0")):
        return None
    xs, ys = ttft_cdf(outcome)
    step = max(1, len(xs) // 200)
    return "cdfs", (xs[::step], ys[::step])


def _meta(args: argparse.Namespace, argv: list[str] | None, elapsed: float) -> dict:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--note" in given:  # the note is shown as such, not as part of the command
        at = given.index("--note")
        del given[at:at + 2]
    return {"command": "python -m bench.sim.reproduce " + " ".join(given),
            "seeds": args.seeds, "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                             f"Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"), "wall_s_last_invocation": round(elapsed, 1),
            "jobs": args.jobs, "sensitivity_seeds": args.sensitivity_seeds,
            **({"note": args.note} if args.note else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/sim")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sensitivity-seeds", type=int, default=1,
                   help="how many of the seeds the groups other than the headline run")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)))
    p.add_argument("--groups", nargs="+", default=["headline", "startup", "cv2", "cv8", "ablation",
                                                    "watermark", "noise", "storage"])
    p.add_argument("--note", default="",
                   help="how this invocation ran, if it matters to its wall times (shown in BENCHMARKS)")
    p.add_argument("--fresh", action="store_true",
                   help="run everything again (default: keep the runs summary.json already holds)")
    args = p.parse_args(argv)
    runs = plan(args.seeds, set(args.groups), args.sensitivity_seeds)
    # Issue 26's ablation is its own invocation, later than the reproduction it compares with:
    # its command goes beside the reproduction's, not over it.
    meta_key = "meta_past" if set(args.groups) == {"past"} else "meta"
    # Slowest first (SLINFER at 128 models), so the pool's last minutes are not one long run.
    run_plan(runs, Path(args.out), jobs=args.jobs, fresh=args.fresh, row=row_of, attach=cdf_of,
             sections=("runs", "cdfs"),
             order=lambda k: ("slinfer" not in k and "ablation" not in k, "/128/" not in k, k),
             meta=lambda elapsed, _load: _meta(args, argv, elapsed), meta_key=meta_key,
             describe=lambda row: f"slo={row['slo_attainment']:.3f} "
                                  f"gpu={row['avg_gpu_nodes_used']:.2f} wall={row['wall_s']:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

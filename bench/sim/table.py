"""Markdown tables from bench/results/sim/summary.json (pasted into bench/BENCHMARKS.md).

    .venv/bin/python -m bench.sim.table bench/results/sim/summary.json
"""

from __future__ import annotations

import json
import sys

SYSTEMS = ("sllm", "sllm+c", "sllm+c+s", "slinfer")


def pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f}%" if b else "n/a"


def e2e_table(rows: dict) -> str:
    out = ["| size | models | system | SLO-met / requests | attainment | CPUs used | GPUs used | "
           "decode tok/s/node cpu / gpu | avg batch | TTFT p50 / p99 (s) | wall (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in ("3b", "7b", "13b"):
        for n in (32, 64, 128):
            for s in SYSTEMS:
                r = rows[f"e2e/{size}/{n}/{s}"]
                d = r["decode_tokens_per_s_per_node"]
                out.append(f"| {size} | {n} | {s} | {r['slo_met']} / {r['requests']} | "
                           f"{r['slo_attainment']:.3f} | {r['avg_cpu_nodes_used']:.2f} | "
                           f"{r['avg_gpu_nodes_used']:.2f} | {d['cpu']:.0f} / {d['gpu']:.0f} | "
                           f"{r['avg_batch_size']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                           f"{r['wall_s']:.1f} |")
    return "\n".join(out)


def ratio_table(rows: dict) -> str:
    out = ["| size | models | SLINFER vs sllm | vs sllm+c | vs sllm+c+s |", "|---|---|---|---|---|"]
    for size in ("3b", "7b", "13b"):
        for n in (32, 64, 128):
            me = rows[f"e2e/{size}/{n}/slinfer"]["slo_met"]
            out.append(f"| {size} | {n} | " + " | ".join(
                pct(me, rows[f"e2e/{size}/{n}/{s}"]["slo_met"]) for s in SYSTEMS[:3]) + " |")
    return "\n".join(out)


def ablation_table(rows: dict) -> str:
    out = ["| run | SLO attainment | GPUs used | CPUs used | KV utilization | scaling time | "
           "preemptions | evictions |", "|---|---|---|---|---|---|---|---|"]
    for k, r in rows.items():
        if k.startswith(("ablation/", "watermark/")):
            out.append(f"| {k} | {r['slo_attainment']:.3f} | {r['avg_gpu_nodes_used']:.2f} | "
                       f"{r['avg_cpu_nodes_used']:.2f} | {r['kv_utilization']:.3f} | "
                       f"{r['scaling_time_fraction'] * 100:.2f}% | {r['preemptions']} | "
                       f"{r['evictions']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    summary = json.loads(open(argv[0] if argv else "bench/results/sim/summary.json").read())
    for cv, rows in summary.items():
        print(f"### {cv}\n\n{ratio_table(rows)}\n\n{e2e_table(rows)}\n\n{ablation_table(rows)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

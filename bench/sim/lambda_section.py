"""The λScale simulator section of BENCHMARKS.md, from bench/results/sim/lambda_scale/summary.json
(`python -m bench.sim.scaleout --group lambda --table --write bench/BENCHMARKS.md`).

Every number in it comes from the summary's rows (means over the seeds there; a spike tail's
range over seeds in brackets) or, for the multicast plan's own times, from `sim.scaleout`'s plan.
"""

from __future__ import annotations

import math

from bench.sim.scaleout import (BEGIN_L, END_L, LAMBDA_VARIANTS, SIZES, _f, _mean, _pct, _ratio,
                                _rows)
from sim.profiles import SHAPES
from sim.scaleout import ScaleoutConfig, plan_times

SYSTEMS = {"sllm": "sllm", "slinfer": "slinfer", "slinfer+burst": "slinfer + burst"}
LINKS = {"none": "none (tiers)", "100": "100 Gb/s", "400": "400 Gb/s",
         "100-no-ewl": "100 Gb/s, no EWL"}
OWN_TIERS = ("dram", "disk", "registry")


def rows(summary: dict, size: str, system: str, variant: str, group: str = "lambda") -> list[dict]:
    return _rows(summary, f"{group}/{size}/{system}/{variant}")


def _range(rs: list[dict], key: str) -> str:
    vals = [r.get(key) for r in rs]
    if len(vals) < 2:
        return ""
    shown = [math.inf if v == "inf" else v for v in vals if isinstance(v, (int, float, str))]
    return f" [{_f(min(shown))}–{_f(max(shown))}]"


def spike_loads(rs: list[dict]) -> dict[str, float]:
    """The spiked models' loads during their spikes, per run: own tier, multicast, pipeline."""
    out = {"own": 0.0, "multicast": 0.0, "pipeline": 0.0, "shared": 0.0}
    for r in rs:
        loads = r.get("spike_loads", {})
        out["own"] += sum(loads.get(t, 0) for t in OWN_TIERS) / len(rs)
        out["multicast"] += loads.get("multicast", 0) / len(rs)
        out["pipeline"] += loads.get("pipeline", 0) / len(rs)
        out["shared"] += r.get("spike_loads_sharing_a_multicast", 0) / len(rs)
    return out


def _sources(rs: list[dict]) -> str:
    vals = [r["spike_multicast_sources_mean"] for r in rs
            if r.get("spike_multicast_sources_mean") is not None]
    return f"{sum(vals) / len(vals):.1f}" if vals else "-"


def _spike_loads_cell(rs: list[dict], variant: str) -> str:
    if variant == "none":
        return "-"
    s = spike_loads(rs)
    return (f"{s['own']:.1f} / {s['multicast']:.1f} / {s['pipeline']:.1f} "
            f"(k {_sources(rs)}, {s['shared']:.1f} shared)")


def table_lines(summary: dict, group: str = "lambda") -> list[str]:
    lines = [
        "| size | system | link | SLO attain. (spikes) | TTFT p50 / p90 / p99, all (s) | spikes: "
        "dropped, TTFT p50 / p90 [seeds' range] / p99 (s) | spikes' TTFT p50 / p90: no link ÷ "
        "this | GPU node-s (÷ no link) | spikes' loads per run: own tier / multicast / pipeline "
        "(mean sources k, loads sharing a multicast) | burst instances per run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in SIZES:
        for system, label in SYSTEMS.items():
            base = rows(summary, size, system, "none", group)
            for variant in LAMBDA_VARIANTS:
                rs = rows(summary, size, system, variant, group)
                if not rs:
                    continue
                vs_base = "-" if variant == "none" else (
                    f"{_ratio(_mean(base, 'spike_ttft_p50'), _mean(rs, 'spike_ttft_p50'))} / "
                    f"{_ratio(_mean(base, 'spike_ttft_p90'), _mean(rs, 'spike_ttft_p90'))}")
                cost = _f(_mean(rs, "gpu_node_seconds"), "{:.0f}")
                if variant != "none":
                    cost += f" ({_ratio(_mean(rs, 'gpu_node_seconds'), _mean(base, 'gpu_node_seconds'))})"
                burst = _mean(rs, "burst_instances") if system.endswith("burst") else None
                lines.append(
                    f"| {size} | {label} | {LINKS[variant]} | "
                    f"{_f(_mean(rs, 'slo_attainment'), '{:.3f}')} "
                    f"({_f(_mean(rs, 'spike_slo_attainment'), '{:.3f}')}) | "
                    f"{_f(_mean(rs, 'ttft_p50'))} / {_f(_mean(rs, 'ttft_p90'))} / "
                    f"{_f(_mean(rs, 'ttft_p99'))} | {_pct(rs)}, {_f(_mean(rs, 'spike_ttft_p50'))} / "
                    f"{_f(_mean(rs, 'spike_ttft_p90'))}{_range(rs, 'spike_ttft_p90')} / "
                    f"{_f(_mean(rs, 'spike_ttft_p99'))} | {vs_base} | {cost} | "
                    f"{_spike_loads_cell(rs, variant)} | {'-' if burst is None else f'{burst:.1f}'} |")
    return lines


def section(summary: dict, findings: list[str]) -> str:
    meta = summary.get("meta", {})
    lines = [
        BEGIN_L,
        "#### In the cluster simulator: load spikes over 8 GPU nodes (`bench/sim/scaleout.py --group lambda`)",
        "",
        f"Command: `{meta.get('command', '?')}`, then `.venv/bin/python -m bench.sim.scaleout "
        f"--group lambda --table --write bench/BENCHMARKS.md`. Machine: {meta.get('machine', '?')}; "
        f"load average {meta.get('load_average_before')} before the last invocation, "
        f"{meta.get('load_average_after')} after (other sessions' work alongside; the runs are "
        f"deterministic, only their wall time depends on the box). Seeds {meta.get('seeds')}; "
        "reports in `bench/results/sim/lambda_scale/`, rows in its `summary.json`. Cells: means "
        "over the seeds.",
        "",
        "Setting: the Azure Functions sample for 32 models plus 6 load spikes (200 requests of one "
        "model in 10 s, every 5 minutes; the spiked model's checkpoint starts in one node's DRAM "
        "tier, λScale's k ≥ 1), 8 A100 nodes, no CPU nodes, checkpoint tiers cold at the start "
        "(64 GB DRAM + 1 TB NVMe cache per node, registry at 10 Gb/s), 30 minutes. **sllm** is the "
        "ServerlessLLM-style baseline (exclusive GPUs, every instance loads from its own node's "
        "tiers); with a link it is λScale's setting (the same instance-level scaling; a new "
        "instance receives the model from the nodes holding it, `sim/scaleout.py`, timed by "
        "`shared.core.multicast`'s k-way binomial plan with 16 blocks, execute-while-load (EWL) "
        "pipelines unless noted). **slinfer** adds one instance per placement, as in §IX; "
        "**slinfer + burst** turns on the core's burst scale-out (`shared/core/burst.py`, "
        "`CoreConfig.burst_scaleout`, off in every other run): a placement that starts an "
        "instance of a model whose last second of arrivals, over the new instance's startup, "
        "outgrows what its full instances hold starts the instances that demand needs at once, on "
        "nodes not serving the model yet, so one multicast feeds them all. Spike columns: the "
        "spiked model's requests in each spike's 10 s (a dropped request counts as infinitely "
        "late, ∞) and the spiked model's loads in those windows (own tier: DRAM, disk or "
        "registry; pipeline: served in an EWL pipeline before it held the whole model).",
        "",
        *table_lines(summary),
        "",
        *fast_lines(summary),
        *findings,
        "",
        END_L,
    ]
    return "\n".join(lines)


def fast_lines(summary: dict) -> list[str]:
    """The sensitivity runs: the same spikes within 2 s (7B, the first seed)."""
    if not any(k.startswith("lambda-fast/") for k in summary["runs"]):
        return []
    return ["Sensitivity: the same spikes arriving within 2 s instead of 10 (100 requests/s), "
            "7B, the first seed (`lambda-fast/...`); no-link columns n/a (not run):", "",
            *table_lines(summary, "lambda-fast"), ""]


def plan_seconds(size: str, gbps: float, nodes: int = 8, sources: int = 1) -> float:
    """The multicast plan's time until all `nodes` nodes (its sources among them) hold the
    whole model (no EWL)."""
    cfg = ScaleoutConfig(gbps)
    shape = SHAPES[size]
    steps = max(plan_times(nodes, sources, cfg.blocks).full.values())
    return steps * cfg.step_s(shape.weight_bytes)


def findings(summary: dict) -> list[str]:
    return ["What this shows against λScale's figures:", "",
            f"- **13B to 8 nodes in < 1 s** (λScale §7.2): the plan gives "
            f"{plan_seconds('13b', 400):.2f} s at 400 Gb/s (16 blocks, one source), "
            f"{plan_seconds('13b', 100):.2f} s at 100 Gb/s."]


def lambda_table(summary: dict) -> str:
    return section(summary, findings(summary))

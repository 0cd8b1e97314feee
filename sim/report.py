"""The run's JSON report. Deterministic: sorted keys, floats rounded, no wall-clock values."""

from __future__ import annotations

import json
import math
from typing import Any

from shared.core.types import Hardware
from sim.engine import RunResult
from sim.metrics import Metrics

REPORT_KEYS = (
    "requests", "slo_met", "slo_attainment", "dropped", "avg_gpu_nodes_used", "avg_cpu_nodes_used",
    "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "decode_tokens_per_s_per_node",
    "avg_batch_size", "kv_utilization", "scaling_time_fraction", "preemptions", "evictions",
    "cold_starts",
)


ADMIT_PREFIX = "admit:"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def build_report(result: RunResult, m: Metrics, params: dict[str, Any]) -> dict[str, Any]:
    reqs = result.requests
    served = [r for r in reqs if r.finished_at is not None and not r.dropped]
    ttfts = [r.ttft for r in served if r.ttft is not None]
    cold = [r.ttft for r in served if r.ttft is not None and r.grace_s > 0]  # waited for a load
    tpots = [r.tpot for r in served if r.tpot is not None and r.output_len > 1]
    span = result.end_time
    slo_met = sum(1 for r in reqs if r.slo_met)
    cpu_s, gpu_s = m.node_seconds[Hardware.CPU], m.node_seconds[Hardware.GPU]
    report: dict[str, Any] = {
        "params": params,
        "requests": len(reqs),
        "finished": len(served),
        "slo_met": slo_met,
        "slo_attainment": _ratio(slo_met, len(reqs)),
        # The same with the mean TPOT after the first token instead of Eq. 1's per-token deadlines.
        "slo_attainment_mean_tpot": _ratio(sum(1 for r in reqs if r.slo_met_mean_tpot), len(reqs)),
        "dropped": sum(1 for r in reqs if r.dropped),
        "sim_seconds": span,
        "events": result.events,
        "avg_cpu_nodes_used": _ratio(cpu_s, span),
        "avg_gpu_nodes_used": _ratio(gpu_s, span),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "ttft_cold_start_p50": percentile(cold, 50),
        "ttft_cold_start_p99": percentile(cold, 99),
        "loads_by_tier": {k.removeprefix("loads:"): v for k, v in sorted(m.counters.items())
                          if k.startswith("loads:")},
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "decode_tokens_per_s_per_node": {
            "cpu": _ratio(m.decode_tokens[Hardware.CPU], cpu_s),
            "gpu": _ratio(m.decode_tokens[Hardware.GPU], gpu_s),
        },
        "busy_fraction_of_used_node_time": {
            "cpu": _ratio(m.busy_s[Hardware.CPU], cpu_s),
            "gpu": _ratio(m.busy_s[Hardware.GPU], gpu_s),
        },
        "served_on": {
            "cpu": sum(1 for r in served if r.hardware is Hardware.CPU),
            "gpu": sum(1 for r in served if r.hardware is Hardware.GPU),
        },
        "avg_batch_size": _ratio(m.decode_batch_sum, m.decode_iterations),
        "kv_utilization": _ratio(m.kv_used_byte_s, m.kv_alloc_byte_s),
        "scaling_time_fraction": _ratio(m.scaling_s, m.instance_s),
        "preemptions": m.counters.get("preemptions", 0),
        "migrations": m.counters.get("migrations", 0),
        "evictions": m.counters.get("evictions", 0),
        "cold_starts": m.counters.get("cold_starts", 0),
        "node_rejections": m.counters.get("node_rejections", 0),
        "kv_scalings": m.counters.get("kv_scalings", 0),
        "migration_refusals": m.counters.get("migration_refusals", 0),
        # Every admission answer the placer's core gave, over all candidates of all decisions
        # (a queued request is re-planned at each change, so it counts again).
        "admission_answers": {k.removeprefix(ADMIT_PREFIX): v for k, v in sorted(m.counters.items())
                              if k.startswith(ADMIT_PREFIX)},
    }
    coco = {k.removeprefix("cocoserve_"): v for k, v in sorted(m.counters.items())
            if k.startswith("cocoserve_")}
    if coco:  # only runs with --cocoserve have these (sim/cocoserve.py)
        report["cocoserve"] = coco
    if params.get("prewarm"):  # only runs with --prewarm (shared/core/prewarm.py)
        report["prewarm"] = {"started": m.counters.get("prewarms", 0),
                             "refused_by_node": m.counters.get("prewarm_refusals", 0),
                             "idle_unloaded_for_new_instances": m.counters.get("prewarm_gave_way", 0),
                             "requests_cold": len(cold)}
    return _round(report)


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, sort_keys=True, indent=2) + "\n"

"""One simulation run, from a `SimConfig` to a report: build the models, nodes, profiles and
workload, run the chosen system on the event loop, and summarize."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sim.build import DRAIN_S, SimOutcome, build_cluster, build_requests, build_system
from sim.config import SimConfig, params_of
from sim.engine import run
from sim.lora import simulate_lora
from sim.metrics import Metrics
from sim.report import build_report


def simulate(cfg: SimConfig, on_progress: Callable[[float], None] | None = None) -> SimOutcome:
    if cfg.lora_adapters:
        return simulate_lora(cfg, on_progress)
    cluster = build_cluster(cfg)
    system = build_system(cfg, cluster)
    requests = build_requests(cfg, cluster)
    metrics = Metrics()
    result = run(system, requests, metrics, horizon=cfg.duration + DRAIN_S, on_progress=on_progress)
    return SimOutcome(build_report(result, metrics, params_of(cfg)), metrics, result, system)


def load_mix(path: str) -> dict[str, float]:
    """A model-mix file: JSON object size -> weight, e.g. {"3b": 2, "7b": 2, "13b": 2}."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object like {{\"3b\": 2, \"7b\": 1}}")
    return {str(k).lower(): float(v) for k, v in data.items()}

"""Build a small cluster and run hand-made requests through a system."""

from __future__ import annotations

from shared.core.types import slo_for_input
from sim.engine import SimRequest, run
from sim.metrics import Metrics
from sim.build import build_cluster, build_system
from sim.config import SimConfig


def run_requests(system: str, size: str, cpu: int, gpu: int, n_models: int,
                 reqs: list[tuple[float, int, int, int]], **kw):
    """reqs: (arrival, model index, input tokens, output tokens). Returns (system, requests,
    metrics, model names). Iterations take exactly their profile time unless `noise` is given."""
    kw.setdefault("noise", 0.0)
    cfg = SimConfig(system=system, models=n_models, model_size=size, cpu_nodes=cpu, gpu_nodes=gpu,
                    duration=60.0, **kw)
    cluster = build_cluster(cfg)
    names = sorted(cluster.specs)
    sys_ = build_system(cfg, cluster)
    requests = [SimRequest(f"r{i}", names[m], inp, out, t, slo_for_input(inp))
                for i, (t, m, inp, out) in enumerate(reqs)]
    metrics = Metrics()
    run(sys_, requests, metrics, horizon=600.0)
    return sys_, requests, metrics, names

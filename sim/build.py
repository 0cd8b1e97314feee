"""The pieces of one simulation run, built from its `SimConfig`: the models and their profiles,
the nodes, the system under test (SLINFER or a baseline) and the requests; and what a run gives
back (`SimOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, ModelSpec, slo_for_input
from sim import profiles as prof
from sim import scaleout
from sim.baselines import BaselineConfig, BaselineSystem, BNode, Deployment
from sim.config import SimConfig, model_sizes
from sim.engine import IterationNoise, RunResult, SimRequest
from sim.metrics import Metrics
from sim.slinfer_system import SlinferSystem
from sim.storage import NodeStorage, TierSpec
from sim.workload import LengthSampler, build_workload

DRAIN_S = 600.0  # after the last arrival, let in-flight requests finish for up to this long
NOISE_SEED = 0x0015E  # mixed into the run's seed for the iteration-noise stream


@dataclass
class Cluster:
    specs: dict[str, ModelSpec]  # model name -> spec
    sizes: dict[str, str]  # model name -> "3b" | "7b" | "13b"
    book: prof.ProfileBook


def build_cluster(cfg: SimConfig) -> Cluster:
    book = prof.ProfileBook(prof.builtin_profiles())
    if cfg.profiles:
        book.override(prof.load_profiles(cfg.profiles))
    specs, sizes = {}, {}
    for i, size in enumerate(model_sizes(cfg)):
        name = f"m{i:03d}-{size}"
        specs[name] = prof.model_spec(prof.SHAPES[size], name)
        sizes[name] = size
    return Cluster(specs, sizes, book)


def node_views(cfg: SimConfig):
    return ([prof.node_view(f"cpu{i}", Hardware.CPU) for i in range(cfg.cpu_nodes)]
            + [prof.node_view(f"gpu{i}", Hardware.GPU) for i in range(cfg.gpu_nodes)])


def build_system(cfg: SimConfig, cluster: Cluster, slinfer_cls: type[SlinferSystem] = SlinferSystem):
    perf = cluster.book.perf_model({m: prof.SHAPES[s].name for m, s in cluster.sizes.items()})
    # Every system's cold start pays the engine start-up, and SLINFER's core knows it: in the
    # profile's load time, or, with tiers, beside the tier's n/b.
    if cfg.storage == "dram" and cfg.engine_startup:
        perf = PerfModel({k: replace(p, load_s=p.load_s + cfg.engine_startup)
                          for k, p in perf.profiles.items()})
    elif cfg.storage != "dram":
        perf = PerfModel({k: replace(p, engine_init_s=cfg.engine_startup)
                          for k, p in perf.profiles.items()})
    noise = IterationNoise(cfg.noise, cfg.seed ^ NOISE_SEED)
    views = node_views(cfg)
    storage = None
    if cfg.storage != "dram":
        spec = TierSpec(caching=cfg.storage == "tiered")
        storage = {v.node_id: NodeStorage(spec) for v in views}
    mc = scaleout.multicaster(cfg, cluster, storage)  # None unless --link-gbps / --spikes
    if cfg.system == "slinfer":
        return slinfer_cls(views, perf, cluster.specs, cfg.core_config(), noise, storage, mc,
                           scaleout.cocoserve_settings(cfg, cluster), cfg.prewarm_config())
    deps = {m: Deployment(m, cluster.sizes[m], spec.weight_bytes, spec.kv_bytes_per_token,
                          {hw: perf.get(m, hw) for hw in Hardware if perf.get(m, hw) is not None})
            for m, spec in cluster.specs.items()}
    nodes = [BNode(v.node_id, v.hardware, v.memory_bytes,
                   storage=storage[v.node_id] if storage else None) for v in views]
    return BaselineSystem(BaselineConfig.named(cfg.system, cfg.keep_alive), nodes, deps, noise, mc)


def build_requests(cfg: SimConfig, cluster: Cluster) -> list[SimRequest]:
    lengths = LengthSampler.from_csv(cfg.lengths)
    names = sorted(cluster.specs)
    ctx = {m: s.max_context for m, s in cluster.specs.items()}
    arrivals = build_workload(names, ctx, cfg.duration, cfg.rps, cfg.seed, lengths, cfg.arrivals, cfg.cv)
    spikes = scaleout.spikes_of(cfg.extra)
    if spikes is not None:
        arrivals = scaleout.spike_arrivals(spikes, arrivals, names, cfg.duration, cfg.seed, lengths, ctx)
    return [SimRequest(f"r{i}", a.model, a.input_len, a.output_len, a.time, slo_for_input(a.input_len))
            for i, a in enumerate(arrivals)]


@dataclass
class SimOutcome:
    report: dict[str, Any]
    metrics: Metrics
    result: RunResult
    system: Any = None  # the system that ran (for benchmarks that look inside it)

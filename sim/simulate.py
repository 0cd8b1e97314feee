"""One simulation run, from a `SimConfig` to a report: build the models, nodes, profiles and
workload, run the chosen system on the event loop, and summarize."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from shared.core.config import CoreConfig
from shared.settings import core_config_from_env
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, ModelSpec, slo_for_input
from sim import profiles as prof
from sim import scaleout
from sim.baselines import BaselineConfig, BaselineSystem, BNode, Deployment
from sim.engine import IterationNoise, RunResult, SimRequest, run
from sim.metrics import Metrics
from sim.report import build_report
from sim.slinfer_system import SlinferSystem
from sim.storage import NodeStorage, TierSpec
from sim.workload import DEFAULT_LENGTHS_CSV, LengthSampler, build_workload

SYSTEMS = ("slinfer", "sllm", "sllm+c", "sllm+c+s")
SIZES = ("3b", "7b", "13b")
DRAIN_S = 600.0  # after the last arrival, let in-flight requests finish for up to this long
NOISE_SEED = 0x0015E  # mixed into the run's seed for the iteration-noise stream
STORAGE_MODES = ("dram", "tiered", "registry")


@dataclass(frozen=True)
class SimConfig:
    system: str = "slinfer"
    models: int = 32
    model_size: str = "7b"  # 3b | 7b | 13b | mix
    model_mix: dict[str, float] | None = None  # size -> weight, overrides model_size
    cpu_nodes: int = 4
    gpu_nodes: int = 4
    duration: float = 1800.0  # seconds of arrivals (the paper: a 30-minute trace segment)
    seed: int = 0
    lengths: str = str(DEFAULT_LENGTHS_CSV)
    # "functions": the Azure Functions sample (SLINFER §IX-A's workload); "synthetic": log-normal
    # popularity with Gamma(cv) bursts; or the path of an Azure Functions per-minute file.
    arrivals: str = "functions"
    rps: float | None = None  # total requests/s; None: RPS_PER_MODEL per model
    cv: float = 8.0  # burstiness: CV of each model's Gamma inter-arrival times (ServerlessLLM: 8)
    no_cpu: bool = False
    no_sharing: bool = False
    no_consolidation: bool = False
    no_packing: bool = False  # ablation: new instances on the soonest-starting node, not packed
    watermark: float = 0.25
    keep_alive: float = 1.0
    profiles: str | None = None  # JSON of measured profiles that replace the built-in ones
    noise: float = 0.07  # sigma of the log-normal factor on every real iteration time
    # Where checkpoints come from on a cold start (sim/storage.py): "dram" (the paper: all cached
    # in every node's memory), "tiered" (DRAM and disk caches, registry), "registry" (no cache).
    storage: str = "dram"
    engine_startup: float = 0.0  # seconds an engine takes to start, added to every cold start
    extra: dict[str, Any] = field(default_factory=dict)
    # LoRA functions (sim/lora.py; ServerlessLoRA): > 0 makes every function a LoRA adapter over
    # one of `lora_backbones` backbones (the function count; `models` follows it). "shared": one
    # backbone instance serves many adapters (SLINFER only); "merged": one full model per function.
    lora_adapters: int = 0
    lora_backbones: int = 1
    lora_rank: int = 8
    lora_serving: str = "shared"
    lora_decode_overhead: float | None = None  # None: the curve bench/lora.py measured

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system must be one of {SYSTEMS}, got {self.system!r}")
        if self.models < 1:
            raise ValueError("models must be >= 1")
        if self.model_mix is None and self.model_size not in (*SIZES, "mix"):
            raise ValueError(f"model_size must be one of {SIZES} or 'mix'")
        if self.model_mix is not None and (not self.model_mix or any(
                s not in SIZES or w < 0 for s, w in self.model_mix.items())):
            raise ValueError(f"model_mix: sizes from {SIZES} with weights >= 0")
        if self.cpu_nodes < 0 or self.gpu_nodes < 0 or self.cpu_nodes + self.gpu_nodes == 0:
            raise ValueError("need at least one node")
        if self.duration <= 0:
            raise ValueError("duration must be > 0")
        if self.cv <= 0:
            raise ValueError("cv must be > 0")
        if self.rps is not None and self.rps <= 0:
            raise ValueError("rps must be > 0")
        if self.noise < 0:
            raise ValueError("noise must be >= 0")
        if self.engine_startup < 0:
            raise ValueError("engine_startup must be >= 0")
        if self.storage not in STORAGE_MODES:
            raise ValueError(f"storage must be one of {STORAGE_MODES}, got {self.storage!r}")
        scaleout.check(self)
        if self.lora_adapters:
            from sim.lora import check_config
            check_config(self)
            object.__setattr__(self, "models", self.lora_adapters)  # the functions are adapters

    def core_config(self) -> CoreConfig:
        """The services' defaults (what a placer and its nodes build from an environment that
        sets nothing: live preemption, execute-while-load, ...), with this run's ablations, so a
        decision seen here is the one the services take (tests/sim/test_parity.py)."""
        return replace(core_config_from_env(env={}), watermark=self.watermark,
                       keep_alive_s=self.keep_alive,
                       enable_cpu=not self.no_cpu, enable_sharing=not self.no_sharing,
                       enable_consolidation=not self.no_consolidation,
                       pack_new_instances=not self.no_packing,
                       **scaleout.burst_settings(self.extra))


def model_sizes(cfg: SimConfig) -> list[str]:
    """The size of each of the N models: all one size, or a mix split by weight (1:1:1 for
    'mix'), assigned to model indices in a seeded shuffle."""
    mix = cfg.model_mix or ({s: 1.0 for s in SIZES} if cfg.model_size == "mix" else {cfg.model_size: 1.0})
    total = sum(mix.values())
    sizes: list[str] = []
    for size in SIZES:
        if size in mix:
            sizes += [size] * round(cfg.models * mix[size] / total)
    while len(sizes) < cfg.models:
        sizes.append(max(mix, key=mix.get))
    sizes = sizes[:cfg.models]
    random.Random(cfg.seed ^ 0xA11CE).shuffle(sizes)
    return sizes


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
                           scaleout.cocoserve_settings(cfg, cluster))
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


def params_of(cfg: SimConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out["lengths"] = Path(cfg.lengths).name  # no machine-specific paths in the report
    if cfg.arrivals not in ("synthetic", "functions"):
        out["arrivals"] = Path(cfg.arrivals).name
    if cfg.profiles:
        out["profiles"] = Path(cfg.profiles).name
    if not cfg.lora_adapters:  # a run without LoRA reports what it always did
        out = {k: v for k, v in out.items() if not k.startswith("lora_")}
    return out


@dataclass
class SimOutcome:
    report: dict[str, Any]
    metrics: Metrics
    result: RunResult
    system: Any = None  # the system that ran (for benchmarks that look inside it)


def simulate(cfg: SimConfig, on_progress: Callable[[float], None] | None = None) -> SimOutcome:
    if cfg.lora_adapters:
        from sim.lora import simulate_lora
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

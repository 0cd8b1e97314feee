"""A simulation run's settings (`SimConfig`, checked when built) and what follows from them alone:
the models' sizes and the parameters a report names."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from shared.core.config import CoreConfig
from shared.core.preload import PRELOAD_INTERVAL_S
from shared.core.prewarm import PrewarmConfig
from shared.settings import core_config_from_env
from sim import scaleout
from sim.workload import DEFAULT_LENGTHS_CSV

SYSTEMS = ("slinfer", "sllm", "sllm+c", "sllm+c+s")
SIZES = ("3b", "7b", "13b")
STORAGE_MODES = ("dram", "tiered", "registry")
SERVING = ("shared", "merged")


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
    # "shared" serving pre-loads adapters and backbone checkpoints (ServerlessLoRA §4.1,
    # sim/preload.py), re-planned this often as the placer and the nodes do by default; 0: off.
    lora_preload_s: float = PRELOAD_INTERVAL_S
    # Chunked prefill in SLINFER's scheduler (`CoreConfig.prefill_chunk_tokens`: the smallest
    # chunk); 0: whole prefills, as in the paper.
    prefill_chunk_tokens: int = 0
    # Predictive pre-warming (`CoreConfig.prewarm`, `shared.core.prewarm`): on, with idle-time
    # bins of this many seconds (the paper's 60 s suit days of trace; this one is 30 minutes).
    prewarm: bool = False
    prewarm_bin_s: float = 1.0
    prewarm_bins: int = 240

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
        if not self.prewarm_bin_s > 0 or self.prewarm_bins < 1:
            raise ValueError("prewarm_bin_s must be > 0 and prewarm_bins >= 1")
        scaleout.check(self)
        if self.lora_adapters:
            check_lora(self)
            object.__setattr__(self, "models", self.lora_adapters)  # the functions are adapters

    def prewarm_config(self) -> PrewarmConfig:
        return PrewarmConfig(bin_s=self.prewarm_bin_s, bins=self.prewarm_bins)

    def core_config(self) -> CoreConfig:
        """The services' defaults (what a placer and its nodes build from an environment that
        sets nothing: live preemption, execute-while-load, ...), with this run's ablations, so a
        decision seen here is the one the services take (tests/sim/test_parity.py)."""
        return replace(core_config_from_env(env={}), watermark=self.watermark,
                       keep_alive_s=self.keep_alive,
                       enable_cpu=not self.no_cpu, enable_sharing=not self.no_sharing,
                       enable_consolidation=not self.no_consolidation,
                       pack_new_instances=not self.no_packing,
                       prefill_chunk_tokens=self.prefill_chunk_tokens,
                       prewarm=self.prewarm,
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


def check_lora(cfg: SimConfig) -> None:
    """The LoRA fields of a run that has LoRA functions (`sim/lora.py` runs it)."""
    if cfg.lora_adapters < 1:
        raise ValueError("lora_adapters must be >= 1")
    if not 1 <= cfg.lora_backbones <= cfg.lora_adapters:
        raise ValueError("lora_backbones must be between 1 and lora_adapters")
    if cfg.lora_rank < 1:
        raise ValueError("lora_rank must be >= 1")
    if cfg.lora_serving not in SERVING:
        raise ValueError(f"lora_serving must be one of {SERVING}, got {cfg.lora_serving!r}")
    if cfg.lora_serving == "shared" and cfg.system != "slinfer":
        raise ValueError(f"{cfg.system} loads one full model per function and cannot share a "
                         "backbone: use lora_serving 'merged' (--lora-serving merged)")
    if cfg.lora_decode_overhead is not None and cfg.lora_decode_overhead < 0:
        raise ValueError("lora_decode_overhead must be >= 0")
    if cfg.lora_preload_s < 0:
        raise ValueError("lora_preload_s must be >= 0")


def params_of(cfg: SimConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out["lengths"] = Path(cfg.lengths).name  # no machine-specific paths in the report
    if cfg.arrivals not in ("synthetic", "functions"):
        out["arrivals"] = Path(cfg.arrivals).name
    if cfg.profiles:
        out["profiles"] = Path(cfg.profiles).name
    if not cfg.lora_adapters:  # a run without LoRA reports what it always did
        out = {k: v for k, v in out.items() if not k.startswith("lora_")}
    if not cfg.prefill_chunk_tokens:  # nor does one with whole prefills
        del out["prefill_chunk_tokens"]
    if not cfg.prewarm:  # nor does one without pre-warming
        out = {k: v for k, v in out.items() if not k.startswith("prewarm")}
    return out

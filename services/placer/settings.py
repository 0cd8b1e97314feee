"""Placer settings, read once from the environment at start."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from shared.core.config import CoreConfig
from shared.core.module_scaling import ModuleSettings
from shared.core.preload import PRELOAD_INTERVAL_S
from shared.core.prewarm import PrewarmConfig
from shared.settings import (core_config_from_env, env_bool, env_float, env_int, env_nats_url,
                             env_redis_url, env_str, env_stream_replicas)


@dataclass(frozen=True)
class PlacerSettings:
    nats_url: str
    redis_url: str
    core: CoreConfig
    admit_timeout_s: float = 5.0
    name: str = "placer"
    stream_replicas: int = 1  # SLINFER_STREAM_REPLICAS: copies of each JetStream stream
    # JetStream redelivers a request this long after its placer's last sign of life (a placer
    # that died with it in its queue); live placers renew their claim every third of it.
    ack_wait_s: float = 10.0
    # CoCoServe module scaling (services/placer/module_scaler.py): the core's planner runs this
    # often (0: never). Replication is off unless asked for: nodes that share one machine's
    # cores (a test or demo box) gain no compute from replicas on each other.
    module_scaling_s: float = 1.0
    modules: ModuleSettings = ModuleSettings(replicate=False)
    # ServerlessLoRA §4.1 (services/placer/preloader.py): the cluster's pre-loading plan is made
    # and sent to the nodes this often (0: never; each node then plans from its own rates).
    preload_interval_s: float = PRELOAD_INTERVAL_S
    # Pinned models (services/placer/pinning.py): their instance count is checked this often
    # (0: never; a pinned instance is still never reclaimed, but a missing one is not started).
    pin_check_s: float = 1.0
    # A node that did not answer a request's admission may be running it: the request goes
    # elsewhere only once the node says it never took it, or has been silent and out of the
    # cluster view this long (a Redis failover can leave a live node out of the view for
    # seconds: a multihost run re-placed a request its node had already finished).
    node_gone_s: float = 15.0
    # Predictive pre-warming (services/placer/prewarmer.py, on with SLINFER_PREWARM): the idle-time
    # histogram's bins (the paper's: 1 minute, 240 of them) and how often pre-warms are planned.
    prewarm: PrewarmConfig = PrewarmConfig()
    prewarm_check_s: float = 0.5

    @classmethod
    def from_env(cls) -> PlacerSettings:
        core = burst_from_env(core_config_from_env())
        return cls(nats_url=env_nats_url(), redis_url=env_redis_url(),
                   stream_replicas=env_stream_replicas(),
                   core=core,
                   admit_timeout_s=env_float("SLINFER_ADMIT_TIMEOUT_S", 5.0, minimum=0.1),
                   name=env_str("SLINFER_PLACER_NAME", "placer"),
                   ack_wait_s=env_float("SLINFER_PLACER_ACK_WAIT_S", 10.0, minimum=1.0),
                   module_scaling_s=env_float("SLINFER_MODULE_SCALING_S", 1.0, minimum=0.0),
                   preload_interval_s=env_float("SLINFER_CLUSTER_PRELOAD_S", PRELOAD_INTERVAL_S,
                                                        minimum=0.0),
                   pin_check_s=env_float("SLINFER_PIN_CHECK_S", 1.0, minimum=0.0),
                   node_gone_s=env_float("SLINFER_NODE_GONE_S", 15.0, minimum=0.0),
                   prewarm=PrewarmConfig(
                       bin_s=env_float("SLINFER_PREWARM_BIN_S", 60.0, minimum=1e-3),
                       bins=env_int("SLINFER_PREWARM_BINS", 240, minimum=1)),
                   prewarm_check_s=env_float("SLINFER_PREWARM_CHECK_S", 0.5, minimum=0.01),
                   modules=ModuleSettings(
                       hop_latency_s=env_float("SLINFER_MODULE_HOP_LATENCY_S", 1e-3, minimum=0.0),
                       link_bytes_per_s=env_float("SLINFER_MODULE_LINK_BYTES_PER_S", 1.25e9,
                                                  minimum=1.0),
                       shed=env_bool("SLINFER_MODULE_SHED", True),
                       replicate=env_bool("SLINFER_MODULE_REPLICATE", False)))


def burst_from_env(core: CoreConfig, env: Mapping[str, str] | None = None) -> CoreConfig:
    """λScale's burst scale-out (shared/core/burst.py, services/placer/burst.py): only the placer
    decides it, so only the placer reads it. Off by default, as in the core: unlike multicast and
    execute-while-load (on by default: they change how an instance the placement chose anyway
    gets its weights), it starts instances no request asked for yet, on a rate estimate, and in
    the simulator's spikes (bench/BENCHMARKS.md, λScale section) it bought nothing consistent."""
    return replace(core,
                   burst_scaleout=env_bool("SLINFER_BURST_SCALEOUT", False, env=env),
                   burst_window_s=env_float("SLINFER_BURST_WINDOW_S", core.burst_window_s, env=env,
                                            minimum=1e-3),
                   burst_max=env_int("SLINFER_BURST_MAX", core.burst_max, env=env, minimum=1))

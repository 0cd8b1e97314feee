"""Node worker settings, read once from the environment at start."""

from __future__ import annotations

from dataclasses import dataclass

from services.node.loader.settings import LoaderSettings
from shared.hardware import HardwareInfo, NoGPU, detect_cpu, detect_gpu
from shared.core.config import CoreConfig
from shared.core.preload import PRELOAD_INTERVAL_S
from shared.settings import (WILDCARD_HOSTS, ListenHosts, core_config_from_env, env_bool,
                             env_float, env_int, env_nats_url, env_redis_url, env_str,
                             env_stream_replicas, listen_hosts_from_env)

GiB = 1024**3


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    hardware: str  # "cpu" | "gpu"
    device: str  # torch device the engines use: "cpu" or "cuda:N"
    memory_bytes: int  # what the memory subsystem may hand out (weights + KV)
    matrix_accel: bool
    nats_url: str
    redis_url: str
    core: CoreConfig = CoreConfig()
    stream_replicas: int = 1  # SLINFER_STREAM_REPLICAS: copies of each JetStream stream
    # Where every listener of the node binds (metrics, multicast, layer stages) and the address
    # other hosts dial it at (SLINFER_NODE_BIND_HOST / SLINFER_NODE_ADVERTISE_HOST).
    hosts: ListenHosts = ListenHosts()
    # Online calibration: correct the profile this node's iterations drift from, and publish the
    # correction for the placer (the error is measured and exported either way).
    calibrate: bool = True
    heartbeat_s: float = 0.25
    metrics_port: int = 0  # Prometheus /metrics (0: off)
    hardware_name: str = ""
    cores: int = 0
    accel_flags: tuple[str, ...] = ()
    # The node's checkpoint loader (DRAM cache, local disk, registry; services/node/loader). The
    # default keeps nothing after a load; from_env reads SLINFER_NODE_DRAM_CACHE_BYTES & co.
    loader: LoaderSettings = LoaderSettings()
    # Profiles (and the registry's model names, for the tiers report) are re-read this often; a
    # request for a model the node has no profile of re-reads them at once before refusing it.
    profile_refresh_s: float = 5.0
    # λScale model multicast (services/node/multicast.py): the endpoint's TCP listener (port 0:
    # any free one) and the address peers connect to, also the layer stages' (default: the
    # node's hosts; SLINFER_MULTICAST_HOST / _ADVERTISE_HOST override them). The link bandwidth
    # is what the placer plans with until received blocks measured one. Off: the node neither
    # sends nor receives models.
    multicast: bool = True
    multicast_host: str = "127.0.0.1"
    multicast_port: int = 0
    multicast_advertise_host: str | None = None
    multicast_link_bytes_per_s: float = 1.25e9  # a 10 Gb/s link
    # Pace every connection this node sends blocks on to this rate (None: as fast as it goes):
    # a slower link on one machine, for tests and benchmarks of execute-while-load.
    multicast_rate_bytes_per_s: float | None = None
    # Artifact pre-loading (ServerlessLoRA §4.1, services/node/preload.py): re-planned this
    # often from the rates the node sees; 0 = off.
    preload_interval_s: float = PRELOAD_INTERVAL_S

    @classmethod
    def from_env(cls) -> NodeSettings:
        hardware = env_str("SLINFER_NODE_HARDWARE", "cpu").lower()
        if hardware not in ("cpu", "gpu"):
            raise ValueError(f"SLINFER_NODE_HARDWARE must be cpu or gpu, not {hardware!r}")
        info = _detect(hardware)
        default_mem = min(8 * GiB, info.memory_bytes // 2) if hardware == "cpu" else int(info.memory_bytes * 0.9)
        accel = env_str("SLINFER_MATRIX_ACCEL", "auto").lower()
        if accel not in ("auto", "true", "false", "1", "0"):
            raise ValueError(f"SLINFER_MATRIX_ACCEL must be auto, true or false, not {accel!r}")
        matrix = info.matrix_accel if accel == "auto" else accel in ("true", "1")
        hosts = listen_hosts_from_env()
        multicast_host, multicast_advertise = multicast_hosts(
            hosts, env_str("SLINFER_MULTICAST_HOST"), env_str("SLINFER_MULTICAST_ADVERTISE_HOST"))
        return cls(
            node_id=env_str("SLINFER_NODE_ID", "node-0"),
            hardware=hardware,
            device=env_str("SLINFER_DEVICE", "cuda:0" if hardware == "gpu" else "cpu"),
            memory_bytes=env_int("SLINFER_NODE_MEMORY_BYTES", default_mem, minimum=1),
            matrix_accel=matrix,
            nats_url=env_nats_url(),
            redis_url=env_redis_url(),
            core=core_config_from_env(),
            stream_replicas=env_stream_replicas(),
            hosts=hosts,
            calibrate=env_bool("SLINFER_CALIBRATION", True),
            heartbeat_s=env_float("SLINFER_HEARTBEAT_S", 0.25, minimum=0.01),
            metrics_port=env_int("SLINFER_NODE_METRICS_PORT", 0, minimum=0),
            hardware_name=info.name,
            cores=info.cores,
            accel_flags=tuple(info.flags),
            loader=LoaderSettings.from_env(),
            profile_refresh_s=env_float("SLINFER_PROFILE_REFRESH_S", 5.0, minimum=0.1),
            multicast=env_bool("SLINFER_MULTICAST", True),
            multicast_host=multicast_host,
            multicast_port=env_int("SLINFER_MULTICAST_PORT", 0, minimum=0),
            multicast_advertise_host=multicast_advertise,
            multicast_link_bytes_per_s=env_float("SLINFER_MULTICAST_LINK_BYTES_PER_S", 1.25e9,
                                                 minimum=1.0),
            multicast_rate_bytes_per_s=env_float("SLINFER_MULTICAST_RATE_BYTES_PER_S", 0.0,
                                                 minimum=0.0) or None,
            preload_interval_s=env_float("SLINFER_PRELOAD_INTERVAL_S", PRELOAD_INTERVAL_S,
                                         minimum=0.0),
        )


def multicast_hosts(node: ListenHosts, bind: str | None,
                    advertise: str | None) -> tuple[str, str]:
    """The multicast endpoint's (and layer stages') bind and advertised addresses: the node's,
    unless SLINFER_MULTICAST_HOST / _ADVERTISE_HOST (`bind`, `advertise`) say otherwise; a
    specific multicast bind address is also what peers dial, unless it binds every address."""
    if bind is None:
        return node.bind, advertise or node.advertise
    if advertise is None:
        advertise = node.advertise if bind in WILDCARD_HOSTS else bind
    elif advertise in WILDCARD_HOSTS:
        raise ValueError(f"SLINFER_MULTICAST_ADVERTISE_HOST must be an address other hosts can "
                         f"dial, got {advertise!r}")
    return bind, advertise


def _detect(hardware: str) -> HardwareInfo:
    if hardware == "cpu":
        return detect_cpu()
    try:
        return detect_gpu()
    except NoGPU as exc:
        raise ValueError(f"SLINFER_NODE_HARDWARE=gpu but {exc}") from exc



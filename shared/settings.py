"""Settings read once, at the edge, from the environment.

Each service's `__main__` reads its settings here and passes plain values inward; nothing below
the edge touches `os.environ`. Bad values raise `ValueError` naming the variable, so a typo in a
compose file or a shell fails at start with a message that says what to fix.

Environment variables shared by every service (the same names inside and outside Docker):

    SLINFER_NATS_URL         NATS server URL, or several comma-separated (one cluster)
                             (default nats://127.0.0.1:4222)
    SLINFER_REDIS_URL        Redis URL, may carry a password; or Sentinels:
                             redis+sentinel://[:pw@]host:26379,host2:26379/<master>[/<db>]
                             (default redis://127.0.0.1:6379/0)
    SLINFER_STREAM_REPLICAS  copies JetStream keeps of each stream (default 1; 3 in a cluster)
    SLINFER_DATA_DIR         where models, profiles and logs live (default .data)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_DATA_DIR = ".data"
ENV_NATS_URL = "SLINFER_NATS_URL"
ENV_REDIS_URL = "SLINFER_REDIS_URL"
ENV_STREAM_REPLICAS = "SLINFER_STREAM_REPLICAS"
NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")
MAX_STREAM_REPLICAS = 5  # JetStream's own bound
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


def _raw(name: str, env: Mapping[str, str] | None) -> str | None:
    """The variable's value with surrounding whitespace removed; None when unset or blank."""
    value = (os.environ if env is None else env).get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def env_str(name: str, default: str | None = None, *, env: Mapping[str, str] | None = None,
            required: bool = False) -> str | None:
    value = _raw(name, env)
    if value is None:
        if required and default is None:
            raise ValueError(f"{name} is required but not set")
        return default
    return value


def env_int(name: str, default: int | None = None, *, env: Mapping[str, str] | None = None,
            minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = _raw(name, env)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    _check_range(name, number, minimum, maximum)
    return number


def env_float(name: str, default: float | None = None, *, env: Mapping[str, str] | None = None,
              minimum: float | None = None, maximum: float | None = None) -> float | None:
    value = _raw(name, env)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    _check_range(name, number, minimum, maximum)
    return number


def env_bool(name: str, default: bool | None = None, *,
             env: Mapping[str, str] | None = None) -> bool | None:
    value = _raw(name, env)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/0, true/false, yes/no, on/off, got {value!r}")


def _check_range(name: str, number: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")


def nats_servers(value: str, name: str = ENV_NATS_URL) -> list[str]:
    """The server URLs of a NATS setting: one URL or a comma-separated list (nats-py takes a
    list; it rejects the comma-joined string)."""
    servers = [part.strip() for part in value.split(",")]
    if any(not server for server in servers):
        raise ValueError(f"{name}: an empty server in {value!r}")
    for server in servers:
        if not server.startswith(NATS_SCHEMES):
            raise ValueError(f"{name} must be nats:// (or tls://) URLs, comma-separated, got "
                             f"{server!r}")
        _check_host_port(name, server)
    return servers


def check_redis_url(value: str, name: str = ENV_REDIS_URL) -> str:
    """`value` when it is a URL `shared.redis_client.open_redis` can open, else ValueError."""
    from shared.redis_client import SENTINEL_SCHEME, parse_sentinel_url

    if value.startswith(SENTINEL_SCHEME):
        parse_sentinel_url(value, name)
        return value
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{name} must be a redis://, rediss:// or redis+sentinel:// URL, got "
                         f"{redact_url(value)!r}")
    if not value.startswith("unix://"):
        _check_host_port(name, value)
    return value


def _check_host_port(name: str, url: str) -> None:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{name}: bad port in {redact_url(url)!r}") from None
    if not parts.hostname and port is None:
        raise ValueError(f"{name}: no host in {redact_url(url)!r}")


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def env_nats_url(env: Mapping[str, str] | None = None) -> str:
    """SLINFER_NATS_URL, checked (see `nats_servers`)."""
    value = env_str(ENV_NATS_URL, DEFAULT_NATS_URL, env=env)
    nats_servers(value)
    return value


def env_redis_url(env: Mapping[str, str] | None = None) -> str:
    """SLINFER_REDIS_URL, checked (see `check_redis_url`)."""
    return check_redis_url(env_str(ENV_REDIS_URL, DEFAULT_REDIS_URL, env=env))


def env_stream_replicas(env: Mapping[str, str] | None = None) -> int:
    """SLINFER_STREAM_REPLICAS: 1 for one NATS server (a single server refuses more); 3 for a
    cluster of three, so a stream outlives the loss of one server."""
    return env_int(ENV_STREAM_REPLICAS, 1, env=env, minimum=1, maximum=MAX_STREAM_REPLICAS)


@dataclass(frozen=True)
class ListenHosts:
    """Where a node's listeners bind and the address other hosts dial them at."""

    bind: str = "127.0.0.1"  # SLINFER_NODE_BIND_HOST
    advertise: str = "127.0.0.1"  # SLINFER_NODE_ADVERTISE_HOST (default: the bind host)


def listen_hosts_from_env(env: Mapping[str, str] | None = None) -> ListenHosts:
    bind = env_str("SLINFER_NODE_BIND_HOST", "127.0.0.1", env=env)
    advertise = env_str("SLINFER_NODE_ADVERTISE_HOST", None, env=env)
    if advertise is None:
        if bind in WILDCARD_HOSTS:
            # Another host cannot dial "0.0.0.0": the address it reaches this one at is needed.
            raise ValueError(f"SLINFER_NODE_ADVERTISE_HOST is required when "
                             f"SLINFER_NODE_BIND_HOST is {bind!r} (every address)")
        advertise = bind
    elif advertise in WILDCARD_HOSTS:
        raise ValueError(f"SLINFER_NODE_ADVERTISE_HOST must be an address other hosts can dial, "
                         f"got {advertise!r}")
    return ListenHosts(bind, advertise)


@dataclass(frozen=True)
class CommonSettings:
    """What every service needs to find the rest of the stack."""

    nats_url: str = DEFAULT_NATS_URL  # SLINFER_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL  # SLINFER_REDIS_URL
    data_dir: Path = Path(DEFAULT_DATA_DIR)  # SLINFER_DATA_DIR

    stream_replicas: int = 1  # SLINFER_STREAM_REPLICAS

    def __post_init__(self) -> None:
        nats_servers(self.nats_url)
        check_redis_url(self.redis_url)
        if not 1 <= self.stream_replicas <= MAX_STREAM_REPLICAS:
            raise ValueError(f"{ENV_STREAM_REPLICAS} must be in 1..{MAX_STREAM_REPLICAS}, got "
                             f"{self.stream_replicas}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CommonSettings:
        return cls(
            nats_url=env_nats_url(env),
            redis_url=env_redis_url(env),
            data_dir=Path(env_str("SLINFER_DATA_DIR", DEFAULT_DATA_DIR, env=env)),
            stream_replicas=env_stream_replicas(env),
        )


def core_config_from_env(env: Mapping[str, str] | None = None):
    """The policy core's knobs. The placer and every node read the same variables, so a node's
    re-check applies the rules the placer planned with."""
    from shared.core.config import CoreConfig

    return CoreConfig(
        watermark=env_float("SLINFER_WATERMARK", 0.25, env=env, minimum=0.0),
        keep_alive_s=env_float("SLINFER_KEEP_ALIVE_S", 1.0, env=env, minimum=0.0),
        enable_cpu=env_bool("SLINFER_ENABLE_CPU", True, env=env),
        enable_sharing=env_bool("SLINFER_ENABLE_SHARING", True, env=env),
        enable_consolidation=env_bool("SLINFER_ENABLE_CONSOLIDATION", True, env=env),
        require_matrix_accel=env_bool("SLINFER_REQUIRE_MATRIX_ACCEL", True, env=env),
        enable_multicast=env_bool("SLINFER_ENABLE_MULTICAST", True, env=env),
        # The services carry execute-while-load out (services/node/pipeline_mode.py); the pure
        # core's default stays off (the simulator models λScale's pipelines on its own).
        enable_pipeline=env_bool("SLINFER_ENABLE_PIPELINE", True, env=env),
        # ... with the receivers of one multicast hosting layers for each other (λScale
        # Algorithm 2, services/node/pipeline_mode.py).
        enable_receiver_pipelines=env_bool("SLINFER_RECEIVER_PIPELINES", False, env=env),
        live_preemption=env_bool("SLINFER_LIVE_PREEMPTION", True, env=env),
        # Chunked prefill (issue 26): the smallest chunk in tokens; 0 (the default): whole
        # prefills. Engines that cannot chunk keep whole prefills either way.
        prefill_chunk_tokens=env_int("SLINFER_PREFILL_CHUNK_TOKENS", 0, env=env, minimum=0),
        # Predictive pre-warming (issue 26; services/placer/prewarmer.py): off by default. The
        # nodes read it too: an instance only the policy keeps gives way to any admission.
        prewarm=env_bool("SLINFER_PREWARM", False, env=env),
    )

"""Settings read once, at the edge, from the environment.

Each service's `__main__` reads its settings here and passes plain values inward; nothing below
the edge touches `os.environ`. Bad values raise `ValueError` naming the variable, so a typo in a
compose file or a shell fails at start with a message that says what to fix.

Environment variables shared by every service (the same names inside and outside Docker):

    SLINFER_NATS_URL    NATS server URL                   (default nats://127.0.0.1:4222)
    SLINFER_REDIS_URL   Redis URL, may carry a password   (default redis://127.0.0.1:6379/0)
    SLINFER_DATA_DIR    where models, profiles and logs live (default .data)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_DATA_DIR = ".data"


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


@dataclass(frozen=True)
class CommonSettings:
    """What every service needs to find the rest of the stack."""

    nats_url: str = DEFAULT_NATS_URL  # SLINFER_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL  # SLINFER_REDIS_URL
    data_dir: Path = Path(DEFAULT_DATA_DIR)  # SLINFER_DATA_DIR

    def __post_init__(self) -> None:
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"SLINFER_NATS_URL must be a nats:// URL, got {self.nats_url!r}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"SLINFER_REDIS_URL must be a redis:// URL, got {self.redis_url!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CommonSettings:
        return cls(
            nats_url=env_str("SLINFER_NATS_URL", DEFAULT_NATS_URL, env=env),
            redis_url=env_str("SLINFER_REDIS_URL", DEFAULT_REDIS_URL, env=env),
            data_dir=Path(env_str("SLINFER_DATA_DIR", DEFAULT_DATA_DIR, env=env)),
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
    )

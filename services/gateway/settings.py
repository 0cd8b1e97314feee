"""Gateway settings: one frozen dataclass, read once from the environment at the edge.

Every value is checked here, so a bad configuration fails at start with a message that names the
variable, never later inside a request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from shared.settings import (DEFAULT_NATS_URL, DEFAULT_REDIS_URL, ENV_STREAM_REPLICAS,
                             MAX_STREAM_REPLICAS, check_redis_url, env_bool, env_float, env_int,
                             env_nats_url, env_redis_url, env_str, env_stream_replicas,
                             nats_servers)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

ENV_NATS_URL = "SLINFER_NATS_URL"
ENV_REDIS_URL = "SLINFER_REDIS_URL"
ENV_HOST = "SLINFER_GATEWAY_HOST"
ENV_PORT = "SLINFER_GATEWAY_PORT"
ENV_API_KEYS = "SLINFER_API_KEYS"
ENV_MAX_BODY = "SLINFER_MAX_BODY_BYTES"
ENV_TIMEOUT = "SLINFER_REQUEST_TIMEOUT_S"
ENV_DEFAULT_MAX_TOKENS = "SLINFER_DEFAULT_MAX_TOKENS"
ENV_OPERATOR_KEYS = "SLINFER_OPERATOR_KEYS"
ENV_MODEL_ROOTS = "SLINFER_MODEL_ROOTS"
ENV_TENANT_MODELS_DIR = "SLINFER_TENANT_MODELS_DIR"
ENV_TENANT_CONCURRENCY = "SLINFER_TENANT_MAX_CONCURRENCY"
ENV_TENANT_RATE = "SLINFER_TENANT_RATE_LIMIT"
ENV_TENANT_BURST = "SLINFER_TENANT_RATE_BURST"
ENV_MODEL_QUEUE = "SLINFER_MODEL_MAX_QUEUE"
ENV_METRICS_KEY = "SLINFER_METRICS_KEY"
ENV_METRICS_PORT = "SLINFER_GATEWAY_METRICS_PORT"
ENV_METRICS_HOST = "SLINFER_GATEWAY_METRICS_HOST"
ENV_STREAM_QUIET = "SLINFER_STREAM_QUIET_S"
ENV_MAX_RESUMES = "SLINFER_MAX_RESUMES"
ENV_PROFILE_HARDWARE = "SLINFER_PROFILE_HARDWARE"
ENV_MAX_CHOICES = "SLINFER_MAX_CHOICES"
ENV_DIRECT_ADMIT = "SLINFER_DIRECT_ADMIT"
ENV_REGISTRY_CACHE = "SLINFER_REGISTRY_CACHE_S"
ENV_ACCESS_LOG = "SLINFER_GATEWAY_ACCESS_LOG"
MAX_CHOICES_LIMIT = 128  # OpenAI's own bound on n

OPERATOR_TENANT = "operator"  # the tenant an operator key's own requests run as (reserved)


@dataclass(frozen=True)
class GatewaySettings:
    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    stream_replicas: int = 1  # SLINFER_STREAM_REPLICAS: copies of each JetStream stream
    host: str = "127.0.0.1"  # address uvicorn binds; loopback only when auth is off
    port: int = 8000
    # API key -> tenant. Empty: no auth, every caller is tenant "local", loopback only.
    api_keys: Mapping[str, str] = field(default_factory=dict, hash=False, repr=False)
    max_body_bytes: int = 1 << 20  # request bodies above this get 413 before being read
    request_timeout_s: float = 300.0  # submission to final token; then cancel and 504
    # When a request names no max_tokens: None lets it run to the end of the model's context,
    # as OpenAI and vLLM do (clients such as LangChain and OpenWebUI send none and expect the
    # whole answer); a number caps it (still within the context).
    default_max_tokens: int | None = None
    # Operator keys: the admin rights (public models, any model, metrics). With no keys at all
    # (no auth), the local caller is the operator.
    operator_keys: frozenset[str] = field(default_factory=frozenset, hash=False, repr=False)
    # Directories the operator may register models from; empty: anywhere.
    model_roots: tuple[Path, ...] = ()
    # Tenant T registers private models from <dir>/T only; None: tenants cannot register.
    tenant_models_dir: Path | None = None
    tenant_max_concurrency: int = 64  # requests in flight per tenant at this gateway; 0 = no cap
    tenant_rate_limit: float = 0.0  # requests/s per tenant (token bucket); 0 = no limit
    tenant_rate_burst: int = 20  # the bucket's size
    model_max_queue: int = 256  # requests in flight per model at this gateway; 0 = no cap
    metrics_key: str | None = field(default=None, repr=False)  # bearer key for /metrics
    metrics_port: int | None = None  # serve /metrics there (not on `port`); None: on `port`
    metrics_host: str = "127.0.0.1"
    # A registered model is profiled on the hardware kinds of the live nodes; with no node up,
    # on these (comma-separated in SLINFER_PROFILE_HARDWARE).
    profile_hardware: tuple[str, ...] = ("cpu",)
    # The watchdog (watchdog.py): a token stream quiet this long gets its node asked about it;
    # a request whose node was lost is resumed elsewhere at most this many times.
    stream_quiet_s: float = 5.0
    max_resumes: int = 3
    # The most choices (`n`) one request may ask for: each is a request of its own to the
    # cluster, so one call asks for up to this many generations' capacity (OpenAI allows 128).
    max_choices: int = 16
    # The warm fast path (direct.py): a request for a warm instance goes straight to its node,
    # the placers only where that node refuses it. Off: every request goes through a placer.
    direct_admit: bool = True
    # How long a request's model record is kept here (record_cache.py): an admin change clears
    # it on every gateway at once; a change behind the admin API's back shows after this. 0: a
    # registry read per request.
    registry_cache_s: float = 1.0
    # A log line per HTTP request, when its response ends (access_log.py).
    access_log: bool = True

    def __post_init__(self) -> None:
        nats_servers(self.nats_url, ENV_NATS_URL)
        check_redis_url(self.redis_url, ENV_REDIS_URL)
        if not 1 <= self.stream_replicas <= MAX_STREAM_REPLICAS:
            raise ValueError(f"{ENV_STREAM_REPLICAS} must be in 1..{MAX_STREAM_REPLICAS}, got "
                             f"{self.stream_replicas}")
        if not self.host:
            raise ValueError(f"{ENV_HOST} must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{ENV_PORT} must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"{ENV_MAX_BODY} must be at least 1024, got {self.max_body_bytes}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"{ENV_TIMEOUT} must be > 0, got {self.request_timeout_s}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"{ENV_DEFAULT_MAX_TOKENS} must be >= 1, got {self.default_max_tokens}")
        for key, tenant in self.api_keys.items():
            if not key or not tenant:
                raise ValueError(f"{ENV_API_KEYS}: empty key or tenant in {key!r}:{tenant!r}")
            if tenant == OPERATOR_TENANT:
                raise ValueError(f"{ENV_API_KEYS}: tenant name {OPERATOR_TENANT!r} is reserved for "
                                 f"operator keys ({ENV_OPERATOR_KEYS})")
            if self.tenant_models_dir is not None and not _dir_name(tenant):
                raise ValueError(f"{ENV_API_KEYS}: tenant {tenant!r} cannot name a directory under "
                                 f"{ENV_TENANT_MODELS_DIR}")
        if set(self.api_keys) & set(self.operator_keys):
            raise ValueError(f"a key is in both {ENV_API_KEYS} and {ENV_OPERATOR_KEYS}")
        if any(not key for key in self.operator_keys):
            raise ValueError(f"{ENV_OPERATOR_KEYS}: empty key")
        self._check_limits()
        if not self.auth_enabled and self.host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"refusing to bind {self.host!r} without API keys: with {ENV_API_KEYS} unset the "
                f"gateway has no auth and serves only 127.0.0.1/localhost; set {ENV_API_KEYS} "
                f"(comma-separated key:tenant) to listen on {self.host!r}"
            )
        # A read-only view, so the frozen dataclass is frozen all the way down.
        object.__setattr__(self, "api_keys", MappingProxyType(dict(self.api_keys)))
        object.__setattr__(self, "operator_keys", frozenset(self.operator_keys))
        # Absolute and with symlinks followed once here, so every containment check compares
        # real paths.
        object.__setattr__(self, "model_roots", tuple(Path(r).resolve() for r in self.model_roots))
        if self.tenant_models_dir is not None:
            object.__setattr__(self, "tenant_models_dir", Path(self.tenant_models_dir).resolve())

    def _check_limits(self) -> None:
        for name, value in ((ENV_TENANT_CONCURRENCY, self.tenant_max_concurrency),
                            (ENV_MODEL_QUEUE, self.model_max_queue)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no cap), got {value}")
        if not self.tenant_rate_limit >= 0:
            raise ValueError(f"{ENV_TENANT_RATE} must be >= 0 (0 = no limit), got {self.tenant_rate_limit}")
        if self.tenant_rate_burst < 1:
            raise ValueError(f"{ENV_TENANT_BURST} must be >= 1, got {self.tenant_rate_burst}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ValueError(f"{ENV_METRICS_PORT} must be in 1..65535, got {self.metrics_port}")
        if self.metrics_key is not None and not self.metrics_key:
            raise ValueError(f"{ENV_METRICS_KEY} must not be empty")
        if not self.stream_quiet_s > 0:
            raise ValueError(f"{ENV_STREAM_QUIET} must be > 0, got {self.stream_quiet_s}")
        if self.max_resumes < 0:
            raise ValueError(f"{ENV_MAX_RESUMES} must be >= 0, got {self.max_resumes}")
        if not 1 <= self.max_choices <= MAX_CHOICES_LIMIT:
            raise ValueError(f"{ENV_MAX_CHOICES} must be in 1..{MAX_CHOICES_LIMIT}, got "
                             f"{self.max_choices}")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys) or bool(self.operator_keys)

    def tenant_model_root(self, tenant: str) -> Path | None:
        """Where `tenant` may register private models from (None: nowhere)."""
        if self.tenant_models_dir is None or not _dir_name(tenant):
            return None
        return self.tenant_models_dir / tenant

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewaySettings:
        """Unset or blank variables take the defaults; bad values raise ValueError naming them."""
        d = cls.__dataclass_fields__
        return cls(
            nats_url=env_nats_url(env),
            redis_url=env_redis_url(env),
            stream_replicas=env_stream_replicas(env),
            host=env_str(ENV_HOST, d["host"].default, env=env),
            port=env_int(ENV_PORT, d["port"].default, env=env, minimum=0, maximum=65535),
            api_keys=parse_api_keys(env_str(ENV_API_KEYS, "", env=env) or ""),
            max_body_bytes=env_int(ENV_MAX_BODY, d["max_body_bytes"].default, env=env, minimum=1024),
            request_timeout_s=env_float(ENV_TIMEOUT, d["request_timeout_s"].default, env=env,
                                        minimum=0.001),
            default_max_tokens=env_int(ENV_DEFAULT_MAX_TOKENS, d["default_max_tokens"].default,
                                       env=env, minimum=1),
            direct_admit=bool(env_bool(ENV_DIRECT_ADMIT, d["direct_admit"].default, env=env)),
            registry_cache_s=env_float(ENV_REGISTRY_CACHE, d["registry_cache_s"].default,
                                       env=env, minimum=0.0, maximum=60.0),
            access_log=bool(env_bool(ENV_ACCESS_LOG, d["access_log"].default, env=env)),
            **_access_from_env(env),
            **_limits_from_env(env),
        )


def _access_from_env(env: Mapping[str, str] | None) -> dict:
    operator_keys = [k.strip() for k in (env_str(ENV_OPERATOR_KEYS, "", env=env) or "").split(",")]
    roots = env_str(ENV_MODEL_ROOTS, "", env=env) or ""
    tenant_dir = env_str(ENV_TENANT_MODELS_DIR, None, env=env)
    for name, value in ((ENV_MODEL_ROOTS, roots), (ENV_TENANT_MODELS_DIR, tenant_dir or "")):
        if any(part and not os.path.isabs(part) for part in value.split(os.pathsep)):
            raise ValueError(f"{name} must hold absolute paths, got {value!r}")
    port = env_int(ENV_METRICS_PORT, 0, env=env, minimum=0, maximum=65535)
    return {
        "operator_keys": frozenset(k for k in operator_keys if k),
        "model_roots": tuple(Path(r) for r in roots.split(os.pathsep) if r),
        "tenant_models_dir": Path(tenant_dir) if tenant_dir else None,
        "metrics_key": env_str(ENV_METRICS_KEY, None, env=env),
        "metrics_port": port or None,  # 0 or unset: /metrics on the gateway's own port
        "metrics_host": env_str(ENV_METRICS_HOST, "127.0.0.1", env=env),
    }


def _limits_from_env(env: Mapping[str, str] | None) -> dict:
    d = GatewaySettings.__dataclass_fields__
    return {
        "tenant_max_concurrency": env_int(ENV_TENANT_CONCURRENCY, d["tenant_max_concurrency"].default,
                                          env=env, minimum=0),
        "tenant_rate_limit": env_float(ENV_TENANT_RATE, d["tenant_rate_limit"].default, env=env,
                                       minimum=0.0),
        "tenant_rate_burst": env_int(ENV_TENANT_BURST, d["tenant_rate_burst"].default, env=env,
                                     minimum=1),
        "model_max_queue": env_int(ENV_MODEL_QUEUE, d["model_max_queue"].default, env=env,
                                   minimum=0),
        "stream_quiet_s": env_float(ENV_STREAM_QUIET, d["stream_quiet_s"].default, env=env,
                                    minimum=0.001),
        "max_resumes": env_int(ENV_MAX_RESUMES, d["max_resumes"].default, env=env, minimum=0),
        "max_choices": env_int(ENV_MAX_CHOICES, d["max_choices"].default, env=env, minimum=1,
                               maximum=MAX_CHOICES_LIMIT),
        "profile_hardware": _hardware_kinds(env_str(ENV_PROFILE_HARDWARE, "cpu", env=env) or "cpu"),
    }


def _hardware_kinds(raw: str) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(k.strip().lower() for k in raw.split(",") if k.strip()))
    if not kinds or any(k not in ("cpu", "gpu") for k in kinds):
        raise ValueError(f"{ENV_PROFILE_HARDWARE} must list cpu and/or gpu, got {raw!r}")
    return kinds


def _dir_name(tenant: str) -> bool:
    """Whether `tenant` is one plain directory name (no separators, not . or ..)."""
    return tenant not in (".", "..") and "/" not in tenant and "\\" not in tenant \
        and "\0" not in tenant


def parse_api_keys(raw: str) -> dict[str, str]:
    """`key1:tenantA,key2:tenantB` -> {key: tenant}. Blank entries are skipped."""
    keys: dict[str, str] = {}
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, tenant = entry.partition(":")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ValueError(f"{ENV_API_KEYS}: entry {entry!r} is not key:tenant")
        if key in keys:
            raise ValueError(f"{ENV_API_KEYS}: key listed twice ({key[:4]}...)")
        keys[key] = tenant
    return keys

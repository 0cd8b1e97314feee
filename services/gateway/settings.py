"""Gateway settings: one frozen dataclass, read once from the environment at the edge.

Every value is checked here, so a bad configuration fails at start with a message that names the
variable, never later inside a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from shared.settings import DEFAULT_NATS_URL, DEFAULT_REDIS_URL, env_float, env_int, env_str

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

ENV_NATS_URL = "SLINFER_NATS_URL"
ENV_REDIS_URL = "SLINFER_REDIS_URL"
ENV_HOST = "SLINFER_GATEWAY_HOST"
ENV_PORT = "SLINFER_GATEWAY_PORT"
ENV_API_KEYS = "SLINFER_API_KEYS"
ENV_MAX_BODY = "SLINFER_MAX_BODY_BYTES"
ENV_TIMEOUT = "SLINFER_REQUEST_TIMEOUT_S"
ENV_DEFAULT_MAX_TOKENS = "SLINFER_DEFAULT_MAX_TOKENS"


@dataclass(frozen=True)
class GatewaySettings:
    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    host: str = "127.0.0.1"  # address uvicorn binds; loopback only when auth is off
    port: int = 8000
    # API key -> tenant. Empty: no auth, every caller is tenant "local", loopback only.
    api_keys: Mapping[str, str] = field(default_factory=dict, hash=False, repr=False)
    max_body_bytes: int = 1 << 20  # request bodies above this get 413 before being read
    request_timeout_s: float = 300.0  # submission to final token; then cancel and 504
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the context)

    def __post_init__(self) -> None:
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"{ENV_NATS_URL} must be a nats:// URL, got {self.nats_url!r}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{ENV_REDIS_URL} must be a redis:// URL, got {self.redis_url!r}")
        if not self.host:
            raise ValueError(f"{ENV_HOST} must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{ENV_PORT} must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"{ENV_MAX_BODY} must be at least 1024, got {self.max_body_bytes}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"{ENV_TIMEOUT} must be > 0, got {self.request_timeout_s}")
        if self.default_max_tokens < 1:
            raise ValueError(f"{ENV_DEFAULT_MAX_TOKENS} must be >= 1, got {self.default_max_tokens}")
        for key, tenant in self.api_keys.items():
            if not key or not tenant:
                raise ValueError(f"{ENV_API_KEYS}: empty key or tenant in {key!r}:{tenant!r}")
        if not self.api_keys and self.host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"refusing to bind {self.host!r} without API keys: with {ENV_API_KEYS} unset the "
                f"gateway has no auth and serves only 127.0.0.1/localhost; set {ENV_API_KEYS} "
                f"(comma-separated key:tenant) to listen on {self.host!r}"
            )
        # A read-only view, so the frozen dataclass is frozen all the way down.
        object.__setattr__(self, "api_keys", MappingProxyType(dict(self.api_keys)))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewaySettings:
        """Unset or blank variables take the defaults; bad values raise ValueError naming them."""
        d = cls.__dataclass_fields__
        return cls(
            nats_url=env_str(ENV_NATS_URL, DEFAULT_NATS_URL, env=env),
            redis_url=env_str(ENV_REDIS_URL, DEFAULT_REDIS_URL, env=env),
            host=env_str(ENV_HOST, d["host"].default, env=env),
            port=env_int(ENV_PORT, d["port"].default, env=env, minimum=0, maximum=65535),
            api_keys=parse_api_keys(env_str(ENV_API_KEYS, "", env=env) or ""),
            max_body_bytes=env_int(ENV_MAX_BODY, d["max_body_bytes"].default, env=env, minimum=1024),
            request_timeout_s=env_float(ENV_TIMEOUT, d["request_timeout_s"].default, env=env,
                                        minimum=0.001),
            default_max_tokens=env_int(ENV_DEFAULT_MAX_TOKENS, d["default_max_tokens"].default,
                                       env=env, minimum=1),
        )


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

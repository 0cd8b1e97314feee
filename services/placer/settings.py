"""Placer settings, read once from the environment at start."""

from __future__ import annotations

from dataclasses import dataclass

from shared.core.config import CoreConfig
from shared.settings import core_config_from_env, env_float, env_str


@dataclass(frozen=True)
class PlacerSettings:
    nats_url: str
    redis_url: str
    core: CoreConfig
    admit_timeout_s: float = 5.0
    name: str = "placer"
    # JetStream redelivers a request this long after its placer's last sign of life (a placer
    # that died with it in its queue); live placers renew their claim every third of it.
    ack_wait_s: float = 10.0

    @classmethod
    def from_env(cls) -> PlacerSettings:
        core = core_config_from_env()
        return cls(nats_url=env_str("SLINFER_NATS_URL", "nats://127.0.0.1:4222"),
                   redis_url=env_str("SLINFER_REDIS_URL", "redis://127.0.0.1:6379/0"),
                   core=core,
                   admit_timeout_s=env_float("SLINFER_ADMIT_TIMEOUT_S", 5.0, minimum=0.1),
                   name=env_str("SLINFER_PLACER_NAME", "placer"),
                   ack_wait_s=env_float("SLINFER_PLACER_ACK_WAIT_S", 10.0, minimum=1.0))

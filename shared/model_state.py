"""A registered model's lifecycle (like `sllm deploy`): registration converts its checkpoint to
the loading-optimized format and profiles it on each hardware kind the cluster has; only then
can the placer serve it.

    converting -> profiling -> ready        (or failed, with the reason)

The state lives in Redis beside the registry (`slinfer:model_state`, one JSON per model), so the
registry's records stay what the admin API wrote. Jobs go to the profiler services through the
JetStream stream `SLINFER_JOBS` (one subject per hardware kind): a profiler that dies mid-job
leaves it to be redelivered, and a registration made while no profiler runs waits for one.

A model with no state entry (registered before this existed, or profiled by hand with
`slinfer profile`) is ready when it has a profile.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import asdict, dataclass, field

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError
from redis.asyncio import Redis

from shared import wire
from shared.subjects import MODEL_STATE_HASH, JOB_STREAM, job_subject


class ModelState(str, enum.Enum):
    CONVERTING = "converting"
    PROFILING = "profiling"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class ModelStatus:
    state: ModelState
    reason: str = ""  # failed: why; otherwise what runs now
    progress: float = 0.0  # 0..1 of the step that runs now
    hardware: dict[str, str] = field(default_factory=dict)  # kind -> its state ("ready", ...)
    updated: float = 0.0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "state": self.state.value}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelStatus:
        data = json.loads(text)
        return cls(ModelState(data["state"]), data.get("reason", ""), float(data.get("progress", 0.0)),
                   dict(data.get("hardware", {})), float(data.get("updated", 0.0)))


@dataclass(frozen=True)
class ProfileJob:
    """Convert and profile one model on one hardware kind (gateway -> profiler service)."""

    model: str  # the registry's name (id) of the model
    hardware: str  # "cpu" | "gpu"
    requested_at: float = 0.0


def overall(hardware: dict[str, str]) -> ModelState:
    """A model is ready once one kind is (the placer uses what it has); failed only if all are."""
    states = set(hardware.values())
    if ModelState.READY.value in states:
        return ModelState.READY
    if states and states <= {ModelState.FAILED.value}:
        return ModelState.FAILED
    if ModelState.PROFILING.value in states:
        return ModelState.PROFILING
    return ModelState.CONVERTING


async def get_status(redis: Redis, model: str) -> ModelStatus | None:
    blob = await redis.hget(MODEL_STATE_HASH, model)
    return ModelStatus.from_json(blob) if blob else None


async def all_statuses(redis: Redis) -> dict[str, ModelStatus]:
    out = {}
    for key, blob in (await redis.hgetall(MODEL_STATE_HASH)).items():
        out[key.decode() if isinstance(key, bytes) else key] = ModelStatus.from_json(blob)
    return out


async def set_hardware_state(redis: Redis, model: str, hardware: str, state: ModelState,
                             reason: str = "", progress: float = 0.0) -> ModelStatus:
    """One hardware kind's step changed; the model's state is derived from all kinds'."""
    current = await get_status(redis, model)
    kinds = dict(current.hardware) if current else {}
    kinds[hardware] = state.value
    status = ModelStatus(overall(kinds), reason, progress, kinds, time.time())
    await redis.hset(MODEL_STATE_HASH, model, status.to_json())
    return status


async def forget(redis: Redis, model: str) -> None:
    await redis.hdel(MODEL_STATE_HASH, model)


async def ensure_job_stream(js: JetStreamContext) -> None:
    """Work-queue retention: a job is gone once a profiler acked it."""
    config = StreamConfig(name=JOB_STREAM, subjects=[job_subject("*")],
                          retention=RetentionPolicy.WORK_QUEUE)
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


async def request_profiles(js: JetStreamContext, redis: Redis, model: str,
                           hardware_kinds: list[str]) -> ModelStatus:
    """Start a registered model's lifecycle: one job per hardware kind, state `converting`."""
    await ensure_job_stream(js)
    status = None
    for kind in hardware_kinds:
        status = await set_hardware_state(redis, model, kind, ModelState.CONVERTING, "queued")
        await js.publish(job_subject(kind), wire.encode(ProfileJob(model, kind, time.time())),
                         headers={"Nats-Msg-Id": f"profile:{model}:{kind}:{time.time_ns()}"})
    assert status is not None, "at least one hardware kind"
    return status

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
import re
import time
from dataclasses import asdict, dataclass, field

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import NotFoundError
from redis.asyncio import Redis
from redis.exceptions import WatchError

from shared import wire
from shared.bus import ensure_stream, publish_retrying
from shared.schemas import ModelRecord
from shared.subjects import JOB_STREAM, MODEL_STATE_HASH, PROFILES_HASH, job_subject


class ModelState(str, enum.Enum):
    CONVERTING = "converting"
    PROFILING = "profiling"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class KindStatus:
    """One hardware kind's step of the lifecycle (the profiler of that kind reports it)."""

    state: ModelState
    reason: str = ""  # failed: why; otherwise what runs now ("queued", "profiling on torch")
    progress: float = 0.0  # 0..1 of the step that runs now
    updated: float = 0.0

    def plain(self) -> dict:
        return {"state": self.state.value, "reason": self.reason, "progress": self.progress,
                "updated": self.updated}

    @classmethod
    def from_plain(cls, data: dict) -> KindStatus:
        return cls(ModelState(data["state"]), data.get("reason", ""),
                   float(data.get("progress", 0.0)), float(data.get("updated", 0.0)))


@dataclass(frozen=True)
class ModelStatus:
    state: ModelState
    reason: str = ""  # of the last update (any kind); per kind: `kinds`
    progress: float = 0.0  # of the last update
    hardware: dict[str, str] = field(default_factory=dict)  # kind -> its state ("ready", ...)
    updated: float = 0.0
    kinds: dict[str, KindStatus] = field(default_factory=dict)  # kind -> its step in full

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "state": self.state.value,
                           "kinds": {k: v.plain() for k, v in self.kinds.items()}},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelStatus:
        data = json.loads(text)
        kinds = {k: KindStatus.from_plain(v) for k, v in data.get("kinds", {}).items()}
        return cls(ModelState(data["state"]), data.get("reason", ""), float(data.get("progress", 0.0)),
                   dict(data.get("hardware", {})), float(data.get("updated", 0.0)), kinds)

    def kind(self, hardware: str) -> KindStatus | None:
        """That kind's step (a state written before `kinds` existed: its state only)."""
        if hardware in self.kinds:
            return self.kinds[hardware]
        if hardware in self.hardware:
            return KindStatus(ModelState(self.hardware[hardware]), updated=self.updated)
        return None

    def describe(self, kinds: list[str] | None = None) -> str:
        """For people: "profiling on cpu (profiling on torch, 40%)", "failed on cpu: why";
        of `kinds` (default: every kind)."""
        names = kinds if kinds is not None else sorted(set(self.hardware) | set(self.kinds))
        parts = []
        for name in names:
            k = self.kind(name)
            if k is None:
                continue
            text = f"{k.state.value} on {name}"
            if k.state is ModelState.FAILED:
                text += f": {k.reason or 'no reason given'}"
            elif k.state is not ModelState.READY:
                detail = ", ".join(x for x in (k.reason, f"{k.progress:.0%}" if k.progress else "") if x)
                text += f" ({detail})" if detail else ""
            parts.append(text)
        return "; ".join(parts) or self.state.value


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
    """One hardware kind's step changed; the model's state is derived from all kinds'. A
    read-modify-write under WATCH: profilers of two kinds may report at once."""
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(MODEL_STATE_HASH)
                blob = await pipe.hget(MODEL_STATE_HASH, model)
                status = _with_kind(ModelStatus.from_json(blob) if blob else None, hardware,
                                    KindStatus(state, reason, progress, time.time()))
                pipe.multi()
                pipe.hset(MODEL_STATE_HASH, model, status.to_json())
                await pipe.execute()
                return status
            except WatchError:
                continue  # another kind reported meanwhile: read again


def _with_kind(current: ModelStatus | None, hardware: str, step: KindStatus) -> ModelStatus:
    kinds = {k: current.kind(k) for k in current.hardware} if current else {}
    kinds = {k: v for k, v in kinds.items() if v is not None}
    kinds[hardware] = step
    states = {k: v.state.value for k, v in kinds.items()}
    return ModelStatus(overall(states), step.reason, step.progress, states, step.updated, kinds)


async def forget(redis: Redis, model: str) -> None:
    await redis.hdel(MODEL_STATE_HASH, model)


async def ensure_job_stream(js: JetStreamContext, replicas: int | None = None) -> None:
    """Work-queue retention: a job is gone once a profiler acked it. `replicas`: as in
    `shared.bus.ensure_stream`."""
    await ensure_stream(js, StreamConfig(name=JOB_STREAM, subjects=[job_subject("*")],
                                         retention=RetentionPolicy.WORK_QUEUE), replicas)


async def request_profiles(js: JetStreamContext, redis: Redis, model: str,
                           hardware_kinds: list[str]) -> ModelStatus:
    """Start a registered model's lifecycle: one job per hardware kind, state `converting`."""
    await ensure_job_stream(js)
    status = None
    for kind in hardware_kinds:
        status = await set_hardware_state(redis, model, kind, ModelState.CONVERTING, "queued")
        await _publish_job(js, model, kind)
    assert status is not None, "at least one hardware kind"
    return status


async def _publish_job(js: JetStreamContext, model: str, kind: str,
                       msg_id: str | None = None) -> None:
    # Retried across a stream-leader election under one id: a job is queued once.
    await publish_retrying(js, job_subject(kind), wire.encode(ProfileJob(model, kind, time.time())),
                           {"Nats-Msg-Id": msg_id or f"profile:{model}:{kind}:{time.time_ns()}"})


async def queued_jobs(js: JetStreamContext, kind: str) -> set[str]:
    """The models with a profiling job of `kind` in the queue, waiting or being worked on (a
    work queue deletes a job only when it is acked)."""
    models: set[str] = set()
    seq = 1
    while True:
        try:
            raw = await js.get_msg(JOB_STREAM, seq=seq, subject=job_subject(kind), next=True)
        except NotFoundError:
            return models
        try:
            models.add(wire.decode(ProfileJob, raw.data or b"").model)
        except wire.WireError:
            pass  # the profiler terminates it when delivered
        seq = (raw.seq or seq) + 1


async def requeue_job(js: JetStreamContext, model: str, kind: str, since: float) -> None:
    """Queue `model`'s job of `kind` again. The message id names the lifecycle step it resumes
    (`since`: that step's last update), so profilers starting together queue it once."""
    await _publish_job(js, model, kind, msg_id=f"requeue:{model}:{kind}:{since!r}")


JOINED_REASON = "queued: a {kind} node joined"


async def profile_joining_kind(js: JetStreamContext, redis: Redis, kind: str,
                               records: list[ModelRecord]) -> list[str]:
    """A node of hardware kind `kind` joined the cluster: queue a profiling job of that kind for
    each registered model of `records` that is servable or on its way elsewhere (a profile, or a
    lifecycle step that has not failed, on another kind) and has neither a profile nor a
    lifecycle step of `kind` yet (the first GPU node of a cluster that so far had CPUs only).
    LoRA adapters are not profiled (they run on their base model's profile). Each step is
    claimed under WATCH before its job is published, so nodes of one kind joining at once queue
    each job once. Returns the models it queued a job for."""
    profiled: dict[str, set[str]] = {}
    for key in await redis.hkeys(PROFILES_HASH):
        name, _, hardware = (key.decode() if isinstance(key, bytes) else key).rpartition("|")
        profiled.setdefault(name, set()).add(hardware)
    statuses = await all_statuses(redis)
    queued = []
    for model in [r.name for r in records if r.base_model is None]:
        status, kinds = statuses.get(model), profiled.get(model, set())
        if kind in kinds or (status is not None and status.kind(kind) is not None):
            continue
        elsewhere = status is not None and any(
            (step := status.kind(k)) is not None and step.state is not ModelState.FAILED
            for k in set(status.hardware) | set(status.kinds))
        if not kinds and not elsewhere:
            continue  # failed everywhere, or never started: registering again decides
        if not await _claim(redis, model, kind, kinds):
            continue  # another node of this kind claimed it meanwhile
        await ensure_job_stream(js)
        try:
            await _publish_job(js, model, kind)
        except Exception as exc:
            await set_hardware_state(redis, model, kind, ModelState.FAILED,
                                     f"could not queue the profiling job: {exc!r}; register "
                                     "the model again (replace=true)")
            raise
        queued.append(model)
    return queued


async def _claim(redis: Redis, model: str, kind: str, profiled: set[str]) -> bool:
    """Set `kind`'s step to queued if it has none (kinds profiled without a lifecycle entry
    become `ready` in the same write, so the model's state stays what it serves as)."""
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(MODEL_STATE_HASH)
                blob = await pipe.hget(MODEL_STATE_HASH, model)
                status = ModelStatus.from_json(blob) if blob else None
                if status is not None and status.kind(kind) is not None:
                    await pipe.reset()
                    return False
                now = time.time()
                for done in sorted(profiled):
                    if status is None or status.kind(done) is None:
                        status = _with_kind(status, done, KindStatus(
                            ModelState.READY, "profile stored", 1.0, now))
                status = _with_kind(status, kind, KindStatus(
                    ModelState.CONVERTING, JOINED_REASON.format(kind=kind), 0.0, now))
                pipe.multi()
                pipe.hset(MODEL_STATE_HASH, model, status.to_json())
                await pipe.execute()
                return True
            except WatchError:
                continue


async def mark_ready(redis: Redis, model: str, hardware: str, reason: str) -> ModelStatus:
    """A kind that needs no job (its profile exists already): ready at once."""
    return await set_hardware_state(redis, model, hardware, ModelState.READY, reason, 1.0)


# The placer answers a request for a model that is not servable with one of these codes in its
# error text, so the gateway can tell "not ready" and "failed" from an inference failure
# without a new wire field: "[model_not_ready] ..." / "[model_failed] ...".
NOT_READY = "model_not_ready"
FAILED = "model_failed"
_CODED = re.compile(r"\[(model_not_ready|model_failed)\] (.*)", re.DOTALL)


def lifecycle_error(code: str, message: str) -> str:
    assert code in (NOT_READY, FAILED)
    return f"[{code}] {message}"


def failed_message(model: str, status: ModelStatus, kinds: list[str],
                   hide: tuple[str, ...] = ()) -> str:
    """What a request for `model` is told once its lifecycle failed on `kinds`, by whoever finds
    out (the placer's readiness gate; the node whose load, or the gateway whose tokenizer, found
    the files broken), so the client reads one answer for one cause. `hide`: server paths kept
    out of it."""
    message = f"The model {model!r} could not be made servable: {status.describe(kinds)}."
    for path in hide:
        message = message.replace(path, "<model directory>")
    return message


def failed_error(model: str, status: ModelStatus, kinds: list[str],
                 hide: tuple[str, ...] = ()) -> str:
    """`failed_message` as an error text coded `model_failed` (placer and node answers)."""
    return lifecycle_error(FAILED, failed_message(model, status, kinds, hide))


def files_failure(problem: str, found_by: str) -> str:
    """A lifecycle reason: a load (`found_by`: "node n0", "the gateway") found the model's files
    missing or broken. Serving it again takes fixed files and a new registration (which
    restarts the lifecycle)."""
    return (f"files missing or unreadable (found by {found_by}): {problem}; fix them, then "
            "register the model again (replace=true)")


def failed_locally(kinds: list[str], reason: str) -> ModelStatus:
    """The failed status to answer with when Redis could not store it."""
    steps = {k: KindStatus(ModelState.FAILED, reason) for k in kinds}
    return ModelStatus(ModelState.FAILED, reason,
                       hardware={k: ModelState.FAILED.value for k in kinds}, kinds=steps)


def parse_lifecycle_error(error: str | None) -> tuple[str, str] | None:
    """(code, message) of an error made by `lifecycle_error`, else None."""
    match = _CODED.fullmatch(error or "")
    return (match.group(1), match.group(2)) if match else None

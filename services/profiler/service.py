"""`slinfer profiler`: the service that makes a registered model servable (its lifecycle, see
`shared.model_state`). It takes profiling jobs for its hardware kind from the JetStream work
queue, converts the model's checkpoint to the loading-optimized format, measures its profile on
a real engine, stores it in Redis (where placers and nodes read it) and reports each step and
its progress in the model's state. One job at a time: a profile measured while another runs on
the same machine would be wrong.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from redis.asyncio import Redis

from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model
from shared import wire
from shared.cluster import save_profile
from shared.model_state import ModelState, ProfileJob, ensure_job_stream, set_hardware_state
from shared.registry import ModelRegistry
from shared.settings import env_int, env_str
from shared.subjects import job_subject

log = logging.getLogger("slinfer.profiler")
ACK_WAIT_S = 600.0  # a profile of a real model takes minutes; redelivered only after this
PROGRESS_EVERY_S = 1.0  # state updates at most this often
# `ready` is reported as soon as the profile is stored: nothing reads `ready` before the profile
# is in Redis, a placer that sees `ready` without the profile re-reads the profiles
# (services/placer/readiness.py), and a node asked to start a model it has no profile of re-reads
# them before it refuses (services/node/cluster_sync.py, learn_model).


@dataclass(frozen=True)
class ProfilerSettings:
    nats_url: str
    redis_url: str
    hardware: str = "cpu"  # the kind of hardware this service profiles on
    device: str = "cpu"  # torch device the engine runs on
    max_len: int = 1024
    max_batch: int = 16
    name: str = "profiler-cpu"

    @classmethod
    def from_env(cls) -> ProfilerSettings:
        hardware = env_str("SLINFER_NODE_HARDWARE", "cpu").lower()
        if hardware not in ("cpu", "gpu"):
            raise ValueError(f"SLINFER_NODE_HARDWARE must be cpu or gpu, not {hardware!r}")
        return cls(nats_url=env_str("SLINFER_NATS_URL", "nats://127.0.0.1:4222"),
                   redis_url=env_str("SLINFER_REDIS_URL", "redis://127.0.0.1:6379/0"),
                   hardware=hardware,
                   device=env_str("SLINFER_DEVICE", "cuda:0" if hardware == "gpu" else "cpu"),
                   max_len=env_int("SLINFER_PROFILE_MAX_LEN", 1024, minimum=16),
                   max_batch=env_int("SLINFER_PROFILE_MAX_BATCH", 16, minimum=1),
                   name=f"profiler-{hardware}")


class ProfilerService:
    def __init__(self, settings: ProfilerSettings, nc: NATS, redis: Redis) -> None:
        self.s = settings
        self.nc, self.js, self.redis = nc, nc.jetstream(), redis
        self.registry = ModelRegistry(redis)
        self.done = 0  # jobs finished (ready or failed), for tests and logs

    async def start(self) -> None:
        await ensure_job_stream(self.js)
        self.sub = await self.js.pull_subscribe(
            job_subject(self.s.hardware), durable=f"profiler-{self.s.hardware}",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                msgs = await self.sub.fetch(batch=1, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            for msg in msgs:
                await self.handle(msg)

    async def handle(self, msg: Msg) -> None:
        try:
            job = wire.decode(ProfileJob, msg.data)
        except wire.WireError as exc:
            log.warning("dropping undecodable profiling job: %s", exc)
            await msg.term()
            return
        try:
            await self._profile(job)
        except Exception as exc:  # the model's state says why; the service goes on
            log.exception("profiling %s on %s failed", job.model, job.hardware)
            await set_hardware_state(self.redis, job.model, job.hardware, ModelState.FAILED,
                                     f"{type(exc).__name__}: {exc}")
        self.done += 1
        await msg.ack()

    async def _profile(self, job: ProfileJob) -> None:
        record = await self.registry.get(job.model)
        if record is None:
            raise LookupError(f"model {job.model!r} is not registered (deleted meanwhile?)")
        path = Path(record.path)
        await self._state(job, ModelState.CONVERTING, "converting the checkpoint")
        if record.engine == "torch":  # the torch engine loads the loading-optimized format
            from services.node.loader.convert import convert_checkpoint

            await asyncio.to_thread(convert_checkpoint, path)
        await self._state(job, ModelState.PROFILING, f"profiling on {record.engine}")
        loop = asyncio.get_running_loop()
        last = [0.0]

        def progress(fraction: float) -> None:  # on the profiling thread
            if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
                last[0] = time.monotonic()
                asyncio.run_coroutine_threadsafe(self._state(
                    job, ModelState.PROFILING, f"profiling on {record.engine}", fraction), loop)

        plan = ProfilePlan(max_len=min(self.s.max_len, record.max_context), max_batch=self.s.max_batch)
        profile, _ = await asyncio.to_thread(profile_model, path, record.name, record.engine,
                                             self.s.device, plan, 0, False, progress)
        await save_profile(self.redis, profile)  # first: `ready` promises the profile is there
        await self._state(job, ModelState.READY, "", 1.0)
        log.info("%s is ready on %s (load %.2f s, prefill(512) %.3f s)", record.name,
                 job.hardware, profile.load_s, profile.prefill_s(512))

    async def _state(self, job: ProfileJob, state: ModelState, reason: str,
                     progress: float = 0.0) -> None:
        await set_hardware_state(self.redis, job.model, job.hardware, state, reason, progress)


async def serve(settings: ProfilerSettings, nc, redis, stop, telemetry) -> None:
    del telemetry
    service = ProfilerService(settings, nc, redis)
    await service.start()
    log.info("profiler for %s ready", settings.hardware)
    await service.run(stop)


def main(argv: list[str] | None = None) -> int:
    from shared.service import run_service

    del argv
    return run_service("profiler", ProfilerSettings.from_env, lambda s: s.name, serve)


if __name__ == "__main__":
    import sys

    sys.exit(main())

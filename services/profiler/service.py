"""`slinfer profiler`: the service that makes a registered model servable (its lifecycle, see
`shared.model_state`). It takes profiling jobs for its hardware kind from the JetStream work
queue, converts the model's checkpoint to the loading-optimized format, measures its profile on
a real engine, stores it in Redis (where placers and nodes read it) and reports each step and
its progress in the model's state. One job at a time: a profile measured while another runs on
the same machine would be wrong.

A job survives the service: while it runs the service tells JetStream it is in progress, so a
short ack wait redelivers the job soon after a profiler dies; a profiler that is stopped hands
its job back at once (nak) and exits without waiting for the profile to end; and a profiler that
starts re-queues every model of its kind left converting or profiling with no job in the queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from redis.asyncio import Redis

from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model
from shared import wire
from shared.bus import START_RETRY_S, retrying
from shared.cluster import save_profile
from shared.model_state import (ModelState, ProfileJob, all_statuses, ensure_job_stream,
                                queued_jobs, requeue_job, set_hardware_state)
from shared.registry import ModelRegistry
from shared.settings import env_int, env_nats_url, env_redis_url, env_str, env_stream_replicas
from shared.subjects import JOB_STREAM, job_subject

log = logging.getLogger("slinfer.profiler")
T = TypeVar("T")


class Cancelled(Exception):
    """The service is stopping: the job goes back to the queue."""
# A profile of a real model takes minutes; the service reports the job in progress every
# HEARTBEAT_S, so ACK_WAIT_S only bounds how long a job waits after its profiler died.
ACK_WAIT_S = 30.0
HEARTBEAT_S = 10.0
HAND_BACK_GRACE_S = 5.0  # a stopping service lets the job stop at its next measured point
REQUEUED_REASON = "queued: its profiler stopped mid-job"
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
    stream_replicas: int = 1  # SLINFER_STREAM_REPLICAS: copies of the job stream

    @classmethod
    def from_env(cls) -> ProfilerSettings:
        hardware = env_str("SLINFER_NODE_HARDWARE", "cpu").lower()
        if hardware not in ("cpu", "gpu"):
            raise ValueError(f"SLINFER_NODE_HARDWARE must be cpu or gpu, not {hardware!r}")
        return cls(nats_url=env_nats_url(), redis_url=env_redis_url(),
                   stream_replicas=env_stream_replicas(),
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
        self.handed_back = 0  # jobs given back to the queue because the service stopped

    async def start(self) -> None:
        await ensure_job_stream(self.js, self.s.stream_replicas)
        durable = f"profiler-{self.s.hardware}"
        # Create or update: a durable consumer made by an older version keeps its ack wait.
        # (Each retried while a cluster settles: a profiler started with its servers.)
        await retrying(lambda: self.js.add_consumer(JOB_STREAM, ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
            filter_subject=job_subject(self.s.hardware))), "the job consumer",
            within_s=START_RETRY_S)
        self.sub = await retrying(
            lambda: self.js.pull_subscribe(job_subject(self.s.hardware), durable=durable),
            "the job subscription", within_s=START_RETRY_S)
        requeued = await self.requeue_orphans()
        if requeued:
            log.info("re-queued %s: left mid-lifecycle with no job", ", ".join(requeued))

    async def requeue_orphans(self) -> list[str]:
        """Queue a job again for every model of this kind left converting or profiling with no
        job in the queue (its job was lost with the stream, or never published)."""
        kind = self.s.hardware
        live = await queued_jobs(self.js, kind)
        orphans = []
        for model, status in (await all_statuses(self.redis)).items():
            step = status.kind(kind)
            if step is None or step.state not in (ModelState.CONVERTING, ModelState.PROFILING):
                continue
            if model not in live:
                await requeue_job(self.js, model, kind, step.updated)
                orphans.append(model)
        return orphans

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                msgs = await self.sub.fetch(batch=1, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            for msg in msgs:
                await self.handle(msg, stop)

    async def handle(self, msg: Msg, stop: asyncio.Event | None = None) -> None:
        try:
            job = wire.decode(ProfileJob, msg.data)
        except wire.WireError as exc:
            log.warning("dropping undecodable profiling job: %s", exc)
            await msg.term()
            return
        cancel = threading.Event()
        work = asyncio.create_task(self._profile(job, cancel))
        beat = asyncio.create_task(self._heartbeat(msg, job))
        stopping = asyncio.create_task((stop or asyncio.Event()).wait())
        try:
            await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            beat.cancel()
            stopping.cancel()
        if not work.done():
            cancel.set()
            await asyncio.wait({work}, timeout=HAND_BACK_GRACE_S)
        if not work.done() or isinstance(work.exception(), Cancelled):
            # The profile stops at its next measured point (or dies with the process).
            work.add_done_callback(lambda t: t.cancelled() or t.exception())
            await self._hand_back(job, msg)
            return
        if (exc := work.exception()) is not None:  # the model's state says why; the service goes on
            log.error("profiling %s on %s failed", job.model, job.hardware,
                      exc_info=(type(exc), exc, exc.__traceback__))
            await set_hardware_state(self.redis, job.model, job.hardware, ModelState.FAILED,
                                     f"{type(exc).__name__}: {exc}")
        self.done += 1
        await msg.ack()

    async def _heartbeat(self, msg: Msg, job: ProfileJob) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await msg.in_progress()
            except Exception as exc:  # NATS away: the job may be redelivered; profiling goes on
                log.warning("in-progress for %s on %s not sent: %r", job.model, job.hardware, exc)

    async def _hand_back(self, job: ProfileJob, msg: Msg) -> None:
        """Stopping mid-job: the model waits in the queue again (state first, so a profiler that
        takes the job at once is not overwritten), and the job is redelivered at once."""
        await self._state(job, ModelState.CONVERTING, REQUEUED_REASON)
        await msg.nak()
        self.handed_back += 1
        log.info("handed %s on %s back to the queue", job.model, job.hardware)

    async def _profile(self, job: ProfileJob, cancel: threading.Event) -> None:
        record = await self.registry.get(job.model)
        if record is None:
            raise LookupError(f"model {job.model!r} is not registered (deleted meanwhile?)")
        path = Path(record.path)
        await self._state(job, ModelState.CONVERTING, "converting the checkpoint")
        if record.engine == "torch":  # the torch engine loads the loading-optimized format
            from services.node.loader.convert import convert_checkpoint

            await _on_daemon_thread(convert_checkpoint, path)
        if cancel.is_set():
            raise Cancelled()
        await self._state(job, ModelState.PROFILING, f"profiling on {record.engine}")
        loop = asyncio.get_running_loop()
        last = [0.0]

        def progress(fraction: float) -> None:  # on the profiling thread
            if cancel.is_set():
                raise Cancelled()  # stops the measurement; the engine unloads on the way out
            if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
                last[0] = time.monotonic()
                asyncio.run_coroutine_threadsafe(self._state(
                    job, ModelState.PROFILING, f"profiling on {record.engine}", fraction), loop)

        plan = ProfilePlan(max_len=min(self.s.max_len, record.max_context), max_batch=self.s.max_batch)
        profile, _ = await _on_daemon_thread(profile_model, path, record.name, record.engine,
                                             self.s.device, plan, 0, False, progress)
        if cancel.is_set():
            raise Cancelled()
        await save_profile(self.redis, profile)  # first: `ready` promises the profile is there
        await self._state(job, ModelState.READY, "", 1.0)
        log.info("%s is ready on %s (load %.2f s, prefill(512) %.3f s)", record.name,
                 job.hardware, profile.load_s, profile.prefill_s(512))

    async def _state(self, job: ProfileJob, state: ModelState, reason: str,
                     progress: float = 0.0) -> None:
        await set_hardware_state(self.redis, job.model, job.hardware, state, reason, progress)


async def _on_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a daemon thread. Unlike `asyncio.to_thread`, whose threads the interpreter
    joins at exit, a stopping service does not wait minutes for a profile it handed back."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as err:  # handed to the awaiting task
            result, exc = None, err
        finally:
            _WORKING.discard(threading.current_thread())  # (not when its awaiter is cancelled)
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the loop closed: the service stopped and nobody waits for this

    thread = threading.Thread(target=work, name=f"profiler-{getattr(fn, '__name__', 'job')}",
                              daemon=True)
    _WORKING.add(thread)
    thread.start()
    return await future


# Daemon threads still working (at exit: a handed-back profile still measuring).
_WORKING: set[threading.Thread] = set()


async def serve(settings: ProfilerSettings, nc, redis, stop, telemetry) -> None:
    del telemetry
    service = ProfilerService(settings, nc, redis)
    await service.start()
    log.info("profiler for %s ready", settings.hardware)
    await service.run(stop)


def main(argv: list[str] | None = None) -> int:
    from shared.service import run_service

    del argv
    code = run_service("profiler", ProfilerSettings.from_env, lambda s: s.name, serve)
    if any(t.is_alive() for t in _WORKING):
        # A handed-back profile still runs inside torch on its daemon thread, and the
        # interpreter's exit would tear down the C++ runtime under it (the process aborted:
        # "terminate called without an active exception", exit -6, when a busy box made a
        # measured point outlast the hand-back grace). The job is queued again and the
        # connections are closed: leave without that teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The profiler service on real NATS (JetStream work queue) and valkey with the torch engine: a
registered model goes converting -> profiling -> ready with its profile stored; a model that
cannot be profiled ends `failed` with the reason; the service lives on."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import nats
import pytest
from redis.asyncio import Redis

from services.profiler.service import REQUEUED_REASON, ProfilerService, ProfilerSettings
from shared.cluster import load_perf
from shared.core.types import Hardware
from shared.model_state import (ModelState, get_status, queued_jobs, request_profiles,
                                set_hardware_state)
from shared.registry import ModelRegistry, model_record_from_dir
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_registration_makes_a_model_servable_and_a_broken_one_fails(nats_url, redis_url,
                                                                         tmp_path, demo_model):
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    registry = ModelRegistry(redis)
    good = model_record_from_dir("lifecycle-ok", demo_model(tmp_path / "models"))
    await registry.register(good, replace=True)
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    (broken_dir / "config.json").write_text("{}")  # registered, then the directory is broken
    await registry.register(replace(good, name="lifecycle-broken", path=str(broken_dir)),
                            replace=True)
    service = ProfilerService(ProfilerSettings(nats_url, redis_url, max_len=64, max_batch=2),
                              nc, redis)
    await service.start()
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run(stop))
    seen: set[str] = set()
    try:
        status = await request_profiles(nc.jetstream(), redis, "lifecycle-ok", ["cpu"])
        assert status.state is ModelState.CONVERTING

        async def ready() -> bool:
            s = await get_status(redis, "lifecycle-ok")
            seen.add(s.state.value)
            return s.state is ModelState.READY
        await until(ready, 120.0, "the model to become ready")
        assert "profiling" in seen  # progress was reported on the way
        profile = (await load_perf(redis)).get("lifecycle-ok", Hardware.CPU)
        assert profile is not None and profile.prefill.lengths[-1] == 64
        # Loaded through the loader (the service converted it): the engine's start-up beside the
        # checkpoint read is measured, for a node's q + n/b + start-up estimate.
        assert 0 < profile.engine_init_s < profile.load_s

        await request_profiles(nc.jetstream(), redis, "lifecycle-broken", ["cpu"])

        async def failed() -> bool:
            return (await get_status(redis, "lifecycle-broken")).state is ModelState.FAILED
        await until(failed, 120.0, "the broken model to fail")
        assert (await get_status(redis, "lifecycle-broken")).reason  # says why
        assert service.done == 2 and not runner.done()  # the service lives on
    finally:
        stop.set()
        await runner
        await nc.close()
        await redis.aclose()


async def _start(nats_url: str, redis_url: str, max_len: int, max_batch: int):
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    service = ProfilerService(ProfilerSettings(nats_url, redis_url, max_len=max_len,
                                               max_batch=max_batch), nc, redis)
    await service.start()
    stop = asyncio.Event()
    return service, stop, asyncio.create_task(service.run(stop)), nc, redis


async def _state_is(redis: Redis, model: str, state: ModelState) -> bool:
    status = await get_status(redis, model)
    return status is not None and status.state is state


async def test_a_stopped_profiler_hands_its_job_back_and_the_next_one_finishes_it(own_servers,
                                                                                  tmp_path,
                                                                                  demo_model):
    """Stopped mid-profile (Ctrl+C on `slinfer up`), the service returns without waiting for
    the profile, the model says it is queued again, and the next profiler takes the job at once
    (before, the job was acked when the profile ended, and a killed profiler's job waited for a
    600 s ack wait)."""
    nats_url, redis_url = own_servers
    record = model_record_from_dir("handed-back", demo_model(tmp_path / "models"))
    # A large plan, so the first service is stopped well inside its profile.
    first, stop, runner, nc, redis = await _start(nats_url, redis_url, 512, 32)
    try:
        await ModelRegistry(redis).register(record, replace=True)
        await request_profiles(nc.jetstream(), redis, record.name, ["cpu"])

        await until(lambda: _state_is(redis, record.name, ModelState.PROFILING), 120.0,
                    "the first profiler to start measuring")
        stop.set()
        await runner
        assert first.handed_back == 1 and first.done == 0
        status = await get_status(redis, record.name)
        assert status.state is ModelState.CONVERTING
        assert status.kind("cpu").reason == REQUEUED_REASON

        second, stop2, runner2, nc2, redis2 = await _start(nats_url, redis_url, 64, 2)
        try:
            await until(lambda: _state_is(redis, record.name, ModelState.READY), 120.0,
                        "the second profiler to finish the handed-back job")
            # Its count follows the state by a step of the event loop (the job is acked after
            # the state says ready): read at once on a busy box, it was still 0.
            await until(lambda: second.done == 1, 30.0, "the second profiler to count the job")
        finally:
            stop2.set()
            await runner2
            await nc2.close()
            await redis2.aclose()
    finally:
        stop.set()
        await nc.close()
        await redis.aclose()


async def test_a_starting_profiler_requeues_a_model_left_mid_lifecycle(own_servers, tmp_path,
                                                                     demo_model):
    """A model left `profiling` with no job in the queue (its job lost with the stream) is
    queued again when a profiler starts; one whose job still waits is not queued twice."""
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    models = tmp_path / "models"
    registry = ModelRegistry(redis)
    orphan = model_record_from_dir("orphan", demo_model(models))
    waiting = replace(orphan, name="waiting")
    try:
        for record in (orphan, waiting):
            await registry.register(record, replace=True)
        await set_hardware_state(redis, "orphan", "cpu", ModelState.PROFILING, "profiling on torch")
        await request_profiles(nc.jetstream(), redis, "waiting", ["cpu"])
        assert await queued_jobs(nc.jetstream(), "cpu") == {"waiting"}

        service, stop, runner, nc2, redis2 = await _start(nats_url, redis_url, 64, 2)
        try:
            await until(lambda: _state_is(redis, "orphan", ModelState.READY), 120.0,
                        "the orphaned model to be profiled")
            await until(lambda: _state_is(redis, "waiting", ModelState.READY), 120.0,
                        "the waiting model to be profiled")
            # A job counts as done once acknowledged, just after its model's state says ready.
            await until(lambda: service.done >= 2, 30.0, "both jobs acknowledged")
            # Each once: the waiting one was not queued again.
            assert service.done == 2 and await queued_jobs(nc.jetstream(), "cpu") == set()
        finally:
            stop.set()
            await runner
            await nc2.close()
            await redis2.aclose()
    finally:
        await nc.close()
        await redis.aclose()


async def test_ctrl_c_mid_profile_exits_promptly_and_hands_the_job_back(own_servers, tmp_path,
                                                                       demo_model):
    """SIGINT to a profiler process mid-profile (what `slinfer up` sends on Ctrl+C): it exits 0
    without finishing the profile, and the model waits for the next profiler, queued. Before,
    it finished the whole profile first, and `slinfer up` killed it after 10 s."""
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    record = model_record_from_dir("interrupted", demo_model(tmp_path / "models"))
    env = dict(os.environ, SLINFER_NATS_URL=nats_url, SLINFER_REDIS_URL=redis_url,
               SLINFER_PROFILE_MAX_LEN="512", SLINFER_PROFILE_MAX_BATCH="32",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    log = (tmp_path / "profiler.log").open("wb")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.profiler.service",
                                                env=env, stdout=log, stderr=log)
    try:
        await ModelRegistry(redis).register(record, replace=True)
        await request_profiles(nc.jetstream(), redis, record.name, ["cpu"])
        await until(lambda: _state_is(redis, record.name, ModelState.PROFILING), 180.0,
                    "the profiler process to start measuring")
        proc.send_signal(signal.SIGINT)
        # A bound for a hung process, not a speed measurement: the profile itself runs minutes.
        code = await asyncio.wait_for(proc.wait(), 60.0)
        assert code == 0, (tmp_path / "profiler.log").read_text()[-2000:]
        status = await get_status(redis, record.name)
        assert status.state is ModelState.CONVERTING
        assert status.kind("cpu").reason == REQUEUED_REASON
        assert await queued_jobs(nc.jetstream(), "cpu") == {record.name}
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
        await nc.close()
        await redis.aclose()

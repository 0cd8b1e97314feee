"""The profiler service on real NATS (JetStream work queue) and valkey with the torch engine: a
registered model goes converting -> profiling -> ready with its profile stored; a model that
cannot be profiled ends `failed` with the reason; the service lives on."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import nats
import pytest
from redis.asyncio import Redis

from services.profiler.service import ProfilerService, ProfilerSettings
from shared.cluster import load_perf
from shared.core.types import Hardware
from shared.model_state import ModelState, get_status, request_profiles
from shared.modelgen import ensure_demo_model
from shared.registry import ModelRegistry, model_record_from_dir
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_registration_makes_a_model_servable_and_a_broken_one_fails(nats_url, redis_url,
                                                                         tmp_path):
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    registry = ModelRegistry(redis)
    good = model_record_from_dir("lifecycle-ok", ensure_demo_model(tmp_path / "models"))
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

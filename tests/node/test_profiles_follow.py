"""A model's profiling follows the cluster (shared.model_state), on real NATS and valkey.

- The first node of a hardware kind that joins queues, for every registered model servable (or
  being made servable) elsewhere and not profiled for its kind, one profiling job of that kind;
  a second node of the kind queues none again, and the models keep being served meanwhile.
- `ready` needs no hand-over wait: a node that has not re-read the profiles since the profiler
  stored one admits the model at once (it re-reads them before it would refuse with
  no_profile). Shown with the real profiler service and placer, and a node that would otherwise
  read the profiles only once an hour.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from redis.asyncio import Redis

from services.node.settings import NodeSettings
from services.node.worker import NodeWorker
from services.placer.placer import Placer
from services.placer.readiness import Verdict, judge
from services.placer.settings import PlacerSettings
from services.profiler.service import ProfilerService, ProfilerSettings
from shared import wire
from shared.bus import ensure_streams
from shared.cluster import save_profile
from shared.core.config import CoreConfig
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware
from shared.model_state import (ModelState, ProfileJob, ensure_job_stream, get_status,
                                mark_ready, request_profiles, set_hardware_state)
from shared.registry import ModelRegistry, model_record_from_dir
from shared.schemas import ModelRecord, TokenMessage
from shared.subjects import JOB_STREAM, job_subject

from tests.node.harness import submit, until

pytestmark = pytest.mark.integration


def _settings(node_id: str, hardware: str, nats_url: str, redis_url: str,
              **kw) -> NodeSettings:
    # A "gpu" node here runs on the CPU: what is under test is what its joining queues.
    return NodeSettings(node_id=node_id, hardware=hardware, device="cpu", memory_bytes=2 << 30,
                        matrix_accel=True, nats_url=nats_url, redis_url=redis_url,
                        heartbeat_s=0.05, calibrate=False, **kw)


def _flat(model: str, hardware: Hardware) -> Profile:
    return Profile(model, hardware, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]), load_s=0.5)


async def test_the_first_node_of_a_kind_queues_its_profiling(own_servers):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    js = nc.jetstream()
    await ensure_job_stream(js)
    registry = ModelRegistry(redis)
    for name in ("on-cpu", "by-hand", "under-way", "broken", "gpu-done", "never"):
        await registry.register(ModelRecord(name, f"/models/{name}"))
    # A LoRA adapter of "on-cpu": it runs on its base model's profile, never profiled itself.
    await registry.register(ModelRecord("adapter", "/models/adapter", base_model="on-cpu"))
    await mark_ready(redis, "adapter", "cpu", "LoRA adapter: served by its base model on-cpu")
    await save_profile(redis, _flat("on-cpu", Hardware.CPU))
    await mark_ready(redis, "on-cpu", "cpu", "")
    await save_profile(redis, _flat("by-hand", Hardware.CPU))  # `slinfer profile`: no lifecycle
    await set_hardware_state(redis, "under-way", "cpu", ModelState.PROFILING, "profiling", 0.3)
    await set_hardware_state(redis, "broken", "cpu", ModelState.FAILED, "OSError: no weights")
    await save_profile(redis, _flat("gpu-done", Hardware.GPU))
    # "never": registered around the admin API, no lifecycle and no profile: left alone.
    jobs = await js.pull_subscribe(job_subject("gpu"), durable="profiler-gpu",
                                   config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT))
    first = NodeWorker(_settings("g-1", "gpu", nats_url, redis_url), nc, redis)
    second = NodeWorker(_settings("g-2", "gpu", nats_url, redis_url), nc, redis)
    try:
        await first.start()
        assert first.sync.joined
        queued = []
        for msg in await jobs.fetch(batch=10, timeout=10):
            queued.append(wire.decode(ProfileJob, msg.data))
            await msg.ack()
        assert sorted((j.model, j.hardware) for j in queued) == [
            ("by-hand", "gpu"), ("on-cpu", "gpu"), ("under-way", "gpu")]
        for name in ("on-cpu", "by-hand", "under-way"):
            step = (await get_status(redis, name)).kind("gpu")
            assert step.state is ModelState.CONVERTING and step.reason == "queued: a gpu node joined"
        by_hand = await get_status(redis, "by-hand")
        assert by_hand.state is ModelState.READY  # its CPU profile is recorded as ready
        assert by_hand.kind("cpu").state is ModelState.READY
        # Served on the CPU while the GPU profiles.
        assert judge("by-hand", by_hand, {"cpu"}, {"cpu", "gpu"}).verdict is Verdict.SERVE
        for name in ("broken", "never", "adapter"):
            status = await get_status(redis, name)
            assert status is None or status.kind("gpu") is None
        assert (await get_status(redis, "gpu-done")) is None

        # Another node of the kind: every job is queued (and taken) already; none again.
        await second.start()
        assert second.sync.joined
        assert (await js.stream_info(JOB_STREAM)).state.messages == 0
        assert (await get_status(redis, "on-cpu")).kind("gpu").reason == "queued: a gpu node joined"
    finally:
        await second.stop()
        await first.stop()
        await nc.close()
        await redis.aclose()


@pytest.mark.slow
async def test_a_model_is_served_as_soon_as_the_profiler_says_ready(own_servers, model_dir, tmp_path):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    fresh = tmp_path / "fresh"
    shutil.copytree(model_dir, fresh, ignore=shutil.ignore_patterns("slinfer-checkpoint"))
    record = model_record_from_dir("fresh", fresh)
    await ModelRegistry(redis).register(record)
    # The node is up before the model is registered and would re-read profiles hourly.
    node = NodeWorker(_settings("c-1", "cpu", nats_url, redis_url, profile_refresh_s=3600.0),
                      nc, redis)
    profiler = ProfilerService(ProfilerSettings(nats_url, redis_url, max_len=64, max_batch=2),
                               nc, redis)
    placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig()), nc, redis)
    stop = asyncio.Event()
    await node.start()
    await profiler.start()
    await placer.start()
    tasks = [asyncio.create_task(profiler.run(stop)), asyncio.create_task(placer.run(stop))]
    finals: dict[str, TokenMessage] = {}
    try:
        await request_profiles(nc.jetstream(), redis, record.name, ["cpu"])  # the gateway's part
        deadline = time.monotonic() + 300
        while (status := await get_status(redis, record.name)).state is not ModelState.READY:
            assert status.state is not ModelState.FAILED, status.reason
            assert time.monotonic() < deadline, f"never ready: {status}"
            await asyncio.sleep(0.05)
        assert node.sched.perf.get(record.name, Hardware.CPU) is None  # not read by the node yet

        rid = await submit(nc, record.name, 16, 4, finals, prefix="ready")
        await until(lambda: rid in finals, what="the request for the model just ready")
        assert finals[rid].error is None and finals[rid].node_id == "c-1", finals[rid].error
        assert len(finals[rid].output_token_ids) == 4
        assert placer.decisions.get("not_ready", 0) == 0
        assert node.sched.perf.get(record.name, Hardware.CPU) is not None  # read on admission
        # Converted by the profiler, loaded through the node's loader from the registry's copy.
        assert [(r.model, r.tier, r.ok) for r in node.loads] == [(record.name, "registry", True)]
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await node.stop()
        await nc.close()
        await redis.aclose()

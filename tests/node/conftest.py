"""Fixtures of the node tests: the tiny demo model, its measured profile, NATS + Redis
connections with the profile stored for both test models (a test that needs its own
nats-server and valkey takes `own_servers`, from tests/conftest.py)."""

from __future__ import annotations

from dataclasses import replace

import nats
import pytest
from redis.asyncio import Redis

from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model
from shared.cluster import save_profile

from tests.node.harness import MODELS


@pytest.fixture(scope="session")
def model_dir(demo_model, tmp_path_factory):
    return demo_model(tmp_path_factory.mktemp("share"))


@pytest.fixture(scope="session")
def profile(model_dir):
    # Without the LoRA cost (lora_ranks=()): no node test serves an adapter on this profile (the
    # adapter tests use stand-in profiles), and its measurement (random adapters of two ranks,
    # every batch size) would cost the run more than the tables.
    plan = ProfilePlan(max_len=1024, max_batch=8, repeats=3, lora_ranks=())
    return profile_model(model_dir, "tiny", plan=plan)[0]


@pytest.fixture
async def connections(nats_url, redis_url, profile):
    nc = await nats.connect(nats_url)
    redis = Redis.from_url(redis_url)
    for m in MODELS:
        await save_profile(redis, replace(profile, model=m))
    yield nc, redis
    await nc.close()
    await redis.aclose()


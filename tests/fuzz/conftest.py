"""Fuzzing fixtures: a real gateway on its own nats-server and valkey, the tiny model registered,
and the gateway tests' stand-in responder playing placer and node (so every accepted request is
answered, fast and in full)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis as SyncRedis

from services.gateway.settings import GatewaySettings
from shared import wire
from shared.registry import model_id, model_record_from_dir
from shared.servers import ServerProcess, free_port, start_nats, start_redis
from shared.subjects import MODELS_HASH
from tests.gateway.conftest import RunningGateway, copy_model, start_gateway
from tests.gateway.responder import Responder
from tests.servers import running

KEYS = {"fuzz-a": "tenant-a", "fuzz-b": "tenant-b"}
OPERATOR_KEY = "fuzz-op"


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with running(start_nats, tmp_path_factory.mktemp("fz-nats")) as nats, \
            running(start_redis, tmp_path_factory.mktemp("fz-redis")) as redis:
        yield nats, redis


@pytest.fixture(scope="module")
def model_dir(demo_model, tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory.mktemp("fz-data"))


@pytest.fixture(scope="module")
def gateway(servers, model_dir, tmp_path_factory) -> Iterator[RunningGateway]:
    nats, redis = servers
    tenants = tmp_path_factory.mktemp("fz-tenants")
    for tenant in KEYS.values():
        copy_model(model_dir, tenants / tenant / "tiny")
    base = model_record_from_dir("tiny", model_dir)
    r = SyncRedis.from_url(redis.url)
    for record in (base, dataclasses.replace(base, name=model_id("mine", "tenant-b"),
                                             owner="tenant-b")):
        r.hset(MODELS_HASH, record.name, wire.encode(record))
    r.close()
    gw = start_gateway(GatewaySettings(
        nats_url=nats.url, redis_url=redis.url, host="127.0.0.1", port=free_port(),
        api_keys=KEYS, operator_keys=frozenset({OPERATOR_KEY}), max_body_bytes=64 * 1024,
        request_timeout_s=20.0, default_max_tokens=16, model_roots=(model_dir.parent,),
        tenant_models_dir=tenants))
    yield gw
    gw.stop()


@pytest.fixture
async def responder(gateway: RunningGateway, servers, model_dir):
    from transformers import AutoTokenizer

    r = Responder(servers[0].url, AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    await r.start()
    yield r
    await r.stop()

"""Artifact pre-loading (ServerlessLoRA §4.1) on a real node worker under a real placer, on real
NATS and valkey, with the torch engine and the node's checkpoint loader.

After traffic through an adapter, a fresh instance of its backbone gets the adapter attached
without a request for it; an adapter nobody called is not. With a DRAM tier that holds one
backbone's checkpoint, the most called backbone is read back into it after another's load pushed
it out; once the calls move to the other backbone, the re-plan keeps that one instead.

Across the cluster, the placer's plan puts the checkpoint one node's tier has no room for into
another node's tier, a node that never served it; when the placer's plans stop, the nodes plan
alone again.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import nats
import pytest
from redis.asyncio import Redis

from services.node.loader import LoaderSettings
from services.node.loader.convert import convert_checkpoint
from services.node.settings import NodeSettings
from services.node.worker import NodeWorker
from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared import wire
from shared.adaptergen import build_adapter
from shared.bus import ensure_streams
from shared.cluster import save_profile
from shared.core.config import CoreConfig
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware
from shared.registry import ModelRegistry, model_record_from_dir
from shared.schemas import InferenceRequest, TokenMessage
from shared.subjects import REQUEST_SUBJECT, token_subject

from tests.node.harness import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def backbones(tmp_path_factory, model_dir) -> dict[str, Path]:
    """Two backbones (copies of the tiny model, so two checkpoints), converted."""
    root = tmp_path_factory.mktemp("preload")
    out = {}
    for name in ("bb-a", "bb-b"):
        target = root / name
        shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("slinfer-checkpoint"))
        convert_checkpoint(target)
        out[name] = target
    return out


def _profile(model: str) -> Profile:
    """A stand-in profile: pre-loading is under test, not timing."""
    return Profile(model, Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]), load_s=2.0)


async def _register(redis, backbones: dict[str, Path]):
    """The backbones' records (registered) with their stand-in profiles stored."""
    registry, records = ModelRegistry(redis), {}
    for name, path in backbones.items():
        records[name] = model_record_from_dir(name, path)
        await registry.register(records[name])
        await save_profile(redis, _profile(name))
    return records


async def _submit(nc, model: str, finals: dict[str, TokenMessage], adapter: str | None = None,
                  max_tokens: int = 8) -> str:
    rid = f"pre-{uuid.uuid4().hex[:8]}"

    async def on_token(msg) -> None:
        m = wire.decode(TokenMessage, msg.data)
        if m.finished:
            finals[rid] = m

    await nc.subscribe(token_subject(rid), cb=on_token)
    req = InferenceRequest(rid, "t", model, [5 + i for i in range(16)], max_tokens, time.time(),
                           30.0, 0.5, temperature=0.0, adapter=adapter,
                           adapter_rank=8 if adapter else 0)
    await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req), headers={"Nats-Msg-Id": rid})
    return rid


async def _serve(nc, finals, model: str, adapter: str | None = None, n: int = 1,
                 max_tokens: int = 8) -> None:
    rids = [await _submit(nc, model, finals, adapter, max_tokens) for _ in range(n)]
    await until(lambda: all(r in finals for r in rids), timeout_s=120, what=f"{n} x {model}/{adapter}")
    assert all(finals[r].error is None for r in rids), [finals[r].error for r in rids]


async def test_planned_artifacts_become_resident_without_a_request_and_follow_the_rates(
        own_servers, backbones, tmp_path):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    records = await _register(redis, backbones)
    for name in ("ad-hot", "ad-never"):
        path = build_adapter(backbones["bb-a"], tmp_path / name, rank=8, seed=len(name))
        await ModelRegistry(redis).register(model_record_from_dir(name, path, base=records["bb-a"]))
    checkpoint = records["bb-a"].weight_bytes
    settings = NodeSettings(
        node_id="pre-0", hardware="cpu", device="cpu", memory_bytes=2 << 30, matrix_accel=True,
        nats_url=nats_url, redis_url=redis_url, core=CoreConfig(keep_alive_s=3.0),
        heartbeat_s=0.05, calibrate=False, preload_interval_s=0.2,
        # The DRAM tier holds one backbone's checkpoint, not two.
        loader=LoaderSettings(dram_cache_bytes=int(checkpoint * 1.5)))
    worker = NodeWorker(settings, nc, redis)
    # The node plans alone here (the cluster's plan is the next test's).
    placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig(), preload_interval_s=0), nc, redis)
    stop = asyncio.Event()
    await worker.start()
    await placer.start()
    runner = asyncio.create_task(placer.run(stop))
    finals: dict[str, TokenMessage] = {}
    loader = worker.loader

    def instance(model: str):
        return next((i for i in worker.sched.node.instances if i.model.name == model), None)

    try:
        # Traffic through one adapter of bb-a; then the keep-alive unloads the instance (and
        # with it the adapter).
        await _serve(nc, finals, "bb-a", "ad-hot", n=3)
        await until(lambda: instance("bb-a") is None, timeout_s=60, what="bb-a unloaded")

        # A plain request starts a fresh bb-a instance: the node attaches ad-hot to it on its
        # own (no request for ad-hot comes), and never ad-never, which nobody called.
        await _serve(nc, finals, "bb-a", max_tokens=64)

        def preloaded() -> bool:
            inst = instance("bb-a")
            engine = worker.engines.get(inst.instance_id) if inst is not None else None
            return engine is not None and "ad-hot" in inst.adapters and "ad-hot" in engine.adapters

        await until(preloaded, timeout_s=60, what="ad-hot pre-loaded onto the fresh instance")
        assert "ad-never" not in instance("bb-a").adapters
        assert any("ad-hot" in r.attached for r in worker.preloads)
        assert not any("ad-never" in r.attached for r in worker.preloads)

        # bb-b's cold start reads its checkpoint into the DRAM tier, which pushes bb-a out; bb-a
        # has had the calls, so the re-plan reads it back without any request for it.
        await until(lambda: loader.tier_of(records["bb-a"].path) == "dram", timeout_s=30,
                    what="bb-a in the DRAM tier after its loads")
        read_before = sum(r.read.count("bb-a") for r in worker.preloads)
        await _serve(nc, finals, "bb-b")
        assert any(load.model == "bb-b" for load in worker.loads)
        await until(lambda: loader.tier_of(records["bb-a"].path) == "dram"
                    and sum(r.read.count("bb-a") for r in worker.preloads) > read_before,
                    timeout_s=60, what="bb-a read back into the DRAM tier by the plan")
        assert loader.tier_of(records["bb-b"].path) != "dram"  # room for one: the planned one

        # The calls move to bb-b: its rate overtakes bb-a's (which falls while nobody calls it),
        # and the re-plan keeps bb-b's checkpoint; bb-a is not read back again.
        await _serve(nc, finals, "bb-b", n=8)
        await until(lambda: worker.preloads and worker.preloads[-1].plan.checkpoints == ("bb-b",),
                    timeout_s=60, what="the plan to follow the calls to bb-b")
        await until(lambda: loader.tier_of(records["bb-b"].path) == "dram", timeout_s=60,
                    what="bb-b held in the DRAM tier")
        settled = len(worker.preloads)
        await until(lambda: len(worker.preloads) >= settled + 3, timeout_s=30, what="three re-plans")
        assert loader.tier_of(records["bb-b"].path) == "dram"
        assert not any("bb-a" in r.read for r in list(worker.preloads)[settled:])
    finally:
        stop.set()
        await runner
        await worker.stop()
        await nc.close()
        await redis.aclose()


def _node(name: str, nats_url: str, redis_url: str, nc, redis, dram_bytes: int) -> NodeWorker:
    return NodeWorker(NodeSettings(
        node_id=name, hardware="cpu", device="cpu", memory_bytes=2 << 30, matrix_accel=True,
        nats_url=nats_url, redis_url=redis_url, core=CoreConfig(keep_alive_s=60.0),
        heartbeat_s=0.05, calibrate=False, preload_interval_s=0.2,
        loader=LoaderSettings(dram_cache_bytes=dram_bytes)), nc, redis)


async def test_the_placers_plan_spreads_checkpoints_over_the_nodes_and_nodes_fall_back_without_it(
        own_servers, backbones):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    records = await _register(redis, backbones)
    one = int(records["bb-a"].weight_bytes * 1.5)  # each node's DRAM tier holds one checkpoint
    first = _node("pre-first", nats_url, redis_url, nc, redis, one)
    second = _node("pre-second", nats_url, redis_url, nc, redis, one)
    placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig(), preload_interval_s=0.3),
                    nc, redis)
    stop = asyncio.Event()
    await first.start()
    await placer.start()
    runner = asyncio.create_task(placer.run(stop))
    finals: dict[str, TokenMessage] = {}

    def in_dram(worker: NodeWorker) -> set[str]:
        return {n for n, r in records.items() if worker.loader.tier_of(r.path) == "dram"}

    try:
        # Both backbones called, all on the first node (the only one yet); bb-a the more.
        await _serve(nc, finals, "bb-a", n=2)
        await _serve(nc, finals, "bb-b")
        # A second node joins. One tier cannot hold both checkpoints, and a node planning from
        # its own calls would only juggle them; the placer puts one into the second node's tier.
        await second.start()

        def read_for_the_placer() -> bool:  # the round's record comes after its read is done
            return any(r.source == "placer" and r.read for r in second.preloads)

        await until(lambda: in_dram(first) | in_dram(second) == {"bb-a", "bb-b"}
                    and in_dram(first) and in_dram(second) and read_for_the_placer(),
                    timeout_s=60, what="each backbone's checkpoint in one node's DRAM tier")
        assert not second.loads  # it never loaded either model: it holds one for the cluster
        assert placer.preloader.sent["pre-second"].checkpoints == sorted(in_dram(second))

        # The placer stops: its last plan goes stale and each node plans from its own calls.
        stop.set()
        await runner
        await until(lambda: second.preloads and second.preloads[-1].source == "node"
                    and first.preloads[-1].source == "node", timeout_s=30,
                    what="the nodes to plan alone once the placer's plan went stale")
        # The second node was never called: alone it plans nothing (and keeps serving).
        assert second.preloads[-1].plan.checkpoints == ()
    finally:
        stop.set()
        await runner
        await first.stop()
        await second.stop()
        await nc.close()
        await redis.aclose()

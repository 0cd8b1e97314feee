"""λScale's locality-driven startup through the real services: node workers (each with its
multicast endpoint, its loader and the torch engine) and a real placer on a real nats-server and
valkey, the `small` demo model.

A burst of four requests, each needing an instance of its own (every destination node has
memory for one instance holding one such request), arrives while one node (a memory node with
no room for an instance) holds the model in its DRAM tier and the others would read it from a
slow registry. The placer starts four new instances, chooses a multicast for each by the
startup estimate, and sends the model in one binomial pipeline from the holder; every
destination's load waits for its copy and loads it from its DRAM tier (byte-identical to the
model's safetensors), and each serves its request (the same greedy output everywhere).

A multicast that cannot start (its source cannot offer the model) does not strand the node that
waits for it: the placer tells it, and its load reads the node's own tiers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import nats
import pytest
from redis.asyncio import Redis

from services.node.worker import NodeWorker
from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared.bus import ensure_streams
from shared.cluster import read_nodes, save_profile
from shared.core.config import CoreConfig
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware
from shared.registry import ModelRegistry, model_record_from_dir
from shared.schemas import CommandKind, InferenceRequest, NodeCommand, NodeReply, TokenMessage
from shared.subjects import node_command_subject, token_subject
from shared import wire

from tests.multicast.conftest import ask, node_settings, small_on_stack, source_and_nodes
from tests.node.harness import submit
from tests.polling import until
from tests.stack import shut_down

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOURCE = "mc-src"
DESTS = ["mc-d1", "mc-d2", "mc-d3", "mc-d4"]
CONTEXT = 256  # the record's context: one request of PROMPT + MAX_TOKENS tokens is over half
PROMPT, MAX_TOKENS = 150, 8


def _profile() -> Profile:
    """A stand-in profile (startup is under test, not iteration timing): the registry read
    takes 20 s here (a model store behind a slow link), so multicast is the quicker startup."""
    return Profile("small", Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]),
                   load_s=20.0, engine_init_s=0.05)




async def test_a_burst_scales_small_out_to_four_nodes_by_multicast_and_each_serves(
        own_servers, small_model, small_digests):
    nats_url, redis_url = own_servers
    nc, redis, record = await small_on_stack(own_servers, small_model, CONTEXT, _profile())
    kv_token = record.kv_bytes_per_token
    # One instance with one request (its KV: the 256-token floor) fits; a second request (2 x 160
    # tokens in 16-token blocks) does not: each request of the burst needs its own node.
    one_instance = record.weight_bytes + 300 * kv_token
    workers = source_and_nodes(SOURCE, DESTS, one_instance, record, own_servers, nc, redis)
    placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig(keep_alive_s=120.0)), nc, redis)
    stop = asyncio.Event()
    runner = None
    try:
        for w in workers.values():
            await w.start()
        # The memory node holds the model in its DRAM tier (read once from the registry).
        await asyncio.to_thread(workers[SOURCE].loader.load, record.path)

        async def holder_published() -> bool:
            views = {n.node_id: n for n in await read_nodes(redis)}
            return len(views) == 5 and \
                views[SOURCE].storage.holds.get("small") == "dram" and \
                all(v.storage.multicast_bytes_per_s > 0 for v in views.values())

        await until(holder_published, what="the holder's DRAM tier in the cluster view")
        finals: dict[str, TokenMessage] = {}
        # The whole burst is in the stream before the placer starts: one turn places it.
        rids = [await submit(nc, "small", PROMPT, MAX_TOKENS, finals, prefix="burst")
                for _ in DESTS]
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        await until(lambda: all(r in finals for r in rids), timeout_s=240,
                    what="the burst's four requests")

        for rid in rids:
            assert finals[rid].error is None, finals[rid].error
            assert len(finals[rid].output_token_ids) == MAX_TOKENS
        assert {finals[r].node_id for r in rids} == set(DESTS)  # one instance on each
        outputs = {tuple(finals[r].output_token_ids) for r in rids}
        assert len(outputs) == 1  # same weights, same prompt, greedy: the same tokens

        # One multicast from the holder to the four nodes, every copy whole and in a DRAM tier
        # (its report comes when its last exchange with the holder ends).
        await until(lambda: not placer.scaleout.running, timeout_s=60, what="the multicast's report")
        reports = list(placer.multicast_reports)
        assert len(reports) == 1, [r.to_dict() for r in reports]
        report = reports[0]
        assert report.ok and report.sources == (SOURCE,)
        assert sorted(d.node for d in report.destinations) == DESTS
        assert all(d.registered for d in report.destinations)
        assert placer.decisions.get("new_instance") == 4

        # Every destination's one load waited for its copy and read it from the DRAM tier.
        for d in DESTS:
            loads = list(workers[d].loads)
            assert len(loads) == 1
            load = loads[0]
            assert (load.expected_tier, load.tier, load.ok) == ("multicast", "dram", True), load
            assert not workers[d].arriving
            got = await ask(nc, d, {"op": "digest", "model_path": record.path}, timeout=120)
            assert got["ok"] and got["tier"] == "dram", got
            assert got["tensors"] == small_digests, f"{d} holds different tensors"
        assert not workers[SOURCE].loads  # the holder ran no instance
    finally:
        await shut_down(stop, runner, workers.values(), nc, redis)


async def test_a_node_whose_multicast_never_starts_loads_from_its_tiers(
        own_servers, small_model):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    record = dataclasses.replace(model_record_from_dir("small", small_model), max_context=CONTEXT)
    await ModelRegistry(redis).register(record)
    await save_profile(redis, _profile())
    worker = NodeWorker(node_settings("fb-d1", 1 << 30, nats_url, redis_url), nc, redis)
    placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig()), nc, redis)
    try:
        await worker.start()
        finals: dict[str, TokenMessage] = {}
        req = InferenceRequest("fallback-1", "t", "small", [5 + i for i in range(PROMPT)],
                               MAX_TOKENS, time.time(), 60.0, 0.5, temperature=0.0)

        async def on_token(msg) -> None:
            m = wire.decode(TokenMessage, msg.data)
            if m.finished:
                finals[m.request_id] = m

        await nc.subscribe(token_subject(req.request_id), cb=on_token)
        # Admitted as the placer admits a multicast startup: the node expects the model.
        reply = wire.decode(NodeReply, (await nc.request(node_command_subject("fb-d1"), wire.encode(
            NodeCommand(CommandKind.ADMIT, request=req, model=record, multicast_s=0.5)),
            timeout=30)).data)
        assert reply.accepted, reply.reason
        assert reply.node.storage.arriving.get("small") is not None
        # The placer's multicast finds no source that can offer it.
        await placer.scaleout.multicast(record.path, ["no-such-node"], ["fb-d1"])
        assert not placer.multicast_reports
        await until(lambda: req.request_id in finals, timeout_s=120, what="the request")
        assert finals[req.request_id].error is None
        assert len(finals[req.request_id].output_token_ids) == MAX_TOKENS
        # The node was told the model is not coming (it did not wait out its own patience).
        assert worker.multicast.wait_for_model(record.path, 0.0, 0.0) is False
        load = worker.loads[0]
        assert (load.expected_tier, load.tier, load.ok) == ("multicast", "registry", True)
        assert not worker.arriving
    finally:
        await worker.stop()
        await nc.close()
        await redis.aclose()

"""A node worker's paths that only a stop or a fault takes (real NATS, valkey, torch engine; the
test plays the placer):

1. Stopped mid-generation (SIGTERM: a rolling update, a scale-down): each request it was
   generating goes back to the request stream with every token it streamed, and no error reaches
   its client; placed again (here on a second node), it streams on with no gap and no duplicate.
   The node leaves the cluster view.
2. Past its deadline (the gateway stopped waiting: it timed out or lost its client): the request
   ends as cancelled with why, not run on to max_tokens, and its instance serves the next one.
3. nats-server restarted under a generating node: the node reconnects, its request ends with
   every token, and it admits the next one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import nats
import pytest
from redis.asyncio import Redis

from shared.cluster import save_profile
from shared.schemas import CommandKind, FinishReason, InferenceRequest, NodeCommand
from shared.servers import start_nats
from shared.subjects import node_key
from shared.bus import ensure_streams

from tests.node.harness import MODELS, Harness, Requeued, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1024**2


async def _generating(h: Harness, model: str, max_tokens: int, **kw) -> InferenceRequest:
    req, reply = await h.admit(model, 32, max_tokens, ttft=30.0, **kw)
    assert reply.accepted, reply.reason
    await until(lambda: len(h.tokens[req.request_id]) >= 3, what="the request to stream")
    return req


async def test_a_stopping_node_hands_its_requests_back_and_their_clients_see_no_error(
        connections, model_dir):
    nc, redis = connections
    requeued = Requeued()
    await requeued.start(nc)
    leaving = Harness(nc, redis, model_dir, 512 * MiB, "leave-a")
    staying = Harness(nc, redis, model_dir, 512 * MiB, "leave-b")
    await leaving.worker.start()
    await staying.worker.start()
    try:
        req = await _generating(leaving, "alpha", 900)
        await leaving.worker.stop()
        await until(lambda: requeued.of(req.request_id), what="the hand-back on the stream")
        (back,) = requeued.of(req.request_id)
        streamed = [t for m in leaving.messages[req.request_id] for t in m.token_ids]
        assert back.resumed_token_ids == streamed and back.attempt == req.attempt
        assert req.request_id not in leaving.finals  # no final message: nothing ended
        assert not await redis.exists(node_key("leave-a"))  # out of the cluster view

        # The placer places the handed-back copy on another node: it streams on from there.
        reply = await staying.command(NodeCommand(CommandKind.ADMIT, request=back,
                                                  model=staying.records["alpha"]))
        assert reply.accepted, reply.reason
        await leaving.wait([req], timeout=120)  # the watch is on the request's subject
        final = leaving.finals[req.request_id]
        assert final.error is None and final.finish_reason is FinishReason.LENGTH
        assert len(final.output_token_ids) == 900
        assert leaving.streamed_once(req)
    finally:
        await leaving.worker.stop()
        await staying.worker.stop()
        await requeued.sub.unsubscribe()


async def test_a_request_past_its_deadline_ends_and_its_instance_serves_on(connections, model_dir):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 512 * MiB, "leave-deadline")
    await h.worker.start()
    try:
        req = h.request("alpha", 32, 900, ttft=30.0)
        req = replace(req, deadline=time.time() + 0.5)  # the gateway waits half a second
        await h.watch(req)
        reply = await h.command(NodeCommand(CommandKind.ADMIT, request=req,
                                            model=h.records["alpha"]))
        assert reply.accepted, reply.reason
        h.instances["alpha"] = reply.instance_id
        await h.wait([req], timeout=60)
        final = h.finals[req.request_id]
        assert final.finish_reason is FinishReason.CANCELLED and "deadline" in (final.error or "")
        assert len(final.output_token_ids) < 900
        nxt, reply = await h.admit("alpha", 32, 20, ttft=30.0)
        assert reply.accepted and reply.instance_id == h.instances["alpha"], reply.reason
        await h.wait([nxt])
        assert h.finals[nxt.request_id].error is None
        assert len(h.finals[nxt.request_id].output_token_ids) == 20
    finally:
        await h.worker.stop()


async def test_a_node_rides_out_a_nats_restart_mid_generation(tmp_path, redis_url, profile,
                                                             model_dir):
    server = start_nats(tmp_path / "nats")
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    redis = Redis.from_url(redis_url)
    for m in MODELS:
        await save_profile(redis, replace(profile, model=m))
    await ensure_streams(nc.jetstream())
    h = Harness(nc, redis, model_dir, 512 * MiB, "leave-nats")
    await h.worker.start()
    try:
        req = await _generating(h, "alpha", 600)
        server = await asyncio.to_thread(server.again)  # same port and JetStream store
        await until(lambda: nc.is_connected, what="the connections to come back")
        # Token messages sent while NATS was away are lost (core NATS): the final message
        # carries the whole output, which is what the gateway keeps.
        await h.wait([req], timeout=120)
        final = h.finals[req.request_id]
        assert final.error is None and len(final.output_token_ids) == 600
        nxt, reply = await h.admit("alpha", 32, 20, ttft=30.0)
        assert reply.accepted, reply.reason
        await h.wait([nxt])
        assert len(h.finals[nxt.request_id].output_token_ids) == 20
    finally:
        await h.worker.stop()
        await nc.close()
        await redis.aclose()
        server.stop()

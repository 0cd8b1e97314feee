"""Token-based multi-round live migration (ServerlessLLM §5) on real services: node workers with
torch engines (the CPU default) on the demo model, real NATS and valkey.

1. A request migrated from A to B while it streams (B loads the model for it) produces exactly
   the greedy output of the same request left alone, streamed once: no gap, no duplicate.
2. A destination that refuses leaves the request on A, which finishes it with the same output.
3. A drain under load (the operator's POST /admin/nodes/{id}/drain on a real gateway, a real
   placer placing new requests meanwhile) loses no request: each one completes with the
   unmigrated reference output, the drained node takes no new work, and its requests end on the
   other node.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from functools import cache

import httpx
import pytest

import services.node.memops as memops_module
from services.node.engines import create_engine
from shared.core.migration import (MigrationPolicy, Next, choose_destination, engine_refusal,
                                   next_step)
from services.gateway.settings import GatewaySettings
from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared import wire
from shared.bus import ensure_streams
from shared.cluster import publish_node, read_nodes
from shared.core.config import CoreConfig
from shared.core.types import Hardware, NodeView
from shared.registry import ModelRegistry
from shared.schemas import CommandKind, MigrationTarget, NodeCommand
from shared.servers import free_port
from shared.subjects import REQUEST_SUBJECT

from tests.gateway.conftest import start_gateway
from tests.reference import greedy_output
from tests.node.harness import Harness, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIG = 4 << 30  # memory of a node with room for everything here
PROMPT, OUT = 256, 160


@cache
def _reference(model_dir: str, prompt_len: int, max_tokens: int) -> tuple[int, ...]:
    """The unmigrated greedy output, straight from a torch engine."""
    prompt = [5 + (i % 1000) for i in range(prompt_len)]  # as Harness.request builds it
    return tuple(greedy_output(model_dir, prompt, max_tokens, kv_capacity_bytes=64 << 20))



async def _nodes(nc, redis, model_dir, b_memory: int = BIG) -> tuple[Harness, Harness]:
    a = Harness(nc, redis, model_dir, BIG, "mig-a", heartbeat_s=0.05)
    b = Harness(nc, redis, model_dir, b_memory, "mig-b", heartbeat_s=0.05)
    await a.worker.start()
    await b.worker.start()
    return a, b


def _sources(h: Harness, rid: str) -> list[str]:
    """The nodes that streamed the request's tokens, in order, each once."""
    nodes: list[str] = []
    for m in h.messages[rid]:
        if m.token_ids and (not nodes or nodes[-1] != m.node_id):
            nodes.append(m.node_id)
    return nodes


def test_round_decisions_are_pure():
    p = MigrationPolicy(commit_delta=2, max_rounds=3)
    assert next_step(p, 0, 40, ended=False) is Next.ROUND
    assert next_step(p, 1, 2, ended=False) is Next.COMMIT
    assert next_step(p, 3, 40, ended=False) is Next.COMMIT  # rounds used up
    assert next_step(p, 0, 40, ended=True) is Next.ABORT
    nodes = [NodeView("a", Hardware.CPU, 10), NodeView("b", Hardware.CPU, 10, draining=True),
             NodeView("c", Hardware.CPU, 5)]
    assert choose_destination(nodes, "m", "a") == ("c", None)  # b drains, a is the source
    assert choose_destination(nodes[:2], "m", "a") is None
    assert engine_refusal("torch") is None
    assert "no extend" in engine_refusal("openvino") and "no extend" in engine_refusal("vllm")


async def test_migrated_request_streams_the_unmigrated_output_once(connections, model_dir):
    nc, redis = connections
    a, b = await _nodes(nc, redis, model_dir)
    try:
        req, reply = await a.admit("alpha", PROMPT, OUT, ttft=30.0)
        assert reply.accepted, reply.reason
        rid = req.request_id
        await until(lambda: len(a.tokens[rid]) >= 20, what="tokens from A")
        # B has no instance of alpha: it loads one for the request, A decoding on meanwhile.
        reply = await a.command(NodeCommand(CommandKind.MIGRATE,
                                            migrations=[MigrationTarget(rid, "mig-b", "")]))
        assert reply.accepted, reply.reason
        await a.wait([req], timeout=120)
        log = next(m for m in a.worker.migrations if m.request_id == rid)
        assert log.ok, log.reason
        final = a.finals[rid]
        assert final.node_id == "mig-b"
        assert tuple(final.output_token_ids) == _reference(model_dir, PROMPT, OUT)
        assert a.streamed_once(req)
        assert _sources(a, rid) == ["mig-a", "mig-b"]
        # A kept streaming while B caught up: more tokens than it had at BEGIN came from A.
        from_a = sum(len(m.token_ids) for m in a.messages[rid] if m.node_id == "mig-a")
        assert from_a >= 20 + sum(n for n, _ in log.rounds)
        assert rid not in a.worker.live and a.worker.status(rid).reason == "moved"
        assert not b.worker.incoming
    finally:
        await a.worker.stop()
        await b.worker.stop()


async def test_a_migrated_request_streams_every_tokens_logprobs(connections, model_dir):
    """Logprobs travel with each token message from both nodes, the token B sampled during the
    commit included; under greedy decoding each token is its own likeliest alternative."""
    nc, redis = connections
    a, b = await _nodes(nc, redis, model_dir)
    try:
        req = replace(a.request("alpha", PROMPT, 60, ttft=30.0), logprobs=2)
        await a.watch(req)
        reply = await a.command(NodeCommand(CommandKind.ADMIT, request=req,
                                            model=a.records["alpha"]))
        assert reply.accepted, reply.reason
        rid = req.request_id
        await until(lambda: len(a.tokens[rid]) >= 10, what="tokens from A")
        reply = await a.command(NodeCommand(CommandKind.MIGRATE,
                                            migrations=[MigrationTarget(rid, "mig-b", "")]))
        assert reply.accepted, reply.reason
        await a.wait([req], timeout=120)
        assert next(m for m in a.worker.migrations if m.request_id == rid).ok
        assert _sources(a, rid) == ["mig-a", "mig-b"] and a.streamed_once(req)
        for m in a.messages[rid]:
            assert len(m.logprobs) == len(m.token_ids), m
            for token, lp in zip(m.token_ids, m.logprobs):
                assert len(lp.top_ids) == 2 and lp.top_ids[0] == token
                assert lp.top_logprobs[0] == lp.logprob <= 0
    finally:
        await a.worker.stop()
        await b.worker.stop()


async def test_a_request_on_the_openvino_engine_is_refused_and_finishes_where_it_runs(connections,
                                                                                      model_dir):
    """The OpenVINO engine cannot take a request's tokens so far (no extend; a recompute at its
    default precision does not continue the same greedy output): the source refuses to migrate
    it and says why, and it finishes on the source, streamed once; a destination asked directly
    refuses too."""
    nc, redis = connections
    a, b = await _nodes(nc, redis, model_dir)
    for h in (a, b):
        h.records["alpha"] = replace(h.records["alpha"], engine="openvino")
    try:
        req, reply = await a.admit("alpha", PROMPT, 64, ttft=60.0)
        assert reply.accepted, reply.reason
        rid = req.request_id
        await until(lambda: len(a.tokens[rid]) >= 5, timeout_s=120, what="tokens from A")
        reply = await a.command(NodeCommand(CommandKind.MIGRATE,
                                            migrations=[MigrationTarget(rid, "mig-b", "")]))
        assert reply.accepted, reply.reason
        await until(lambda: any(m.request_id == rid for m in a.worker.migrations),
                    what="the migration's outcome")
        log = next(m for m in a.worker.migrations if m.request_id == rid)
        assert not log.ok and "openvino engine cannot take" in log.reason and "no extend" in log.reason
        begin = await b.command(NodeCommand(CommandKind.MIGRATE_BEGIN, request=req,
                                            model=a.records["alpha"]))
        assert not begin.accepted and begin.reason.startswith("engine: the openvino engine")
        await a.wait([req], timeout=120)
        assert a.finals[rid].node_id == "mig-a" and len(a.finals[rid].output_token_ids) == 64
        assert a.streamed_once(req) and not b.worker.sched.node.instances
    finally:
        await a.worker.stop()
        await b.worker.stop()


async def test_a_refusing_destination_leaves_the_request_on_the_source(connections, model_dir):
    nc, redis = connections
    a, b = await _nodes(nc, redis, model_dir, b_memory=1 << 20)  # B cannot hold the model
    try:
        req, reply = await a.admit("alpha", PROMPT, OUT, ttft=30.0)
        assert reply.accepted, reply.reason
        rid = req.request_id
        await until(lambda: len(a.tokens[rid]) >= 10, what="tokens from A")
        outcome = await a.worker.migrate_out(rid, "mig-b", None)
        assert not outcome.ok and outcome.reason.startswith("refused"), outcome.reason
        await a.wait([req], timeout=120)
        final = a.finals[rid]
        assert final.node_id == "mig-a"
        assert tuple(final.output_token_ids) == _reference(model_dir, PROMPT, OUT)
        assert a.streamed_once(req) and _sources(a, rid) == ["mig-a"]
        assert not b.worker.incoming and rid not in b.worker.live
    finally:
        await a.worker.stop()
        await b.worker.stop()


async def _publish(h: Harness, model: str, prompt_len: int, max_tokens: int):
    req = h.request(model, prompt_len, max_tokens, ttft=60.0)
    await h.watch(req)
    await h.nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req),
                                   headers={"Nats-Msg-Id": req.request_id})
    return req


async def test_a_drain_under_load_loses_no_request(connections, model_dir, nats_url, redis_url):
    nc, redis = connections
    registry = ModelRegistry(redis)
    a = Harness(nc, redis, model_dir, BIG, "drain-a", heartbeat_s=0.05)
    b = Harness(nc, redis, model_dir, BIG, "drain-b", heartbeat_s=0.05)
    for record in a.records.values():
        await registry.register(record, replace=True)
    await ensure_streams(nc.jetstream())
    placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig(keep_alive_s=30.0)), nc, redis)
    gateway = start_gateway(GatewaySettings(nats_url=nats_url, redis_url=redis_url, port=free_port(),
                                            api_keys={"key-t": "t"}, operator_keys=frozenset({"key-op"})))
    stop = asyncio.Event()
    await a.worker.start()
    await placer.start()
    runner = asyncio.create_task(placer.run(stop))
    try:
        # Load on A alone: both models, several requests streaming.
        first = [await _publish(a, m, PROMPT, OUT) for m in ("alpha", "beta", "alpha", "beta")]
        await until(lambda: all(len(a.tokens[r.request_id]) >= 5 for r in first),
                     what="the first requests to stream on A")
        assert all(r.request_id in a.worker.live for r in first)
        await b.worker.start()
        # The operator's route on a real gateway; a tenant may not drain.
        async with httpx.AsyncClient(base_url=gateway.url, timeout=20, trust_env=False) as http:
            denied = await http.post("/admin/nodes/drain-a/drain", headers={"Authorization": "Bearer key-t"})
            assert denied.status_code == 403
            missing = await http.post("/admin/nodes/nowhere/drain", headers={"Authorization": "Bearer key-op"})
            assert missing.status_code == 404
            resp = await http.post("/admin/nodes/drain-a/drain", headers={"Authorization": "Bearer key-op"})
            assert resp.status_code == 200 and resp.json()["draining"], resp.text
        await _until_async(lambda: _draining_in_view(redis, "drain-a"), what="A's view to drain")
        later = [await _publish(a, m, PROMPT, OUT // 2) for m in ("alpha", "beta")]
        everything = first + later
        try:
            await a.wait(everything, timeout=120)
        except TimeoutError:
            raise AssertionError(_where(a, b, everything)) from None
        for r in everything:
            final = a.finals[r.request_id]
            assert final.error is None, final.error
            assert tuple(final.output_token_ids) == _reference(model_dir, PROMPT, r.max_tokens)
            assert a.streamed_once(r), r.request_id
        assert all(a.finals[r.request_id].node_id == "drain-b" for r in later)  # none to A
        # Only this test's requests: the request stream is the session's, and a placer may also
        # be handed a request an earlier test left unconsumed there (it is served, not checked).
        ours = {r.request_id for r in everything}
        moved = [m for m in a.worker.migrations if m.ok and m.request_id in ours]
        assert moved, [m.reason for m in a.worker.migrations]
        for m in moved:
            assert _sources(a, m.request_id) == ["drain-a", "drain-b"]
        assert a.worker.rt.view().draining
    finally:
        gateway.stop()
        stop.set()
        await runner
        await a.worker.stop()
        await b.worker.stop()


def _where(a: Harness, b: Harness, reqs) -> str:
    """Where each unfinished request is, for a failure message."""
    rows = []
    for r in reqs:
        rid = r.request_id
        if rid in a.finals:
            continue
        at = [f"{h.worker.s.node_id}:{len(h.worker.live[rid].output)}" for h in (a, b)
              if rid in h.worker.live]
        rows.append(f"{rid} streamed {len(a.tokens[rid])} live at {at} incoming "
                    f"{[h.worker.s.node_id for h in (a, b) if rid in h.worker.incoming]} "
                    f"status a={a.worker.status(rid).reason} b={b.worker.status(rid).reason}")
    return "unfinished: " + "; ".join(rows)


async def _draining_in_view(redis, node_id: str) -> bool:
    return any(n.node_id == node_id and n.draining for n in await read_nodes(redis))


async def _until_async(condition, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_drain_planned_on_a_reclaimed_instance_moves_the_request_all_the_same(
        connections, model_dir):
    """Draining A plans on a view that still shows B's instance of the model, which B has just
    unloaded (its keep-alive ran out; the view is a heartbeat old): B refuses it as gone, and
    the drain moves the request to B anyway, which loads an instance for it. Before, the drain
    gave up after that refusal and the request finished on the draining node (a multihost run)."""
    nc, redis = connections
    a = Harness(nc, redis, model_dir, BIG, "stale-a", heartbeat_s=0.05)
    b = Harness(nc, redis, model_dir, BIG, "stale-b", heartbeat_s=600.0)  # its view goes stale
    await a.worker.start()
    await b.worker.start()
    try:
        warm, reply = await b.admit("alpha", 16, 2, ttft=30.0)
        assert reply.accepted, reply.reason
        await b.wait([warm], timeout=60)
        stale = b.worker.rt.view()  # B with its instance of alpha, as a heartbeat would say
        assert [i.model.name for i in stale.instances] == ["alpha"]
        await b.command(NodeCommand(CommandKind.UNLOAD_MODEL, model=b.records["alpha"]))
        await until(lambda: not b.worker.engines, what="B to unload alpha")
        await publish_node(redis, stale, ttl_s=30)  # what A reads: the instance still there

        req, reply = await a.admit("alpha", PROMPT, OUT, ttft=30.0)
        assert reply.accepted, reply.reason
        await until(lambda: len(a.tokens[req.request_id]) >= 5, what="tokens from A")
        reply = await a.command(NodeCommand(CommandKind.DRAIN))
        assert reply.accepted, reply.reason
        await a.wait([req], timeout=120)
        reasons = [m.reason for m in a.worker.migrations if m.request_id == req.request_id]
        assert reasons[0] == "refused: instance_gone" and reasons[-1] == "moved", reasons
        assert a.finals[req.request_id].node_id == "stale-b"
        assert tuple(a.finals[req.request_id].output_token_ids) == _reference(model_dir, PROMPT, OUT)
    finally:
        await a.worker.stop()
        await b.worker.stop()


PACED_S, LONG_OUT = 0.005, 1000  # a request of 1,000 tokens runs 5 s or more on any box


@pytest.fixture
def paced_decode(monkeypatch):
    """Every engine's decode step takes PACED_S at least: the request outlives the drain's first
    try and its retry, however fast this box runs the tiny model."""
    def paced(*args, **kwargs):
        engine = create_engine(*args, **kwargs)
        decode = engine.decode

        def slower(request_ids):
            result = decode(request_ids)
            time.sleep(PACED_S)
            return result
        engine.decode = slower
        return engine
    monkeypatch.setattr(memops_module, "create_engine", paced)


async def test_a_drain_with_no_other_node_in_view_moves_the_request_once_one_appears(
        connections, model_dir, paced_decode):
    """Draining A while no other node is in the cluster view (in a multihost run B's host had
    just healed from a network cut and its heartbeat was not back yet): the drain tries again
    while the request runs and moves it once B appears. Before, it gave up at once and the
    request finished on the draining node."""
    nc, redis = connections
    a = Harness(nc, redis, model_dir, BIG, "alone-a", heartbeat_s=0.05)
    b = Harness(nc, redis, model_dir, BIG, "alone-b", heartbeat_s=0.05)
    await a.worker.start()
    try:
        others = [n.node_id for n in await read_nodes(redis) if n.node_id != "alone-a"]
        assert not others, f"nodes left in the view by earlier tests: {others}"
        req, reply = await a.admit("alpha", PROMPT, LONG_OUT, ttft=30.0)
        assert reply.accepted, reply.reason
        rid = req.request_id
        await until(lambda: len(a.tokens[rid]) >= 5, what="tokens from A")
        assert (await a.command(NodeCommand(CommandKind.DRAIN))).accepted
        await until(lambda: any(m.request_id == rid and m.reason == "no destination"
                                for m in a.worker.migrations), what="a try with nowhere to go")
        assert rid in a.worker.live  # still running on A, not given up on
        await asyncio.sleep(2.5 * MigrationPolicy().drain_retry_s)  # a retry or two, recorded once
        await b.worker.start()
        await a.wait([req], timeout=120)
        reasons = [m.reason for m in a.worker.migrations if m.request_id == rid]
        assert reasons[0] == "no destination" and reasons[-1] == "moved", reasons
        assert reasons.count("no destination") == 1, reasons
        assert a.finals[rid].node_id == "alone-b"
        assert tuple(a.finals[rid].output_token_ids) == _reference(model_dir, PROMPT, LONG_OUT)
    finally:
        await a.worker.stop()
        await b.worker.stop()

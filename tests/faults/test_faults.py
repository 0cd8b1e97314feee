"""One fault at a time, under load, nothing lost: the real services as processes (started the way
`slinfer up` starts them), a steady stream of requests from the official `openai` client
(streaming and not, four at a time), and one fault injected while they run:

1. the placer SIGKILLed and restarted (and a request cancelled while no placer ran stays
   unplaced);
2. a node worker SIGKILLed mid-generation while another node is up: its requests go on on the
   other node from the tokens already streamed, and the node leaves the cluster view within the
   heartbeat TTL;
3. valkey SIGKILLed and restarted empty (no append-only file): nodes, registry and profiles come
   back, no service dies;
4. nats-server SIGKILLed and restarted: services reconnect, the request stream keeps what it held,
   everything it held is answered;
5. the gateway SIGKILLed: its clients get an error at once, not a hang; what it had submitted ends
   on its own; the restarted gateway serves.

After each, every request either completed correctly (all its tokens; the text of a fault-free
run of the same prompt at temperature 0, so no gap and no duplicate) or got a clear error, none
took longer than its deadline, and no request ran twice (one attempt ended on one node only).
The waits poll for recorded events with generous limits; nothing asserts this box's speed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import nats
import pytest
from redis import Redis as SyncRedis

from services.stack import Stack, store_profile
from shared.core.perf_model import Profile
from shared import wire
from shared.core.types import NodeView
from shared.schemas import CancelNotice, InferenceRequest
from shared.subjects import (CANCEL_SUBJECT, PLACER_DURABLE, PROFILES_HASH, REQUEST_STREAM,
                             REQUEST_SUBJECT, node_key)
from tests.faults.conftest import NODES, REQUEST_TIMEOUT_S, SNAPSHOT_TTL_S, wait_for
from tests.faults.load import (MAX_TOKENS, Load, TokenRecorder, check, client_for, one_request,
                               references)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

DEADLINE_S = REQUEST_TIMEOUT_S + 5  # the gateway's deadline, and the time to say so
STEADY = 4  # requests completed before the fault: the stream is steady
COLD = "demo-cold"  # the demo model under a second name, never loaded (`_cold_model`)


@pytest.fixture(scope="module")
def refs(fault_stack: Stack) -> dict[tuple[str, bool], str]:
    return asyncio.run(references(fault_stack.url, fault_stack.model))


async def _steady_load(s: Stack) -> tuple[Load, TokenRecorder]:
    recorder = TokenRecorder(s.nats_url)
    await recorder.start()
    load = Load(s.url, s.model)
    load.start()
    await load.until(lambda: load.completed() >= STEADY, 180, "a steady stream of answers")
    return load, recorder


async def _after_recovery(load: Load, since: float) -> None:
    await load.until(lambda: load.completed(since) >= STEADY, 180,
                     "answers to requests sent after the fault")


# --- 1. the placer -------------------------------------------------------------------------------

def _cold_model(s: Stack, profile: Profile) -> str:
    """A second name for the stack's model, ready at once (its profile stored first) and with no
    instance anywhere: a request for it needs a placer, where one for the served model goes
    straight to its warm instance's node (and is served while no placer runs)."""
    store_profile(s.redis_url, dataclasses.replace(profile, model=COLD))
    r = httpx.post(f"{s.url}/admin/models", headers=s.auth, timeout=30, json={
        "name": COLD, "path": str(s.model_dir), "engine": "torch", "public": True,
        "slo_class": "batch", "replace": True})
    assert r.status_code == 201, r.text
    return COLD


async def _cancelled_while_no_placer(s: Stack, model: str) -> str:
    """A client gives up on a request for `model` (one with no instance) while no placer runs;
    returns the request's id once its cancel is on NATS (the gateway sent it)."""
    nc = await nats.connect(s.nats_url)
    published: asyncio.Queue = asyncio.Queue()
    cancels: set[str] = set()

    async def on_request(msg) -> None:
        req = wire.decode(InferenceRequest, msg.data)
        if req.max_tokens == 77:  # this test's request, nobody else's
            await published.put(req.request_id)

    async def on_cancel(msg) -> None:
        cancels.add(wire.decode(CancelNotice, msg.data).request_id)

    await nc.subscribe(REQUEST_SUBJECT, cb=on_request)
    await nc.subscribe(CANCEL_SUBJECT, cb=on_cancel)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=2.0), trust_env=False) as c:
            with pytest.raises(httpx.ReadTimeout):  # no placer: no token, so the client gives up
                await c.post(f"{s.url}/v1/completions", json={
                    "model": model, "prompt": "given up on", "max_tokens": 77, "stream": True})
        rid = await asyncio.wait_for(published.get(), 30)
        deadline = time.monotonic() + 30
        while rid not in cancels:
            assert time.monotonic() < deadline, "the gateway never cancelled the abandoned request"
            await asyncio.sleep(0.05)
        return rid
    finally:
        await nc.close()


async def test_placer_killed_and_restarted(fault_stack, refs, demo_profile):
    s = fault_stack
    s.heal()
    cold = await asyncio.to_thread(_cold_model, s, demo_profile)
    load, recorder = await _steady_load(s)
    try:
        await asyncio.to_thread(s.kill, "placer")
        # Requests that need a placer meanwhile wait in the stream (warm ones go on directly).
        abandoned = await _cancelled_while_no_placer(s, cold)
        restarted = time.monotonic()
        await asyncio.to_thread(s.restart, "placer")
        await _after_recovery(load, restarted)
        outcomes = await load.stop()
        check(outcomes, refs, DEADLINE_S)
        assert any(o.started < restarted < o.ended for o in outcomes)  # some spanned the outage
        # The cancel was durable: the new placer replayed it and never placed the request
        # (placed requests are announced by their node; every later one was placed and answered).
        assert abandoned not in {m.request_id for m in recorder.messages}
        assert not recorder.ran_twice()
    finally:
        await load.stop()
        await recorder.close()
        # The other tests share the stack and its model list.
        await asyncio.to_thread(httpx.delete, f"{s.url}/admin/models/{cold}", headers=s.auth,
                                timeout=30)


# --- 2. a node worker ----------------------------------------------------------------------------

def _generating(recorder: TokenRecorder) -> tuple[str, str] | None:
    """(node, request) of a request that has streamed a few tokens and not finished yet."""
    tokens: dict[str, int] = {}
    node: dict[str, str] = {}
    done = set()
    for m in list(recorder.messages):
        if m.finished:
            done.add(m.request_id)
        elif m.token_ids and m.node_id:
            tokens[m.request_id] = tokens.get(m.request_id, 0) + len(m.token_ids)
            node[m.request_id] = m.node_id
    for rid, n in tokens.items():
        if rid not in done and n >= 3:
            return node[rid], rid
    return None


async def test_node_killed_mid_generation_its_requests_resume_on_the_other_node(fault_stack, refs):
    s = fault_stack
    s.heal()
    load, recorder = await _steady_load(s)
    redis = SyncRedis.from_url(s.redis_url)
    victim = None
    try:
        victim, rid = await asyncio.to_thread(wait_for, lambda: _generating(recorder), 60,
                                              "a request mid-generation")
        await asyncio.to_thread(s.kill, victim)
        killed = time.monotonic()
        # Its snapshot's TTL is all that keeps it in the view: it expires within the TTL.
        ttl_ms = redis.pttl(node_key(victim))
        assert ttl_ms <= SNAPSHOT_TTL_S * 1000, ttl_ms
        await asyncio.to_thread(wait_for, lambda: not redis.exists(node_key(victim)),
                                SNAPSHOT_TTL_S + 30, f"{victim} to leave the cluster view")
        nodes = httpx.get(f"{s.url}/admin/nodes", timeout=10).json()["data"]
        assert victim not in {n["node_id"] for n in nodes}
        await _after_recovery(load, killed)
        outcomes = await load.stop()
        check(outcomes, refs, DEADLINE_S)
        # The request that was mid-generation went on elsewhere as the gateway's next attempt,
        # from its tokens, and its client got the whole, fault-free text.
        other = next(n for n in NODES if n != victim)
        assert (0, victim) in recorder.nodes_of(rid) and (1, other) in recorder.nodes_of(rid), \
            recorder.nodes_of(rid)
        (answer,) = [o for o in outcomes if o.request_id == rid]
        assert answer.ok and answer.started < killed < answer.ended, str(answer)
        assert not recorder.ran_twice()
    finally:
        await load.stop()
        await recorder.close()
        redis.close()
        if victim is not None and not s.alive(victim):
            s.restart(victim)


# --- 3. Redis ------------------------------------------------------------------------------------

async def test_redis_killed_and_restarted_empty(fault_stack, refs):
    s = fault_stack
    s.heal()
    load, recorder = await _steady_load(s)
    try:
        await asyncio.to_thread(s.kill, "redis")
        down = time.monotonic()
        await load.until(lambda: any(o.status == 503 and o.started > down for o in load.outcomes),
                         60, "a 503 while Redis is down")
        await asyncio.to_thread(s.restart_redis, True)  # without its data: nothing durable left
        redis = SyncRedis.from_url(s.redis_url)
        try:
            # Nodes re-publish their views; the placer writes back the registry and the profiles.
            await asyncio.to_thread(wait_for, lambda: all(redis.exists(node_key(n)) for n in NODES),
                                    30, "both nodes back in the cluster view")
            await asyncio.to_thread(wait_for, lambda: redis.hlen(PROFILES_HASH) > 0, 30,
                                    "the profiles back")
            models = await asyncio.to_thread(wait_for, lambda: httpx.get(
                f"{s.url}/v1/models", timeout=10).json().get("data"), 30, "the registry back")
            assert [m["id"] for m in models] == [s.model]
        finally:
            redis.close()
        back = time.monotonic()
        await _after_recovery(load, back)
        outcomes = await load.stop()
        # While Redis was away new requests were told 503 (the registry is unavailable), never
        # 500; what was generating went on.
        check(outcomes, refs, DEADLINE_S, allowed_status=frozenset({503}))
        late = [str(o) for o in outcomes if o.started > back + 2 and not o.ok]
        assert not late, "\n".join(late) + "\n-- placer --\n" + s.log("placer")[-4000:] + \
            "\n-- gateway --\n" + s.log("gateway")[-4000:]
        for name in ("placer", *NODES, "gateway"):
            assert s.alive(name), f"{name} died with Redis:\n{s.log(name)[-3000:]}"
        assert not recorder.ran_twice()
    finally:
        await load.stop()
        await recorder.close()


# --- 4. NATS -------------------------------------------------------------------------------------

async def _request_stream_state(url: str):
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        return (await js.stream_info(REQUEST_STREAM)).state, \
            await js.consumer_info(REQUEST_STREAM, PLACER_DURABLE)
    finally:
        await nc.close()


async def test_nats_killed_and_restarted(fault_stack, refs):
    s = fault_stack
    s.heal()
    load, recorder = await _steady_load(s)
    try:
        before, _ = await _request_stream_state(s.nats_url)
        await asyncio.to_thread(s.kill, "nats")
        await asyncio.sleep(2.0)  # requests meanwhile: 503 once the gateway gives up publishing
        await asyncio.to_thread(s.restart, "nats")
        back = time.monotonic()
        await _after_recovery(load, back)
        outcomes = await load.stop()
        check(outcomes, refs, DEADLINE_S, allowed_status=frozenset({503}))
        # The stream kept what it held (file storage), and the placer's durable consumer got
        # through all of it: nothing is left unacked or undelivered.
        after, _ = await _request_stream_state(s.nats_url)
        assert after.first_seq == before.first_seq and after.last_seq >= before.last_seq

        async def drained() -> bool:
            _, consumer = await _request_stream_state(s.nats_url)
            return consumer.num_pending == 0 and consumer.num_ack_pending == 0

        deadline = time.monotonic() + 60
        while not await drained():
            assert time.monotonic() < deadline, "the placer never got through the request stream"
            await asyncio.sleep(0.2)
        for name in ("placer", *NODES, "gateway"):
            assert s.alive(name), f"{name} died with NATS:\n{s.log(name)[-3000:]}"
        assert not recorder.ran_twice()
    finally:
        await load.stop()
        await recorder.close()


# --- 5. the gateway ------------------------------------------------------------------------------

async def test_gateway_killed_clients_get_an_error_not_a_hang(fault_stack, refs):
    s = fault_stack
    s.heal()
    load, recorder = await _steady_load(s)
    try:
        await asyncio.to_thread(wait_for, lambda: _generating(recorder), 60, "a request mid-generation")
        in_flight_before = len(load.outcomes)
        await asyncio.to_thread(s.kill, "gateway")
        killed = time.monotonic()
        outcomes = await load.stop()  # the clients' requests in flight end now, one way or another
        cut = [o for o in outcomes[in_flight_before:] if o.started < killed]
        assert cut, "no request was in flight when the gateway died"
        for o in cut:  # a closed connection, at once: not the client's 90 s timeout
            assert not o.ok and o.status is None and o.ended - killed < 15, str(o)
        check(outcomes, refs, DEADLINE_S, allow_disconnect=True)
        # What the dead gateway had submitted ends on its own (at max_tokens here, at its
        # deadline at the latest): nothing runs on for nobody.
        redis = SyncRedis.from_url(s.redis_url)

        def nothing_left_on_nodes() -> bool:
            views = [wire.decode(NodeView, blob) for n in NODES
                     if (blob := redis.get(node_key(n))) is not None]
            return not any(i.requests for v in views for i in v.instances)

        try:
            await asyncio.to_thread(wait_for, nothing_left_on_nodes, DEADLINE_S,
                                    "the dead gateway's requests to end")
        finally:
            redis.close()
        await asyncio.to_thread(s.restart, "gateway")
        s.heal()
        client = client_for(s.url, 60)
        try:
            again = await one_request(client, s.model, "after the restart", False, True)
        finally:
            await client.close()
        assert again.ok and again.tokens == MAX_TOKENS, str(again)
    finally:
        await load.stop()
        await recorder.close()

"""Proactive preemption (SLINFER §VIII-A) on real services: two node workers with torch engines,
a real placer, NATS JetStream and valkey.

1. The placer's plan is carried out as planned: a request that needs its instance's KV cache to
   grow, on a node whose memory a smaller neighbour holds, preempts that neighbour in one node
   command; the neighbour's request moves to the instance of its model on the other node that the
   plan validated, and its token stream goes on there with no gap and no duplicate.
2. A node that refuses the preempt-and-admit command leaves the victims untouched.
3. With live preemption (the services' default), the same plan is carried out by live migration:
   the victim's request keeps streaming on A while B recomputes its KV cache, then B takes over;
   its stream has no gap and no duplicate and its greedy output is the unmigrated output. The
   newcomer waits for the handover (its first token comes after B took the victim's request),
   and A unloads the victim only then.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import services.node.memops as memops_module
from services.node.engines import create_engine

from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared import wire
from shared.bus import ensure_streams
from shared.cluster import model_spec, request_view
from shared.core.config import CoreConfig
from shared.core.cost import kv_demand
from shared.core.memory import watermark_target
from shared.core.types import InstanceStatus
from shared.registry import ModelRegistry
from shared.schemas import CommandKind, MigrationTarget, NodeCommand
from shared.subjects import REQUEST_SUBJECT

from tests.node.harness import MODELS, Harness, until
from tests.node.test_migration import _reference, _sources

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CORE = CoreConfig(keep_alive_s=30.0)
LONG = 1000  # output tokens of the beta requests: they outlive the preemption
PROMPT = 900  # three such prompts need more KV than the floor (the model's 2048 tokens)
ALPHA_OUT = 250  # two alpha requests stay within the KV their instance has (no eviction)


def _kv_after(harness: Harness, model: str, reqs) -> int:
    """The KV size an instance has once these requests joined it one by one (§VII-B)."""
    spec = model_spec(harness.records[model])
    kv = 0
    for k in range(1, len(reqs) + 1):
        need = kv_demand(spec, [request_view(r) for r in reqs[:k]])
        kv = max(kv, watermark_target(kv, need, CORE.watermark) or kv)
    return kv



async def _crowded_node_and_a_home_for_the_victim(nc, redis, model_dir, core: CoreConfig = CORE):
    """Node A: alpha with two long requests, beta with one (the smaller neighbour), memory for
    exactly that. Node B: an instance of beta with one long request, and memory for the victim's
    request beside it but not for an instance of alpha: the newcomer's only way in is the
    preemption. (With room for alpha on B, a turn that found the preemption infeasible for a
    moment, say while A's alpha KV was resizing, started alpha on B instead: make test run 45.)"""
    probe = Harness(nc, redis, model_dir, 1, "probe")
    alpha2 = [probe.request("alpha", PROMPT, ALPHA_OUT, ttft=30.0) for _ in range(2)]
    beta1 = [probe.request("beta", 64, LONG, ttft=30.0)]
    beta2 = beta1 + [probe.request("beta", 64, LONG, ttft=30.0)]
    weights = {m: probe.records[m].weight_bytes for m in MODELS}
    memory = sum(weights.values()) + _kv_after(probe, "alpha", alpha2) + _kv_after(probe, "beta", beta1)
    a = Harness(nc, redis, model_dir, memory + 64 * 1024, "pre-a", heartbeat_s=0.05, core=core)
    b = Harness(nc, redis, model_dir, weights["beta"] + _kv_after(probe, "beta", beta2)
                + weights["alpha"] // 2, "pre-b", heartbeat_s=0.05, core=core)
    await a.worker.start()
    await b.worker.start()
    return a, b


async def _admit_long(h: Harness, model: str, prompt: int):
    req, reply = await h.admit(model, prompt, ALPHA_OUT if model == "alpha" else LONG, ttft=30.0)
    assert reply.accepted, reply.reason
    return req


async def _preempted_by_a_newcomer(nc, a: Harness, b: Harness, placer: Placer, stop: asyncio.Event):
    """Fill A (two long alpha requests and the victim, a beta request) and give B a beta instance;
    once the victim streams, start the placer and send it an alpha newcomer whose KV growth only a
    preemption of the victim makes room for. Returns (victim, newcomer, beta instance on A, beta
    instance on B, the placer's task)."""
    for record in a.records.values():
        await ModelRegistry(a.redis).register(record, replace=True)
    for _ in range(2):
        await _admit_long(a, "alpha", PROMPT)
    victim = await _admit_long(a, "beta", 64)
    await _admit_long(b, "beta", 64)
    await until(lambda: len(a.tokens[victim.request_id]) >= 5, what="the victim to stream")
    await placer.start()
    runner = asyncio.create_task(placer.run(stop))
    newcomer = a.request("alpha", PROMPT, 20, ttft=30.0)
    await a.watch(newcomer)
    await ensure_streams(nc.jetstream())
    await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(newcomer),
                                 headers={"Nats-Msg-Id": newcomer.request_id})
    return victim, newcomer, a.instances["beta"], b.instances["beta"], runner


async def test_preemption_moves_the_victims_request_to_the_validated_instance(connections, model_dir,
                                                                             nats_url, redis_url):
    nc, redis = connections
    a, b = await _crowded_node_and_a_home_for_the_victim(nc, redis, model_dir)
    placer = Placer(PlacerSettings(nats_url, redis_url, CORE), nc, redis)
    stop = asyncio.Event()
    try:
        victim, newcomer, beta_on_a, beta_on_b, runner = await _preempted_by_a_newcomer(
            nc, a, b, placer, stop)
        await a.wait([newcomer])
        assert a.finals[newcomer.request_id].node_id == "pre-a", placer.decisions
        assert placer.decisions.get("preempt_and_route") == 1, placer.decisions

        # The victim's instance on A is gone; its request lives on B's beta instance, where the
        # plan validated it, and streams on from where it stopped.
        await until(lambda: victim.request_id in b.worker.live, what="the victim to reach B")
        assert b.worker.live[victim.request_id].instance_id == beta_on_b
        inst = a.worker.sched.node.instance(beta_on_a)
        assert inst is None or inst.status is InstanceStatus.UNLOADING
        await a.wait([victim], timeout=120)
        final = a.finals[victim.request_id]
        assert final.node_id == "pre-b" and len(final.output_token_ids) == LONG
        assert a.streamed_once(victim)
        stop.set()
        await runner
    finally:
        stop.set()
        await a.worker.stop()
        await b.worker.stop()


class _WatchedEngine:
    """The real engine; once `step_s` is set, each of its iterations first sleeps that long (a
    slow step: a command is then all but sure to arrive while one runs). Records an unload that
    came while one of its iterations ran (`torn`)."""

    torn: list[str] = []

    def __init__(self, engine) -> None:
        self._engine, self.step_s, self._running = engine, 0.0, False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _step(self, method, *args):
        self._running = True
        try:
            time.sleep(self.step_s)
            return method(*args)
        finally:
            self._running = False

    def prefill(self, request_id):
        return self._step(self._engine.prefill, request_id)

    def decode(self, request_ids):
        return self._step(self._engine.decode, request_ids)

    def unload(self):
        if self._running:
            self.torn.append(repr(self._engine))
        self._engine.unload()


async def test_a_preempted_victim_is_unloaded_between_its_iterations(connections, model_dir,
                                                                    nats_url, redis_url,
                                                                    monkeypatch):
    """Stop-and-resume preemption unloads the victim only once its running iteration is over: an
    engine freed under a running step fails it (its model is gone mid-forward)."""
    monkeypatch.setattr(memops_module, "create_engine",
                        lambda *a, **kw: _WatchedEngine(create_engine(*a, **kw)))
    _WatchedEngine.torn = []
    nc, redis = connections
    a, b = await _crowded_node_and_a_home_for_the_victim(nc, redis, model_dir)
    placer = Placer(PlacerSettings(nats_url, redis_url, CORE), nc, redis)
    stop = asyncio.Event()
    original = a.admit

    async def admit(model, *args, **kw):  # the victim's steps on A take 0.1 s each
        req, reply = await original(model, *args, **kw)
        if model == "beta":
            await until(lambda: reply.instance_id in a.worker.engines, what="beta loaded on A")
            a.worker.engines[reply.instance_id].step_s = 0.1
        return req, reply

    a.admit = admit
    try:
        victim, newcomer, beta_on_a, _, runner = await _preempted_by_a_newcomer(
            nc, a, b, placer, stop)
        await a.wait([newcomer], timeout=120)
        assert placer.decisions.get("preempt_and_route") == 1, placer.decisions
        await until(lambda: a.worker.sched.node.instance(beta_on_a) is None,
                    what="the victim unloaded")
        assert _WatchedEngine.torn == []
        await a.wait([victim], timeout=120)
        assert a.finals[victim.request_id].node_id == "pre-b"
        assert a.streamed_once(victim)
        stop.set()
        await runner
    finally:
        stop.set()
        await a.worker.stop()
        await b.worker.stop()


async def test_a_node_that_refuses_preempt_and_admit_leaves_the_victims_untouched(connections, model_dir):
    nc, redis = connections
    a, b = await _crowded_node_and_a_home_for_the_victim(nc, redis, model_dir)
    try:
        alpha = [await _admit_long(a, "alpha", PROMPT) for _ in range(2)]
        victim = await _admit_long(a, "beta", 64)
        await _admit_long(b, "beta", 64)
        beta_on_a = a.instances["beta"]
        await until(lambda: len(a.tokens[victim.request_id]) >= 5, what="the victim to stream")
        impossible = a.request("alpha", PROMPT, 20, ttft=0.001)  # no prefill is that fast
        reply = await a.command(NodeCommand(
            CommandKind.PREEMPT_ADMIT, request=impossible, instance_id=a.instances["alpha"],
            preempt_instance_ids=[beta_on_a],
            migrations=[MigrationTarget(victim.request_id, "pre-b", b.instances["beta"])]))
        assert not reply.accepted and reply.evicted == []
        inst = a.worker.sched.node.instance(beta_on_a)
        assert inst is not None and inst.status is InstanceStatus.READY
        assert [r.request_id for r in inst.requests] == [victim.request_id]
        await a.wait([victim, *alpha], timeout=120)
        final = a.finals[victim.request_id]
        assert final.node_id == "pre-a" and len(final.output_token_ids) == LONG
        assert a.streamed_once(victim)
        assert victim.request_id not in b.worker.live
    finally:
        await a.worker.stop()
        await b.worker.stop()


LIVE = CoreConfig(keep_alive_s=30.0, live_preemption=True)


async def test_live_preemption_streams_the_victims_unmigrated_output_once(connections, model_dir,
                                                                          nats_url, redis_url):
    nc, redis = connections
    a, b = await _crowded_node_and_a_home_for_the_victim(nc, redis, model_dir, LIVE)
    placer = Placer(PlacerSettings(nats_url, redis_url, LIVE), nc, redis)
    stop = asyncio.Event()
    try:
        victim, newcomer, beta_on_a, beta_on_b, runner = await _preempted_by_a_newcomer(
            nc, a, b, placer, stop)
        await a.wait([newcomer], timeout=120)
        assert a.finals[newcomer.request_id].node_id == "pre-a"
        assert placer.decisions.get("preempt_and_route") == 1, placer.decisions

        # The victim's request moved live: a migration on A that B committed, to the instance the
        # plan validated, and the victim's instance unloaded after it.
        log = next(m for m in a.worker.migrations if m.request_id == victim.request_id)
        assert log.ok and log.destination == "pre-b", log.reason
        assert b.worker.live[victim.request_id].instance_id == beta_on_b
        await until(lambda: a.worker.sched.node.instance(beta_on_a) is None,
                    what="A to unload the victim's instance")
        # The newcomer waited for the handover: its first token came after B took over.
        assert a.tokens[newcomer.request_id][0] >= log.committed_at
        await a.wait([victim], timeout=180)
        final = a.finals[victim.request_id]
        assert final.node_id == "pre-b" and len(final.output_token_ids) == LONG
        assert tuple(final.output_token_ids) == _reference(model_dir, 64, LONG)
        assert a.streamed_once(victim)
        assert _sources(a, victim.request_id) == ["pre-a", "pre-b"]
        stop.set()
        await runner
    finally:
        stop.set()
        await a.worker.stop()
        await b.worker.stop()

"""CoCoServe's module scaling through the real services: two node workers and a placer on a real
nats-server and valkey, the tiny demo model under two names.

Node A runs an instance of `alpha` that streams a long request. A request for `beta` then finds
no room on either node (A lacks a little, B a lot): the placer queues it, notes the pressure on
A, and the core plans to shed the fewest of alpha's layers that free the deficit to B (which has
room for those layers, not for an instance). B holds the bytes and serves the layers from its
own process; A moves them there with their K/V between two iterations, and alpha's request
streams on: its greedy output equals an unmoved instance's. Then beta fits on A and is served.
Both nodes' published views show the moved bytes (and B the stage's share of its compute). Once
beta's instance is reclaimed the pressure is gone: the placer has alpha take its layers back
while its request still streams, and B lets the stage go.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import nats
import pytest
from redis.asyncio import Redis

from services.node.settings import NodeSettings
from services.node.worker import NodeWorker
from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared import wire
from shared.bus import ensure_streams
from shared.cluster import model_spec, read_nodes, save_profile
from shared.core.config import CoreConfig
from shared.core.cost import kv_demand, layer_weight_bytes, share_spec
from shared.core.module_scaling import ModuleAction, ModuleSettings
from shared.core.modules import stage_key
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import SLO, Hardware, RequestView
from shared.registry import ModelRegistry, model_record_from_dir
from shared.schemas import CommandKind, InferenceRequest, NodeCommand, TokenMessage
from shared.subjects import REQUEST_SUBJECT, token_subject

from tests.polling import until
from tests.stack import shut_down
from tests.reference import greedy_output

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTEXT = 2048
LONG, SHORT = 2000, 8  # alpha's request outlasts the move; beta's is short
PROMPT = list(range(5, 21))
# Shed, not preempt; a measurement window longer than the test: B reports the planned load (and
# the planner predicts with the ceiling) throughout (the harness test below measures).
CORE = CoreConfig(keep_alive_s=120.0, enable_consolidation=False, busy_window_s=600.0)
# Beta's instance goes soon after its request: the room alpha's layers come back into.
SHORT_LIVED = dataclasses.replace(CORE, keep_alive_s=1.0)
WINDOW_S = 0.5  # a host's measurement window for the stages it hosts (the core's is 10 s)
PLANNED = 0.5  # a HOST_LAYERS command's predicted load, until the host has measured it


def _profile(name: str) -> Profile:
    """A stand-in profile (placement is under test, not iteration timing)."""
    return Profile(name, Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]),
                   load_s=0.5, engine_init_s=0.05)


def _settings(node_id: str, memory_bytes: int, nats_url: str, redis_url: str,
              core: CoreConfig = CORE) -> NodeSettings:
    return NodeSettings(node_id=node_id, hardware="cpu", device="cpu", memory_bytes=memory_bytes,
                        matrix_accel=True, nats_url=nats_url, redis_url=redis_url, core=core,
                        heartbeat_s=0.05, calibrate=False)


async def test_a_node_under_memory_pressure_sheds_layers_and_takes_them_back_while_a_request_streams(
        own_servers, model_dir):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    records = {m: dataclasses.replace(model_record_from_dir(m, model_dir), max_context=CONTEXT)
               for m in ("alpha", "beta")}
    for record in records.values():
        await ModelRegistry(redis).register(record)
        await save_profile(redis, _profile(record.name))
    spec = model_spec(records["alpha"])
    assert spec.layers == 4 and 0 < spec.head_bytes < spec.weight_bytes
    view = RequestView("x", "alpha", len(PROMPT), 0.0, SLO(30, 0.5), max_tokens=LONG)
    instance = spec.weight_bytes + int(kv_demand(spec, [view]) * (1 + CORE.watermark))
    beta_view = RequestView("y", "beta", len(PROMPT), 0.0, SLO(60, 0.5), max_tokens=SHORT)
    beta_need = spec.weight_bytes + kv_demand(spec, [beta_view])
    layer = layer_weight_bytes(spec, spec.layers, spec.head_bytes)
    # A: alpha's instance and all beta's needs but half a layer; B: room for a stage of a
    # layer or two, not for an instance.
    a_bytes = instance + beta_need - layer // 2
    b_bytes = instance // 2
    workers = {n: NodeWorker(_settings(n, m, nats_url, redis_url, SHORT_LIVED), nc, redis)
               for n, m in (("mod-a", a_bytes), ("mod-b", b_bytes))}
    placer = Placer(PlacerSettings(nats_url, redis_url, SHORT_LIVED, module_scaling_s=0.1,
                                   modules=ModuleSettings(replicate=False, settle_s=1.0)),
                    nc, redis)
    reference = await asyncio.to_thread(greedy_output, model_dir, PROMPT, LONG)
    stop = asyncio.Event()
    runner = None
    tokens: dict[str, list[tuple[float, int]]] = {}
    finals: dict[str, TokenMessage] = {}

    async def submit(model: str, max_tokens: int) -> str:
        rid = f"{model}-req"
        tokens[rid] = []

        async def on_token(msg, rid=rid) -> None:
            m = wire.decode(TokenMessage, msg.data)
            tokens[rid].extend((time.time(), t) for t in m.token_ids)
            if m.finished:
                finals[rid] = m

        await nc.subscribe(token_subject(rid), cb=on_token)
        req = InferenceRequest(rid, "t", model, PROMPT, max_tokens, time.time(), 60.0, 0.5,
                               temperature=0.0)
        await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req),
                                     headers={"Nats-Msg-Id": rid})
        return rid

    try:
        for w in workers.values():
            await w.start()
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        alpha = await submit("alpha", LONG)
        await until(lambda: len(tokens[alpha]) >= 5, timeout_s=120, what="alpha streaming")
        beta = await submit("beta", SHORT)

        def done(action: ModuleAction) -> list:
            return [r for r in placer.modules.records if r.ok and r.plan.action is action]

        # The move: one shed of alpha's last layers from A to B, carried out.
        await until(lambda: done(ModuleAction.SHED), timeout_s=120, what="the shed")
        [record] = done(ModuleAction.SHED)
        plan = record.plan
        assert (plan.owner_node, plan.host_node, plan.end) == ("mod-a", "mod-b", spec.layers)
        moved = plan.end - plan.start
        assert 1 <= moved < spec.layers and plan.load >= moved / spec.layers  # the ceiling
        key = stage_key(plan.instance_id, plan.start, plan.end)
        hosted = workers["mod-b"].layers.host.get(key)
        assert hosted is not None and hosted.weight_bytes == moved * layer

        # Both views show the move: A's instance is its share, B holds the stage's bytes and
        # reports its share of B's compute (which B's own admissions count).
        async def views_settled() -> bool:
            views = {n.node_id: n for n in await read_nodes(redis)}
            inst = views["mod-a"].instance(plan.instance_id)
            return inst is not None and inst.layout is not None and \
                views["mod-b"].budget_bytes == await asyncio.to_thread(hosted.bytes)

        await until(views_settled, timeout_s=30, what="the views after the move")
        views = {n.node_id: n for n in await read_nodes(redis)}
        inst = views["mod-a"].instance(plan.instance_id)
        assert inst.model == share_spec(spec, spec.layers - moved, spec.layers, spec.head_bytes,
                                        head=True)
        [run] = inst.layout.runs
        assert (run.start, run.end, run.node_id, run.address, run.replica) == \
            (plan.start, plan.end, "mod-b", hosted.address, False)
        assert views["mod-b"].budget_bytes >= moved * layer and not views["mod-b"].instances
        assert views["mod-a"].budget_bytes <= a_bytes
        assert views["mod-b"].stage_load == pytest.approx(plan.load)

        # Beta is served in the room the move made; its instance goes after it (keep-alive),
        # and with the pressure gone alpha takes its layers back.
        await until(lambda: beta in finals, timeout_s=300, what="beta's request")
        assert finals[beta].error is None and finals[beta].node_id == "mod-a"
        assert len(finals[beta].output_token_ids) == SHORT
        await until(lambda: done(ModuleAction.TAKE), timeout_s=120, what="the take-back")
        [take] = done(ModuleAction.TAKE)
        assert (take.plan.instance_id, take.plan.start, take.plan.end, take.plan.host_node,
                take.plan.address) == (plan.instance_id, plan.start, plan.end, "mod-b",
                                       hosted.address)
        assert take.started > record.started + record.seconds
        a_inst = workers["mod-a"].sched.node.instance(plan.instance_id)
        assert a_inst.layout is None and a_inst.model == spec
        await until(lambda: workers["mod-b"].sched.ledger.budget == 0, timeout_s=30,
                    what="B's hold released")
        assert workers["mod-b"].sched.node.stage_load == 0
        assert workers["mod-b"].layers.host.get(key) is None

        # alpha streamed through both: tokens before the shed began and after the take
        # ended, and exactly what an unmoved instance generates.
        await until(lambda: alpha in finals, timeout_s=300, what="alpha's request")
        times = [t for t, _ in tokens[alpha]]
        assert times[0] < record.started and times[-1] > take.started + take.seconds, \
            "alpha's request ended before the take-back: it did not stream through it"
        assert finals[alpha].error is None, finals[alpha].error
        assert finals[alpha].output_token_ids == reference
    finally:
        await shut_down(stop, runner, workers.values(), nc, redis, placer)


# -- the commands, driven by a stand-in placer ---------------------------------------------------


async def test_layer_commands_move_replicate_and_take_back_and_a_refusal_changes_nothing(
        connections, model_dir):
    """HOST_LAYERS / SHED_LAYERS / REPLICATE_LAYERS / DROP_REPLICA / TAKE_LAYERS /
    RELEASE_LAYERS one after the other on one instance whose long request streams all along:
    its output equals an unmoved instance's; every refusal leaves both nodes as they were. B
    reports the moved stage's planned load until it has measured it: ~0 while the stage
    serves nothing, more than 0 while the owner's steps run through it."""
    from tests.node.harness import Harness

    nc, redis = connections
    a = Harness(nc, redis, model_dir, 1 << 30, "lay-a", heartbeat_s=0.05)
    b = Harness(nc, redis, model_dir, 64 << 20, "lay-b", heartbeat_s=0.05,
                core=CoreConfig(keep_alive_s=30.0, busy_window_s=WINDOW_S))
    record = a.records["alpha"]
    spec = model_spec(record)
    layer = layer_weight_bytes(spec, spec.layers, spec.head_bytes)
    reference = await asyncio.to_thread(greedy_output, model_dir, PROMPT, LONG)
    await a.worker.start()
    await b.worker.start()
    try:
        req = dataclasses.replace(a.request("alpha", 0, LONG, ttft=60.0, tpot=1.0),
                                  prompt_token_ids=PROMPT)
        await a.watch(req)
        reply = await a.command(NodeCommand(CommandKind.ADMIT, request=req, model=record))
        assert reply.accepted, reply.reason
        iid = reply.instance_id
        await until(lambda: len(a.tokens[req.request_id]) >= 3, timeout_s=120, what="streaming")
        sched_a, sched_b = a.worker.sched, b.worker.sched
        inst = sched_a.node.instance(iid)
        full_bytes = sched_a.ledger.target(iid)

        def host(start: int, end: int, nbytes: int, load: float = 0.0) -> NodeCommand:
            return NodeCommand(CommandKind.HOST_LAYERS, model=record, instance_id=iid,
                               layer_start=start, layer_end=end, stage_node="lay-a",
                               stage_bytes=nbytes, stage_load=load)

        def to_owner(kind: CommandKind, start: int, end: int, address: str) -> NodeCommand:
            return NodeCommand(kind, instance_id=iid, layer_start=start, layer_end=end,
                               stage_address=address, stage_node="lay-b",
                               hop_latency_s=1e-3, hop_bytes_per_s=1e9)

        # More than B has: refused, nothing held.
        refused = await b.command(host(2, 4, 128 << 20))
        assert not refused.accepted and refused.reason == "memory"
        assert sched_b.ledger.budget == 0 and not b.worker.layers.host.keys()
        # Hosted: B holds the bytes first, the stage serves from B's process.
        hosted = await b.command(host(2, 4, 2 * layer + (4 << 20), load=PLANNED))
        assert hosted.accepted and hosted.stage_address, hosted.reason
        assert hosted.node.budget_bytes == 2 * layer + (4 << 20)
        assert hosted.node.stage_load == pytest.approx(PLANNED)  # not measured yet
        key = stage_key(iid, 2, 4)
        # Serving nothing for a window: B measures it idle, and reports that.
        await until(lambda: sched_b.node.stage_load < PLANNED, timeout_s=30,
                    what="B's measured stage load")
        assert sched_b.node.stage_load == pytest.approx(0.0, abs=1e-6)
        # A shed to a stage that is not there: refused, A's instance unchanged.
        bad = await a.command(to_owner(CommandKind.SHED_LAYERS, 2, 4, "127.0.0.1:1"))
        assert not bad.accepted and bad.reason.startswith("engine:")
        assert inst.layout is None and sched_a.ledger.target(iid) == full_bytes
        # The shed: A holds its share, its layout names the stage.
        shed = await a.command(to_owner(CommandKind.SHED_LAYERS, 2, 4, hosted.stage_address))
        assert shed.accepted, shed.reason
        assert inst.model == share_spec(spec, 2, spec.layers, spec.head_bytes, head=True)
        assert inst.layout.runs[0].address == hosted.stage_address
        assert sched_a.ledger.target(iid) < full_bytes - 2 * layer
        # Now every step of A's runs layers 2-3 on B: B measures its share of its time.
        await until(lambda: sched_b.node.stage_load > 0.01, timeout_s=30,
                    what="B measuring the stage's forwards")
        served = b.worker.layers.measured(key, time.time())
        assert 0.01 < served < 1 and sched_b.node.stage_load == pytest.approx(served, abs=0.05)
        assert req.request_id not in a.finals  # (measured while it streamed)
        # Taken back: A reserves, reads the layers, takes their K/V; then B lets the stage go.
        taken = await a.command(to_owner(CommandKind.TAKE_LAYERS, 2, 4, hosted.stage_address))
        assert taken.accepted, taken.reason
        assert inst.layout is None and inst.model == spec
        assert sched_a.ledger.target(iid) >= full_bytes
        released = await b.command(NodeCommand(CommandKind.RELEASE_LAYERS, instance_id=iid,
                                               layer_start=2, layer_end=4))
        assert released.accepted
        await until(lambda: sched_b.ledger.budget == 0 and not sched_b.ledger.running(),
                    what="B's hold released")
        assert not b.worker.layers.host.keys()
        # A replica of layers 1-2 on B, then dropped (its requests' K/V comes back).
        hosted = await b.command(host(1, 3, 2 * layer + (4 << 20)))
        assert hosted.accepted, hosted.reason
        rep = await a.command(to_owner(CommandKind.REPLICATE_LAYERS, 1, 3, hosted.stage_address))
        assert rep.accepted, rep.reason
        assert inst.layout.runs[0].replica and inst.model == spec  # nothing left A
        assert a.worker.engines[iid].layout().replicas == ((1, 3, hosted.stage_address),)
        dropped = await a.command(to_owner(CommandKind.DROP_REPLICA, 1, 3, hosted.stage_address))
        assert dropped.accepted, dropped.reason
        assert inst.layout is None and a.worker.engines[iid].layout().replicas == ()
        await a.wait([req], timeout=300)
        final = a.finals[req.request_id]
        assert final.error is None and final.output_token_ids == reference
        assert a.streamed_once(req)
    finally:
        await a.worker.stop()
        await b.worker.stop()


async def _in_view(redis: Redis, request_id: str) -> bool:
    return any(r.request_id == request_id for n in await read_nodes(redis) for i in n.instances
               for r in i.requests)


def _linear(name: str, per_request_s: float) -> Profile:
    """Decode time proportional to the batch (what replicas split)."""
    return Profile(name, Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[per_request_s] * 2,
                                                     [256 * per_request_s] * 2]),
                   load_s=0.5, engine_init_s=0.05)


async def test_a_tpot_spike_replicates_layers_onto_an_idle_node_and_they_go_when_it_passes(
        own_servers, model_dir):
    """Two requests stream on A. The node turns out slow (its profile is replaced, as a
    calibration would): their decode step breaks their TPOT SLO, and B runs nothing, so the
    placer replicates layers there (B holds their bytes, A's engine spreads new requests over
    both). The profile comes back: the step meets the SLO by far, the replica is dropped and
    released. The requests stream on, with an unmoved instance's greedy output."""
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    record = dataclasses.replace(model_record_from_dir("alpha", model_dir), max_context=CONTEXT)
    await ModelRegistry(redis).register(record)
    await save_profile(redis, _linear("alpha", 0.01))
    workers = {n: NodeWorker(_settings(n, 1 << 30, nats_url, redis_url), nc, redis)
               for n in ("rep-a", "rep-b")}
    placer = Placer(PlacerSettings(nats_url, redis_url, CORE, module_scaling_s=0.1,
                                   modules=ModuleSettings(replicate=True)), nc, redis)
    reference = await asyncio.to_thread(greedy_output, model_dir, PROMPT, LONG)
    stop = asyncio.Event()
    runner = None
    finals: dict[str, TokenMessage] = {}
    counts: dict[str, int] = {}

    async def submit(rid: str) -> None:
        counts[rid] = 0

        async def on_token(msg, rid=rid) -> None:
            m = wire.decode(TokenMessage, msg.data)
            counts[rid] += len(m.token_ids)
            if m.finished:
                finals[rid] = m

        await nc.subscribe(token_subject(rid), cb=on_token)
        req = InferenceRequest(rid, "t", "alpha", PROMPT, LONG, time.time(), 60.0, 1.0,
                               temperature=0.0)
        await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req),
                                     headers={"Nats-Msg-Id": rid})

    try:
        for w in workers.values():
            await w.start()
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        for rid in ("r1", "r2"):  # one after the other: the second joins the first's instance
            await submit(rid)
            await until(lambda rid=rid: counts[rid] >= 5, timeout_s=120, what=f"{rid} streaming")
            # The placer sees it running before the next comes (a view that lags on a busy box
            # would place the second on a new instance of its own).
            await until(lambda rid=rid: _in_view(redis, rid), what=f"{rid} in the cluster view")
        [owner] = [n for n, w in workers.items() if w.engines]
        [host] = [n for n in workers if n != owner]
        a = workers[owner]
        [iid] = list(a.engines)
        # 0.6 s a request-step: 1.32 s for the two (overestimate included) against 1 s.
        await save_profile(redis, _linear("alpha", 0.6))

        def replicated() -> bool:
            return any(r.ok and r.plan.action is ModuleAction.REPLICATE
                       for r in placer.modules.records)

        await until(replicated, timeout_s=60, what="a replica")
        [rec] = [r for r in placer.modules.records if r.plan.action is ModuleAction.REPLICATE]
        assert (rec.plan.owner_node, rec.plan.host_node) == (owner, host)
        assert a.engines[iid].layout().replicas == ((rec.plan.start, rec.plan.end, rec.address),)
        key = stage_key(iid, rec.plan.start, rec.plan.end)
        assert workers[host].sched.ledger.target(key) > 0 and rec.plan.host_bytes > 0
        assert a.sched.node.instance(iid).layout.runs[0].replica
        await save_profile(redis, _linear("alpha", 0.01))  # the spike passes

        def dropped() -> bool:
            return any(r.ok and r.plan.action is ModuleAction.DROP_REPLICA
                       for r in placer.modules.records)

        await until(dropped, timeout_s=60, what="the replica dropped")
        assert a.engines[iid].layout().replicas == ()
        assert a.sched.node.instance(iid).layout is None
        await until(lambda: workers[host].sched.ledger.budget == 0, timeout_s=30,
                    what="the host's hold released")
        await until(lambda: all(r in finals for r in ("r1", "r2")), timeout_s=300,
                    what="both requests")
        for rid in ("r1", "r2"):
            assert finals[rid].error is None and finals[rid].output_token_ids == reference
    finally:
        await shut_down(stop, runner, workers.values(), nc, redis, placer)

"""The placer on real NATS and Redis against stand-in nodes: refusals and their back-off, the
refusal limit, an unregistered model, a displaced request offered to its target first,
preempt-and-route as one command, cancels (also sent while no placer ran) and deadlines, an
undecodable message, a node that does not answer, redelivery after a placer dies, and Redis and
NATS failing under its run loop.

Assertions are on recorded events (commands a stand-in node got, final messages, the durable
consumer's state); waits poll with generous deadlines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import nats
import pytest
from redis.asyncio import Redis

from services.placer.placer import MAX_REFUSALS, Placer
from shared import wire
from shared.cluster import model_spec, remove_node, save_profile
from shared.core.node_scheduler import new_node
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware
from shared.outcomes import read_outcome
from shared.registry import ModelRegistry
from shared.schemas import (CommandKind, FinishReason, InferenceRequest, ModelRecord, NodeCommand,
                            NodeReply, RequestState, TokenMessage)
from shared.subjects import ALIASES_HASH, REQUEST_SUBJECT, token_subject
from shared.tasks import cancel_and_wait
from tests.placer.conftest import (GB, MODEL, FakeNode, Finals, cancel, consumer_idle, empty_gpu,
                                   flat_profile, gpu_profile, publish, request, running_placer,
                                   settings, until)

pytestmark = pytest.mark.integration


async def _idle(nc) -> None:
    deadline = time.monotonic() + 30
    while not await consumer_idle(nc):
        assert time.monotonic() < deadline, "the request stream still holds unacked requests"
        await asyncio.sleep(0.05)


async def test_refusals_back_off_then_fail_the_request_at_the_limit(servers, conns):
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0"), answer=lambda c: NodeReply(False, "headroom")).start()
    finals = Finals(nc)
    req = request("refused")
    await finals.watch(req.request_id)
    async with running_placer(servers):
        await publish(nc, req)
        final = await finals.wait(req.request_id)
        await _idle(nc)  # failed means answered: acked, never redelivered
    assert final.finish_reason is FinishReason.ERROR
    assert f"refused {MAX_REFUSALS} times" in final.error and "g0: headroom" in final.error
    times = [t for t, c in node.commands if c.request.request_id == req.request_id]
    assert len(times) == MAX_REFUSALS
    # After the k-th refusal the next try waits min(1 s, 0.02 * 2^k) at least: a lower bound
    # the placer's clock enforces, whatever this box's speed.
    for k, (a, b) in enumerate(zip(times, times[1:]), start=1):
        assert b - a >= min(1.0, 0.02 * 2**k) * 0.99, (k, b - a)
    await node.stop()


@pytest.mark.parametrize("refusal", ["error: boom", "bad_command: 'x' is not a LoRA adapter of 'm'",
                                     "headroom"])
async def test_a_node_fault_is_never_answered_as_overload(servers, conns, refusal):
    """A node that keeps refusing for its own fault (its handler raised) makes the retries run
    past a tight TTFT: the request fails with that refusal, as it would at the refusal limit,
    not as a 503 "overloaded ... ttft_miss". A refusal for load still ends as a drop."""
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0"),
                          answer=lambda c: NodeReply(False, refusal)).start()
    finals = Finals(nc)
    req = request(f"fault-{len(refusal)}", ttft=0.5)
    await finals.watch(req.request_id)
    async with running_placer(servers):
        await publish(nc, req)
        final = await finals.wait(req.request_id)
    tries = len(node.commanded(req.request_id))
    if refusal == "headroom":
        assert final.finish_reason is FinishReason.DROPPED and "ttft_miss" in final.error
    else:
        assert final.finish_reason is FinishReason.ERROR
        assert final.error == f"refused {tries} times (last: g0: {refusal})"
    await node.stop()


async def test_unregistered_model_fails_with_a_clear_error(servers, conns):
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    finals = Finals(nc)
    req = request("nobody", model="not-there")
    await finals.watch(req.request_id)
    async with running_placer(servers):
        await publish(nc, req)
        final = await finals.wait(req.request_id)
        await _idle(nc)
    assert final.finish_reason is FinishReason.ERROR and "'not-there' is not registered" in final.error
    assert node.commands == []
    # The answer is kept too, for a gateway that missed the message (shared/outcomes.py).
    assert await read_outcome(redis, req.request_id, req.attempt) == final
    await node.stop()


async def test_a_displaced_request_goes_to_its_validated_target_first(servers, conns):
    nc, redis = conns
    target = await FakeNode(nc, redis, empty_gpu("target")).start()
    other = await FakeNode(nc, redis, empty_gpu("other")).start()
    req = request("moved", target_node="target", target_instance="m@target#3",
                  resumed_token_ids=[7, 8])
    async with running_placer(servers):
        await publish(nc, req)
        await until(lambda: target.commanded("moved"), what="the offer to the target")
        await _idle(nc)
    (cmd,) = target.commanded("moved")
    assert cmd.kind is CommandKind.ADMIT and cmd.instance_id == "m@target#3"
    assert cmd.request.resumed_token_ids == [7, 8] and cmd.request.target_node is None
    assert other.commands == []
    await target.stop()
    await other.stop()


async def test_a_refused_displaced_request_is_placed_afresh(servers, conns):
    nc, redis = conns
    # The target refuses (it changed since the plan); it is not in the cluster view any more.
    target = FakeNode(nc, redis, empty_gpu("target"), answer=lambda c: NodeReply(False, "instance_gone"))
    await nc.subscribe("slinfer.node.target.cmd", cb=target._on_command)
    other = await FakeNode(nc, redis, empty_gpu("other")).start()
    async with running_placer(servers):
        await publish(nc, request("moved", target_node="target", target_instance="m@target#3"))
        await until(lambda: other.commanded("moved"), what="placing it afresh")
        await _idle(nc)
    assert [c.instance_id for c in target.commanded("moved")] == ["m@target#3"]
    (fresh,) = other.commanded("moved")
    assert fresh.kind is CommandKind.ADMIT and fresh.model.name == "m"  # a new instance there
    await other.stop()


async def test_preempt_and_route_is_one_command_with_the_victims_and_their_destinations(servers, conns):
    """A GPU holds `big` (two requests) and a smaller neighbour `small` (one request); the
    newcomer needs more KV for `big` than is free. The plan preempts the neighbour and moves its
    request to `small` on another GPU: one PREEMPT_ADMIT command carries all of it."""
    nc, redis = conns
    registry = ModelRegistry(redis)
    big = ModelRecord("big", "/models/big", weight_bytes=30 * GB, kv_bytes_per_token=10 * 1024**2,
                      max_context=1024)
    small = ModelRecord("small", "/models/small", weight_bytes=35 * GB, kv_bytes_per_token=1024,
                        max_context=1024)
    perf = PerfModel()
    for record in (big, small):
        await registry.register(record)
        await save_profile(redis, gpu_profile(record.name))
        perf.add(gpu_profile(record.name))
    now = time.time()
    g0 = new_node("g0", Hardware.GPU, 80 * GB, perf)
    g1 = new_node("g1", Hardware.GPU, 80 * GB, perf)

    def loaded(sched, iid, rid, record, input_len, max_tokens=100):
        from shared.core.types import SLO, RequestView
        res = sched.admit(RequestView(rid, record.name, input_len, now, SLO(5.0, 0.5),
                                      max_tokens=max_tokens), iid, model_spec(record), now)
        assert res.admission.ok, res.admission
        ops = list(res.start_ops)
        while ops:
            ops.extend(sched.memop_done(ops.pop(0), now))
        return res.instance_id

    ib = loaded(g0, None, "a", big, 400)
    loaded(g0, ib, "b", big, 400)
    victim_instance = loaded(g0, None, "s", small, 16)
    home = loaded(g1, None, "t", small, 16)

    def preempting(cmd):
        evicted = [dataclasses.replace(request("s", model="small"), target_node="g1",
                                       target_instance=home, resumed_token_ids=[1, 2, 3])]
        return NodeReply(True, "admitted", cmd.instance_id, evicted=evicted)

    node0 = await FakeNode(nc, redis, g0.view(), answer=preempting).start()
    node1 = await FakeNode(nc, redis, g1.view()).start()
    newcomer = InferenceRequest("c", "t", "big", [5] * 900, 100, time.time(), 5.0, 0.5)
    async with running_placer(servers) as placer:
        await publish(nc, newcomer)
        await until(lambda: node0.commanded("c"), what="the preempt-and-admit command")
        await _idle(nc)
    (cmd,) = node0.commanded("c")
    assert cmd.kind is CommandKind.PREEMPT_ADMIT and cmd.instance_id == ib
    assert cmd.preempt_instance_ids == [victim_instance]
    assert [(m.request_id, m.node_id, m.instance_id) for m in cmd.migrations] == [("s", "g1", home)]
    assert placer.decisions.get("preempt_and_route") == 1
    assert node1.commands == []  # the displaced request is the node's to requeue, not the placer's
    await node0.stop()
    await node1.stop()


async def test_cancel_while_queued_acks_it_and_it_is_never_placed(servers, conns):
    nc, redis = conns
    async with running_placer(servers) as placer:
        await publish(nc, request("queued"))  # no node yet: it queues
        await until(lambda: "queued" in placer.queue, what="the request to queue")
        await cancel(nc, "queued")
        await until(lambda: "queued" not in placer.queue, what="the cancel")
        node = await FakeNode(nc, redis, empty_gpu("g0")).start()
        await publish(nc, request("later"))
        await until(lambda: node.commanded("later"), what="a later request to be placed")
        await _idle(nc)
    assert node.commanded("queued") == []
    await node.stop()


async def test_a_cancel_sent_while_no_placer_ran_is_replayed_at_start(servers, conns):
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    await publish(nc, request("abandoned"))
    await cancel(nc, "abandoned")  # nobody listening: only the cancel stream keeps it
    await publish(nc, request("expired", deadline=time.time() - 1))  # its gateway gave up already
    await publish(nc, request("wanted"))
    async with running_placer(servers) as placer:
        await until(lambda: node.commanded("wanted"), what="the wanted request to be placed")
        await _idle(nc)
    assert node.commanded("abandoned") == [] and node.commanded("expired") == []
    assert placer.decisions.get("given_up") == 2
    await node.stop()


async def test_a_cancel_of_older_attempts_spares_the_resumed_one(servers, conns):
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    await publish(nc, request("r", attempt=1, resumed_token_ids=[4]), msg_id="r:attempt:1")
    await cancel(nc, "r", below_attempt=1)
    async with running_placer(servers):
        await until(lambda: node.commanded("r"), what="the resumed attempt to be placed")
    assert node.commanded("r")[0].request.attempt == 1
    await node.stop()


async def test_undecodable_message_is_terminated_and_the_placer_goes_on(servers, conns):
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    async with running_placer(servers) as placer:
        await nc.jetstream().publish(REQUEST_SUBJECT, b"\xc1 not msgpack", headers={"Nats-Msg-Id": "junk"})
        await publish(nc, request("fine"))
        await until(lambda: node.commanded("fine"), what="the next request")
        await _idle(nc)  # the junk was terminated, not left to be redelivered forever
        assert placer.errors == 0
    await node.stop()


@pytest.mark.parametrize("silent", [True, False], ids=["silent", "gone"])
async def test_a_node_that_does_not_answer_counts_as_a_refusal(servers, conns, silent):
    nc, redis = conns
    if silent:  # subscribed, never answers
        node = await FakeNode(nc, redis, empty_gpu("g0"), answer=lambda c: None).start()
    else:  # in the view, no process behind it (no responders)
        node = FakeNode(nc, redis, empty_gpu("g0"))
        await node.publish()
    finals = Finals(nc)
    await finals.watch("unanswered")
    async with running_placer(servers, admit_timeout_s=0.2):
        await publish(nc, request("unanswered", ttft=60.0))
        final = await finals.wait("unanswered")
    assert final.finish_reason is FinishReason.ERROR and "g0: no reply" in final.error
    if silent:  # admitted once, then asked whether it holds it (never sent elsewhere)
        asked = [c.kind for _, c in node.commands
                 if "unanswered" in (c.request_id, c.request and c.request.request_id)]
        assert asked == [CommandKind.ADMIT] + [CommandKind.STATUS] * (MAX_REFUSALS - 1)
        await node.stop()


async def test_a_request_held_by_a_placer_that_died_is_redelivered_to_the_next(servers, conns):
    nc, redis = conns
    # Placer A takes the request (no node yet: it queues) and dies without acking it.
    nc_a = await nats.connect(servers["nats"].url)
    redis_a = Redis.from_url(servers["redis"].url)
    a = Placer(settings(servers, ack_wait_s=1.0), nc_a, redis_a)
    await a.start()
    stop_a = asyncio.Event()
    run_a = asyncio.create_task(a.run(stop_a))
    await publish(nc, request("held", ttft=1.0))
    await until(lambda: "held" in a.queue, what="placer A to hold the request")
    await cancel_and_wait(run_a)  # (once may not do: shared.tasks)
    await nc_a.close()  # like SIGKILL: its claim on the message lapses after ack_wait
    await redis_a.aclose()
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    async with running_placer(servers, ack_wait_s=1.0):
        await until(lambda: node.commanded("held"), what="the redelivery to placer B")
        await _idle(nc)
    (cmd,) = node.commanded("held")
    # It waited for a live placer longer than its TTFT SLO: that wait became its grace, so it
    # was placed, not dropped as late.
    assert cmd.request.grace_s >= 1.0
    await node.stop()


async def test_redis_down_under_the_run_loop_is_retried_and_the_queue_kept(servers, conns):
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    async with running_placer(servers) as placer:
        await publish(nc, request("first"))
        await until(lambda: node.commanded("first"), what="the first request")
        servers["redis"].stop()
        await publish(nc, request("during", ttft=60.0))
        await until(lambda: placer.errors > 0, what="a failing turn")
        await until(lambda: "during" in placer.queue, what="the request to be kept")
        assert not placer.task.done()  # type: ignore[attr-defined]
        servers["redis"] = servers["redis"].again()  # with its data (append-only file)
        await until(lambda: node.commanded("during"), what="placing once Redis is back")
        await _idle(nc)
    await node.stop()


async def test_nats_restart_under_the_run_loop_the_placer_reconnects(servers, conns):
    nc, redis = conns
    async with running_placer(servers) as placer:
        await publish(nc, request("before", ttft=60.0))  # no node: it waits in the queue
        await until(lambda: "before" in placer.queue, what="the request to queue")
        servers["nats"] = servers["nats"].again()  # the stream and the consumer are on disk
        await until(lambda: nc.is_connected, what="the test's connection to come back")
        node = await FakeNode(nc, redis, empty_gpu("g0")).start()
        await until(lambda: node.commanded("before"), what="the queued request after the restart")
        await publish(nc, request("after", ttft=60.0))
        await until(lambda: node.commanded("after"), what="a request published after the restart")
        await _idle(nc)
        assert not placer.task.done()  # type: ignore[attr-defined]
    await node.stop()


async def test_a_request_that_arrived_while_nats_was_down_gets_the_outage_as_grace(servers, conns):
    """A request that reached the gateway while nats-server was down is published once it is
    back (nats-py flushes what it buffered, or the gateway's retry gets through). The seconds
    it waited for the bus are not load: placed after the restart, it is judged from the
    placer's reconnection on, not dropped as having missed its TTFT (the fault suite's NATS
    restart: streamed requests ended with an in-stream "overloaded ... ttft_miss")."""
    nc, redis = conns
    async with running_placer(servers) as placer:
        node = await FakeNode(nc, redis, empty_gpu("g0")).start()
        await publish(nc, request("warm-up", ttft=60.0))
        await until(lambda: node.commanded("warm-up"), what="the first request")
        servers["nats"].stop()
        late = request("during-outage", ttft=1.0)  # it reached the gateway now
        await asyncio.sleep(1.5)  # longer than its TTFT SLO
        servers["nats"] = servers["nats"].again()
        await until(lambda: nc.is_connected and placer.port.nc.is_connected,
                    what="both connections to come back")
        await node.publish()
        await publish(nc, late)
        await until(lambda: node.commanded("during-outage") or placer.port.decisions.get(
            "drop"), what="a decision on the request")
        assert node.commanded("during-outage"), placer.port.decisions
        (cmd,) = node.commanded("during-outage")
        assert cmd.request.grace_s >= 1.5
        await _idle(nc)
    await node.stop()


async def test_an_emptied_redis_gets_its_registry_and_profiles_back(servers, conns):
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    async with running_placer(servers) as placer:
        await publish(nc, request("first"))
        await until(lambda: node.commanded("first"), what="the first request")
        await ModelRegistry(redis).add_alias("m-latest", MODEL)
        await until(lambda: placer.keeper.copy.get(ALIASES_HASH), what="the keeper's copy")
        await redis.flushall()  # what a restart without the append-only file leaves
        await until(lambda: placer.keeper.restored >= 3, what="the write-back")
        assert [r.name for r in await ModelRegistry(redis).list()] == ["m"]
        assert list((await ModelRegistry(redis).aliases()).values()) == ["m"]
        assert await redis.hlen("slinfer:profiles") == 1
        assert await ModelRegistry(redis).intact()
        await publish(nc, request("second"))
        await until(lambda: node.commanded("second"), what="placing with the restored state")
        # A deletion through the admin API is not undone (it does not touch the epoch).
        await ModelRegistry(redis).delete("m")
        checks = placer.keeper.checks
        await until(lambda: placer.keeper.checks >= checks + 2, what="two more keeper checks")
        assert await ModelRegistry(redis).list() == []
    await node.stop()


async def test_time_lost_to_a_node_that_died_under_a_request_is_its_grace(servers, conns):
    """The placer sent the request to a node that died (it never answers); once the node is out
    of the view, the request goes to the other node, judged like a new arrival, instead of being
    dropped as late for the seconds the dead node cost it (the fault suite's node kill: a
    request sent to the victim got 503 after the admit timeout)."""
    nc, redis = conns
    # A model that loads in 0.05 s: the new instance on the live node fits a fresh arrival's
    # TTFT. (A slower load would still miss: a cold start's grace is max(grace, load), not
    # their sum, so a request the fault delayed and that needs a cold start is still dropped.)
    await save_profile(redis, flat_profile(MODEL.name, Hardware.GPU, 0.05, 0.01, load_s=0.05))
    dead = await FakeNode(nc, redis, empty_gpu("dying"), answer=lambda c: None).start()
    finals = Finals(nc)
    req = request("lost-time", ttft=0.5)
    await finals.watch(req.request_id)
    async with running_placer(servers, admit_timeout_s=1.0, node_gone_s=0.5):
        await publish(nc, req)
        await until(lambda: dead.commanded(req.request_id), what="the command to the dying node")
        await dead.stop()
        await remove_node(redis, dead.node_id)  # its snapshot expired
        alive = await FakeNode(nc, redis, empty_gpu("alive")).start()
        await until(lambda: alive.commanded(req.request_id) or req.request_id in finals.got,
                    30.0, "the request to be placed or answered")
        assert alive.commanded(req.request_id), finals.got.get(req.request_id)
        placed = alive.commanded(req.request_id)[0].request
        assert placed.grace_s > 1.0  # the admit timeout it lost, at least
    await alive.stop()


async def test_a_node_whose_admission_answer_was_lost_is_asked_before_the_request_goes_elsewhere(
        servers, conns):
    """The node took the request but its answer never came (a NATS restart between them). The
    placer asks that node (STATUS) before placing the request anywhere else: it runs there, so
    it is placed there, and the other node never gets it. Before, the silence counted as a
    refusal and the request ran on both (the fault suite's NATS restart, under load)."""
    nc, redis = conns
    taken: set[str] = set()

    def silent_once(cmd: NodeCommand) -> NodeReply | None:
        if cmd.kind is CommandKind.STATUS:
            state = RequestState.RUNNING if cmd.request_id in taken else RequestState.UNKNOWN
            return NodeReply(True, state.value, "m@g0#1" if cmd.request_id in taken else None)
        taken.add(cmd.request.request_id)
        return None  # admitted, but the answer is lost

    g0 = await FakeNode(nc, redis, empty_gpu("g0"), answer=silent_once).start()
    g1 = await FakeNode(nc, redis, empty_gpu("g1")).start()
    told: list[TokenMessage] = []

    async def on_token(msg) -> None:
        told.append(wire.decode(TokenMessage, msg.data))

    await nc.subscribe(token_subject("lost-answer"), cb=on_token)
    async with running_placer(servers):
        await publish(nc, request("lost-answer", ttft=30.0))
        await until(lambda: any(c.kind is CommandKind.STATUS for _, c in g0.commands),
                    what="the placer to ask g0")
        await _idle(nc)  # placed (acked), not retried
        # The gateway is told where it runs (the node's own announcement may have been lost).
        await until(lambda: [m.node_id for m in told] == ["g0"], what="the announcement")
    assert [c.kind for c in g0.commanded("lost-answer")] == [CommandKind.ADMIT]  # sent once
    assert any(c.kind is CommandKind.STATUS and c.request_id == "lost-answer"
               for _, c in g0.commands)
    assert not g1.commanded("lost-answer")
    await g0.stop()
    await g1.stop()


async def test_a_node_out_of_the_view_whose_admission_answer_was_lost_is_asked_all_the_same(
        servers, conns):
    """The node took the request, its answer was lost, and its heartbeat is not in the cluster
    view for a while (a Redis failover: the new primary has not had its snapshot yet). It is
    alive and ran the request, so the request is placed there, not on the node that is in the
    view. Before, out of the view meant gone: the request ran on both (a multihost run).
    A node that stays silent is taken for gone only after `node_gone_s`."""
    nc, redis = conns
    taken: set[str] = set()

    def silent_once(cmd: NodeCommand) -> NodeReply | None:
        if cmd.kind is CommandKind.STATUS:
            return NodeReply(True, RequestState.FINISHED.value) if cmd.request_id in taken else None
        taken.add(cmd.request.request_id)
        return None  # admitted (and run), but the answer is lost

    g0 = await FakeNode(nc, redis, empty_gpu("g0"), answer=silent_once).start()
    g1 = await FakeNode(nc, redis, empty_gpu("g1")).start()
    async with running_placer(servers, admit_timeout_s=1.0):
        await publish(nc, request("out-of-view", ttft=30.0))
        await until(lambda: g0.commanded("out-of-view"), what="the admission to g0")
        await g0.leave_view()
        await until(lambda: any(c.kind is CommandKind.STATUS and c.request_id == "out-of-view"
                                for _, c in g0.commands), what="the placer to ask g0")
        await _idle(nc)  # placed (acked), not retried
    assert [c.kind for c in g0.commanded("out-of-view")] == [CommandKind.ADMIT]
    assert not g1.commanded("out-of-view")
    await g0.stop()
    await g1.stop()


async def _acks(nc) -> list[bytes]:
    """Every acknowledgement sent for a request message from now on (+ACK, +WPI, ...)."""
    seen: list[bytes] = []

    async def note(msg) -> None:
        seen.append(msg.data)

    await nc.subscribe("$JS.ACK.>", cb=note)
    await nc.flush()
    return seen


async def test_a_request_placed_at_once_is_acked_once_with_no_progress_message(servers, conns):
    """The delivery starts JetStream's ack-wait clock: a warm request, placed within a fraction
    of it, needs no "in progress" message on its way to a node (one publish fewer per request)."""
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    acks = await _acks(nc)
    async with running_placer(servers):
        await publish(nc, request("quick"))
        await until(lambda: node.commanded("quick"), what="the request placed")
        await _idle(nc)
    await nc.flush()
    assert len(acks) == 1 and acks[0] in (b"", b"+ACK"), acks  # (an empty ack is an +ACK)
    await node.stop()


async def test_a_request_queued_past_ack_wait_stays_claimed(servers, conns):
    """With no node to take it, a request waits in the queue longer than ack_wait: the placer
    tells JetStream it is still working on it, so it is never redelivered meanwhile."""
    nc, redis = conns
    acks = await _acks(nc)
    async with running_placer(servers, ack_wait_s=1.0) as placer:
        await publish(nc, request("waiting", ttft=30.0))
        await until(lambda: "waiting" in placer.queue, what="the request queued")
        await asyncio.sleep(2.5)
        from shared.subjects import PLACER_DURABLE, REQUEST_STREAM
        info = await nc.jetstream().consumer_info(REQUEST_STREAM, PLACER_DURABLE)
        assert info.num_redelivered == 0 and "waiting" in placer.queue
        await cancel(nc, "waiting")
        await _idle(nc)
    assert acks.count(b"+WPI") >= 2, acks

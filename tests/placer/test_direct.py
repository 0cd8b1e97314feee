"""The warm fast path on real NATS and Redis (services/gateway/direct.py): the gateway's backend
sends a request for a warm instance straight to its node, a stand-in node answers as the test
says, and a real placer takes what the node did not admit.

- admitted: the node got one direct ADMIT for its instance; the request stream never saw it;
- refused: the request went through the stream to the placer, which placed it; the model then
  goes to the placers for a while;
- silent: the placer asks that node first, and places it there when the node runs it (it never
  reaches the other node);
- no node listening: through the stream at once;
- a node's note of a direct admission is counted by one placer as an arrival placed there.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from services.gateway.backend import InferenceBackend
from services.gateway.direct import DirectConfig, DirectRoutes, Outcome
from shared import wire
from shared.cluster import model_spec, request_view
from shared.core.node_scheduler import new_node
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, NodeView
from shared.schemas import (CommandKind, DirectAdmission, InferenceRequest, NodeCommand, NodeReply,
                            RequestState)
from shared.subjects import DIRECT_ADMITTED_SUBJECT, REQUEST_STREAM, REQUEST_SUBJECT
from tests.core.factories import loaded
from tests.placer.conftest import (GB, MODEL, FakeNode, accept, consumer_idle, empty_gpu,
                                   gpu_profile, request, running_placer)
from tests.polling import until

pytestmark = pytest.mark.integration


def warm_gpu(node_id: str) -> tuple[NodeView, str]:
    """A GPU node's view with one ready instance of `m` serving one request, and its id."""
    perf = PerfModel()
    perf.add(gpu_profile(MODEL.name))
    sched = new_node(node_id, Hardware.GPU, 80 * GB, perf)
    iid = loaded(sched, None, request_view(request(f"{node_id}-resident", ttft=30.0)),
                 model_spec(MODEL), now=time.time())
    return sched.view(), iid


async def _backend(nc, redis, **config) -> InferenceBackend:
    direct = DirectRoutes(nc, redis, DirectConfig(**{"refresh_s": 0.05, **config}))
    await direct.start()
    return InferenceBackend(nc, nc.jetstream(), redis, direct=direct)


async def _stream_seq(nc) -> int:
    return (await nc.jetstream().stream_info(REQUEST_STREAM)).state.last_seq


async def _last_request(nc) -> InferenceRequest:
    msg = await nc.jetstream().get_last_msg(REQUEST_STREAM, REQUEST_SUBJECT)
    return wire.decode(InferenceRequest, msg.data)


async def test_a_warm_request_is_admitted_directly_and_never_enters_the_stream(servers, conns):
    nc, redis = conns
    view, iid = warm_gpu("g0")
    g0 = await FakeNode(nc, redis, view).start()
    backend = await _backend(nc, redis)
    before = await _stream_seq(nc)
    stream = await backend.submit(request("direct-ok"), timeout_s=30.0)
    try:
        [cmd] = g0.commanded("direct-ok")
        assert cmd.kind is CommandKind.ADMIT and cmd.direct and cmd.instance_id == iid
        assert await _stream_seq(nc) == before
        assert backend.direct.counts[Outcome.ADMITTED] == 1
    finally:
        await stream.close()
        await backend.direct.stop()
        await g0.stop()


async def test_a_refused_request_goes_to_the_placers_and_its_model_is_held(servers, conns):
    nc, redis = conns
    view, iid = warm_gpu("g0")

    def refuse_direct(cmd: NodeCommand) -> NodeReply:
        return NodeReply(False, "no_headroom") if cmd.direct else accept(cmd)

    g0 = await FakeNode(nc, redis, view, answer=refuse_direct).start()
    backend = await _backend(nc, redis, hold_s=60.0)
    async with running_placer(servers) as placer:
        stream = await backend.submit(request("direct-refused"), timeout_s=30.0)
        try:
            await until(lambda: len(g0.commanded("direct-refused")) == 2, what="the placer's ADMIT")
            first, second = g0.commanded("direct-refused")
            assert first.direct and not second.direct and second.kind is CommandKind.ADMIT
            assert (await _last_request(nc)).asked_node is None
            await until(lambda: placer.port.decisions.get("route", 0) == 1, what="placed")
            # The model now goes to the placers: the next request is not sent directly.
            assert backend.direct.pick(request("next"), time.monotonic()) is None
        finally:
            await stream.close()
    await backend.direct.stop()
    await g0.stop()


async def test_a_silent_node_is_asked_first_and_keeps_the_request_it_runs(servers, conns):
    """The node admitted it but its answer was lost: the request reaches the placer with
    `asked_node`, the placer asks that node, finds it running there, and the other node never
    gets it."""
    nc, redis = conns
    view, iid = warm_gpu("g0")
    taken: set[str] = set()

    def silent_on_direct(cmd: NodeCommand) -> NodeReply | None:
        if cmd.kind is CommandKind.STATUS:
            state = RequestState.RUNNING if cmd.request_id in taken else RequestState.UNKNOWN
            return NodeReply(True, state.value, iid if cmd.request_id in taken else None)
        if cmd.direct:
            taken.add(cmd.request.request_id)
            return None
        return accept(cmd)

    g0 = await FakeNode(nc, redis, view, answer=silent_on_direct).start()
    g1 = await FakeNode(nc, redis, empty_gpu("g1")).start()
    backend = await _backend(nc, redis, timeout_s=0.3)
    async with running_placer(servers):
        stream = await backend.submit(request("direct-silent", ttft=30.0), timeout_s=30.0)
        try:
            assert backend.direct.counts[Outcome.SILENT] == 1
            assert (await _last_request(nc)).asked_node == "g0"
            await until(lambda: any(c.kind is CommandKind.STATUS and c.request_id == "direct-silent"
                                    for _, c in g0.commands), what="the placer to ask g0")
            await until(lambda: consumer_idle(nc), what="the request acked")
        finally:
            await stream.close()
    assert [c.kind for c in g0.commanded("direct-silent")] == [CommandKind.ADMIT]
    assert not g1.commanded("direct-silent")
    await backend.direct.stop()
    await g0.stop()
    await g1.stop()


async def test_with_no_node_listening_the_request_goes_through_the_stream(servers, conns):
    nc, redis = conns
    view, _ = warm_gpu("ghost")
    ghost = FakeNode(nc, redis, view)
    await ghost.publish()  # in the view, but nothing answers on its subject
    backend = await _backend(nc, redis)
    before = await _stream_seq(nc)
    stream = await backend.submit(request("direct-ghost"), timeout_s=30.0)
    try:
        assert backend.direct.counts[Outcome.REFUSED] == 1
        assert await _stream_seq(nc) == before + 1
        assert (await _last_request(nc)).asked_node is None
    finally:
        await stream.close()
        await backend.direct.stop()


async def test_a_direct_admission_note_is_one_placed_arrival_at_one_placer(servers, conns):
    nc, redis = conns
    note = DirectAdmission(replace(request("noted"), prompt_token_ids=[]), "g0", "m@g0#1")
    async with running_placer(servers) as first, running_placer(servers) as second:
        await nc.publish(DIRECT_ADMITTED_SUBJECT, wire.encode(note))
        await until(lambda: first.port.decisions.get("route_direct", 0)
                    + second.port.decisions.get("route_direct", 0) == 1, what="the note")
        await nc.flush()
        await asyncio.sleep(0.2)  # a second delivery would have come by now
        assert first.port.decisions.get("route_direct", 0) \
            + second.port.decisions.get("route_direct", 0) == 1


"""The warm fast path's bookkeeping at the gateway (services/gateway/direct.py), without
servers: which requests go directly, and what a refusal, a silence or a missing node does to
the next choice. A stand-in NATS client answers as the test says; the real path is in
tests/placer/test_direct.py and tests/ops/test_stack_telemetry.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import nats.errors

from services.gateway.direct import DirectConfig, DirectRoutes, Outcome
from shared.cluster import encode_reply
from shared.core.node_scheduler import new_node
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, InstanceView, ModelSpec
from shared.schemas import InferenceRequest, NodeCommand, NodeReply
from shared import wire

GB = 1 << 30


def _view(node_id: str, *models: str):
    view = new_node(node_id, Hardware.GPU, 80 * GB, PerfModel()).view()
    instances = [InstanceView(f"{m}@{node_id}#1", ModelSpec(m, GB, 1024, 1024), node_id)
                 for m in models]
    return replace(view, instances=instances)


def _req(rid: str, model: str = "m", **kw) -> InferenceRequest:
    return InferenceRequest(rid, "t", model, [1, 2, 3], 4, time.time(), 1.0, 0.25, **kw)


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data


class _Bus:
    """Answers a node command as `answer` says: a NodeReply, or an exception to raise."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.sent: list[tuple[str, NodeCommand]] = []

    async def request(self, subject: str, data: bytes, timeout: float, headers=None) -> _Msg:
        self.sent.append((subject, wire.decode(NodeCommand, data)))
        result = self.answer
        if isinstance(result, BaseException):
            raise result
        return _Msg(encode_reply(result))


def _routes(answer, *views, hold_s: float = 60.0) -> tuple[DirectRoutes, _Bus]:
    bus = _Bus(answer)
    routes = DirectRoutes(bus, None, DirectConfig(hold_s=hold_s))  # type: ignore[arg-type]
    for view in views:
        routes.see(view)
    return routes, bus


def _admit(routes: DirectRoutes, req: InferenceRequest) -> Outcome:
    route = routes.pick(req, time.monotonic())
    assert route is not None
    return asyncio.run(routes.admit(req, route, None))


def test_only_a_first_attempt_of_a_model_with_an_instance_goes_directly():
    routes, _ = _routes(NodeReply(True, "admitted"), _view("g0", "m"))
    now = time.monotonic()
    assert routes.pick(_req("a"), now) is not None
    assert routes.pick(_req("b", model="other"), now) is None
    assert routes.pick(_req("c", attempt=1), now) is None
    assert routes.pick(_req("d", resumed_token_ids=[7]), now) is None
    assert routes.pick(_req("e", target_node="g0"), now) is None
    off = DirectRoutes(None, None, DirectConfig(enabled=False))  # type: ignore[arg-type]
    off.see(_view("g0", "m"))
    assert off.pick(_req("f"), now) is None


def test_an_admission_is_sent_as_a_direct_admit_of_the_instance():
    routes, bus = _routes(NodeReply(True, "admitted", "m@g0#1"), _view("g0", "m"))
    assert _admit(routes, _req("a")) is Outcome.ADMITTED
    [(subject, cmd)] = bus.sent
    assert subject == "slinfer.node.g0.cmd" and cmd.direct and cmd.instance_id == "m@g0#1"
    assert routes.pick(_req("b"), time.monotonic()) is not None  # nothing held


def test_a_refusal_leaves_the_model_to_the_placers_for_a_while():
    routes, _ = _routes(NodeReply(False, "headroom"), _view("g0", "m", "n"))
    assert _admit(routes, _req("a")) is Outcome.REFUSED
    now = time.monotonic()
    assert routes.pick(_req("b"), now) is None
    assert routes.pick(_req("c", model="n"), now) is not None  # the node still takes others
    assert routes.pick(_req("d"), now + 61.0) is not None  # the hold ends


def test_a_silent_node_is_left_out_for_every_model():
    routes, _ = _routes(asyncio.TimeoutError(), _view("g0", "m", "n"), _view("g1", "n"))
    assert _admit(routes, _req("a")) is Outcome.SILENT
    now = time.monotonic()
    assert routes.pick(_req("b"), now) is None
    picked = routes.pick(_req("c", model="n"), now)
    assert picked is not None and picked.node_id == "g1"


def test_a_node_nobody_listens_for_is_dropped_from_the_view():
    routes, _ = _routes(nats.errors.NoRespondersError(), _view("g0", "m"), hold_s=0.0)
    assert _admit(routes, _req("a")) is Outcome.REFUSED
    assert routes.pick(_req("b"), time.monotonic()) is None  # no hold: the node is gone

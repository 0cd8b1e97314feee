"""Command intake's dispatch and its one error wrapper (services/node/intake.py), without
servers: a stand-in runtime records the replies; the handlers are plain functions."""

from __future__ import annotations

import asyncio

from services.node.book import Live, RequestBook
from services.node.intake import CommandIntake
from services.node.observe import NodeObserver
from shared import telemetry as tm
from shared import wire
from shared.core.types import Hardware, NodeView
from shared.schemas import CommandKind, InferenceRequest, NodeCommand, NodeReply, RequestState


class _Outbox:
    def __init__(self) -> None:
        self.replies: list[NodeReply] = []
        self.announced: list[str] = []

    async def respond(self, msg, reply: NodeReply) -> None:
        self.replies.append(reply)

    async def announce(self, req: InferenceRequest) -> None:
        self.announced.append(req.request_id)


class _Runtime:
    """What intake uses of NodeRuntime: the outbox, spans, the view, draining, spawn."""

    def __init__(self) -> None:
        self.outbox = _Outbox()
        self.obs = NodeObserver(tm.local("node-test"), "n1", "cpu")
        self.draining = False
        self.tasks: list[asyncio.Task] = []

    def view(self) -> NodeView:
        return NodeView("n1", Hardware.CPU, 1 << 30)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data, self.headers = data, None


def _req(rid: str = "r") -> InferenceRequest:
    return InferenceRequest(rid, "t", "m", [1, 2], 4, 0.0, 1.0, 0.25)


def _intake(handlers, spawned=None, cleanups=None, book=None):
    rt = _Runtime()
    return rt, CommandIntake(rt, book or RequestBook(), handlers, spawned or {}, cleanups,
                             with_instance=frozenset({CommandKind.HOST_LAYERS}))


async def _send(intake: CommandIntake, cmd: NodeCommand | bytes) -> None:
    await intake.on_command(_Msg(cmd if isinstance(cmd, bytes) else wire.encode(cmd)))


async def test_a_command_goes_to_its_handler_and_an_admission_is_announced():
    async def admit(cmd):
        return NodeReply(True, "admitted", "i1")

    rt, intake = _intake({CommandKind.ADMIT: admit})
    await _send(intake, NodeCommand(CommandKind.ADMIT, request=_req()))
    (reply,) = rt.outbox.replies
    assert reply.accepted and reply.instance_id == "i1" and reply.node.node_id == "n1"
    assert rt.outbox.announced == ["r"]


async def test_one_wrapper_maps_errors_to_refusals_and_runs_the_cleanup():
    cleaned = []

    def broken(cmd):
        raise ValueError("boom")

    rt, intake = _intake({CommandKind.ADMIT: broken},
                         spawned={CommandKind.MIGRATE_BEGIN: broken,
                                  CommandKind.HOST_LAYERS: broken},
                         cleanups={CommandKind.MIGRATE_BEGIN: lambda c: cleaned.append(c.kind)})
    await _send(intake, NodeCommand(CommandKind.ADMIT, request=_req()))
    await _send(intake, NodeCommand(CommandKind.MIGRATE_BEGIN, request=_req()))
    await _send(intake, NodeCommand(CommandKind.HOST_LAYERS, instance_id="i9"))
    await asyncio.gather(*rt.tasks)
    assert [r.reason for r in rt.outbox.replies] == ["error: boom"] * 3
    assert [r.instance_id for r in rt.outbox.replies] == [None, None, "i9"]
    assert cleaned == [CommandKind.MIGRATE_BEGIN]
    assert not rt.outbox.announced


async def test_undecodable_and_unhandled_commands_are_bad_commands():
    rt, intake = _intake({})
    await _send(intake, b"\x00not msgpack")
    await _send(intake, NodeCommand(CommandKind.ADMIT, request=_req()))
    assert all(r.reason.startswith("bad_command") and not r.accepted for r in rt.outbox.replies)
    assert len(rt.outbox.replies) == 2


async def test_a_draining_node_takes_only_migrate_and_drain():
    calls = []

    def record(cmd):
        calls.append(cmd.kind)
        return NodeReply(True, "ok")

    rt, intake = _intake({CommandKind.ADMIT: record, CommandKind.DRAIN: record,
                          CommandKind.MIGRATE: record})
    rt.draining = True
    for kind in (CommandKind.ADMIT, CommandKind.DRAIN, CommandKind.MIGRATE):
        await _send(intake, NodeCommand(kind, request=_req()))
    assert [r.reason for r in rt.outbox.replies] == ["draining", "ok", "ok"]
    assert calls == [CommandKind.DRAIN, CommandKind.MIGRATE]


async def test_status_is_answered_from_the_book_without_the_view():
    book = RequestBook()
    book.live["r"] = Live(_req(), "i1", output=[3])
    rt, intake = _intake({}, book=book)
    await _send(intake, NodeCommand(CommandKind.STATUS, request_id="r"))
    (reply,) = rt.outbox.replies
    assert reply.reason == RequestState.RUNNING.value and reply.node is None

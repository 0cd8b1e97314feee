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
        self.noted: list[tuple[str, str]] = []  # direct admissions told to the placers

    async def respond(self, msg, reply: NodeReply) -> None:
        self.replies.append(reply)

    async def announce(self, req: InferenceRequest) -> None:
        self.announced.append(req.request_id)

    async def admitted_direct(self, req: InferenceRequest, instance_id: str) -> None:
        self.noted.append((req.request_id, instance_id))


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
    """The command, and its answer (sent from a task of its own)."""
    await intake.on_command(_Msg(cmd if isinstance(cmd, bytes) else wire.encode(cmd)))
    await asyncio.gather(*intake.rt.tasks)


async def test_a_command_goes_to_its_handler_and_an_admission_is_announced():
    async def admit(cmd):
        return NodeReply(True, "admitted", "i1")

    rt, intake = _intake({CommandKind.ADMIT: admit})
    await _send(intake, NodeCommand(CommandKind.ADMIT, request=_req()))
    (reply,) = rt.outbox.replies
    assert reply.accepted and reply.instance_id == "i1" and reply.node.node_id == "n1"
    assert rt.outbox.announced == ["r"]


async def test_a_direct_admission_is_told_to_the_placers_not_announced():
    """A gateway that sent the admission itself knows where the request runs; the placers
    learn of it from the node."""
    async def admit(cmd):
        return NodeReply(True, "admitted", "i1")

    rt, intake = _intake({CommandKind.ADMIT: admit})
    await _send(intake, NodeCommand(CommandKind.ADMIT, request=_req(), instance_id="i1",
                                    direct=True))
    assert rt.outbox.replies[0].accepted and rt.outbox.noted == [("r", "i1")]
    assert not rt.outbox.announced


async def test_a_refused_direct_admission_is_told_to_nobody():
    async def refuse(cmd):
        return NodeReply(False, "headroom", "i1")

    rt, intake = _intake({CommandKind.ADMIT: refuse})
    await _send(intake, NodeCommand(CommandKind.ADMIT, request=_req(), instance_id="i1",
                                    direct=True))
    assert not rt.outbox.replies[0].accepted
    assert not rt.outbox.noted and not rt.outbox.announced


async def test_the_answer_goes_out_after_what_the_admission_woke_has_run():
    """The handler's admission wakes the token loop; the answer is sent from a task started
    after it, so the loop's turn (the prefill's start) comes first."""
    order: list[str] = []
    woken = asyncio.Event()

    async def loop_turn() -> None:
        await woken.wait()
        order.append("token loop")

    async def admit(cmd):
        woken.set()
        return NodeReply(True, "admitted", "i1")

    rt, intake = _intake({CommandKind.ADMIT: admit})
    waiter = asyncio.create_task(loop_turn())
    await asyncio.sleep(0)  # the loop waits for work
    respond = rt.outbox.respond

    async def recorded(msg, reply):
        order.append("answer")
        await respond(msg, reply)

    rt.outbox.respond = recorded
    await _send(intake, NodeCommand(CommandKind.ADMIT, request=_req()))
    await waiter
    assert order == ["token loop", "answer"]


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

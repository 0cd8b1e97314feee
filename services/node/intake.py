"""Command intake: the node's NATS handlers decode, look the command's kind up in one dispatch
table, call its handler, and encode the reply (with the node's view). One error wrapper
(`_call`) maps every handler's exception to a refusal: one bad command never takes the node down.

STATUS is answered at once (gateways poll it: no span). Live-migration rounds and CoCoServe's
layer commands are answered from their own tasks (a round may wait for a load and a long prefill,
a layer build reads weights), so the subscription goes on taking the placer's commands meanwhile.
The others run in a span that is the child of the placer's decision; while the node drains, only
MIGRATE and DRAIN are taken.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import replace

from nats.aio.msg import Msg

from services.node.book import RequestBook
from services.node.runtime import NodeRuntime
from shared import wire
from shared.schemas import CancelNotice, CommandKind, NodeCommand, NodeReply

log = logging.getLogger("slinfer.node")
Handler = Callable[[NodeCommand], object]  # a NodeReply, or an awaitable of one
TAKEN_WHILE_DRAINING = frozenset({CommandKind.MIGRATE, CommandKind.DRAIN, CommandKind.UNLOAD_MODEL})


class CommandIntake:
    def __init__(self, rt: NodeRuntime, book: RequestBook, handlers: dict[CommandKind, Handler],
                 spawned: dict[CommandKind, Handler],
                 cleanups: dict[CommandKind, Callable[[NodeCommand], None]] | None = None,
                 with_instance: frozenset[CommandKind] = frozenset()) -> None:
        """`handlers`: kinds answered in a command span; `spawned`: kinds answered from their
        own task; `cleanups`: what a failed handler leaves to undo; `with_instance`: kinds whose
        error reply names the command's instance."""
        self.rt, self.book = rt, book
        self.handlers, self.spawned = handlers, spawned
        self.cleanups = cleanups or {}
        self.with_instance = with_instance

    async def on_command(self, msg: Msg) -> None:
        try:
            cmd: NodeCommand | None = wire.decode(NodeCommand, msg.data)
        except wire.WireError as exc:
            cmd, bad = None, exc
        if cmd is not None and cmd.kind is CommandKind.STATUS:  # gateways poll it: no span
            await self.rt.outbox.respond(msg, self.book.status(cmd.request_id or "", cmd.attempt))
            return
        if cmd is not None and cmd.kind in self.spawned:
            self.rt.spawn(self._answer(msg, cmd), f"{cmd.kind.value}-{_subject(cmd)}")
            return
        obs = self.rt.obs
        with obs.command(msg.headers) as command:  # child of the placer's (or gateway's) span
            if cmd is None:
                kind, reply = "unknown", NodeReply(False, f"bad_command: {bad}")
            else:
                kind, reply = cmd.kind.value, await self._call(cmd, command)
            obs.command_result(command, kind, reply.accepted, reply.reason, reply.instance_id)
        # Sent from a task of its own: an admission woke the token loop, which starts the
        # request's prefill before the answer is encoded and sent (the asker reads it meanwhile).
        self.rt.spawn(self._send(msg, reply, cmd), f"answer-{kind}")

    async def _send(self, msg: Msg, reply: NodeReply, cmd: NodeCommand | None) -> None:
        """The answer to a command (with the node's view), then who needs to know of an
        admission: the gateway, whose watchdog asks this node if the stream goes quiet (a
        gateway that sent it here itself knows), and the placers, of one a gateway sent."""
        await self.rt.outbox.respond(msg, replace(reply, node=self.rt.view()))
        if not (reply.accepted and reply.reason == "admitted" and cmd is not None and cmd.request
                and cmd.kind is not CommandKind.START_INSTANCE):  # its request is a stand-in
            return
        if not cmd.direct:
            await self.rt.outbox.announce(cmd.request)
        elif reply.instance_id:
            await self.rt.outbox.admitted_direct(cmd.request, reply.instance_id)

    async def _answer(self, msg: Msg, cmd: NodeCommand) -> None:
        reply = await self._call(cmd)
        await self.rt.outbox.respond(msg, replace(reply, node=self.rt.view()))

    async def _call(self, cmd: NodeCommand, command=None) -> NodeReply:
        """The one error wrapper: the handler's reply, or the refusal its exception maps to."""
        handler = self.spawned.get(cmd.kind) or self.handlers.get(cmd.kind)
        try:
            if handler is None:
                return NodeReply(False, f"bad_command: {cmd.kind.value} is not a node command")
            if self.rt.draining and cmd.kind in self.handlers \
                    and cmd.kind not in TAKEN_WHILE_DRAINING:
                return NodeReply(False, "draining")
            reply = handler(cmd)
            return await reply if inspect.isawaitable(reply) else reply
        except wire.WireError as exc:
            return NodeReply(False, f"bad_command: {exc}")
        except Exception as exc:
            context = self.rt.obs.use_command(command) if command is not None else \
                self.rt.obs.use(cmd.request_id or (cmd.request.request_id if cmd.request else ""))
            with context:  # the log line carries the trace
                log.exception("%s of %s failed", cmd.kind.value, _subject(cmd))
            if (cleanup := self.cleanups.get(cmd.kind)) is not None:
                cleanup(cmd)
            return NodeReply(False, f"error: {exc}",
                             cmd.instance_id if cmd.kind in self.with_instance else None)

    async def on_cancel(self, msg: Msg) -> None:
        try:
            notice = wire.decode(CancelNotice, msg.data)
        except wire.WireError:
            return
        incoming = self.book.incoming.get(notice.request_id)
        if incoming is not None and (notice.below_attempt is None
                                     or incoming.request.attempt < notice.below_attempt):
            incoming.cancelled = True  # its commit is refused; the source drops it too
        live = self.book.live.get(notice.request_id)
        if live is None:
            return
        if notice.below_attempt is not None and live.request.attempt >= notice.below_attempt:
            return  # only older attempts are cancelled: this one is current
        live.cancelled = True  # the token loop drops it at its next turn
        self.rt.wake.set()


def _subject(cmd: NodeCommand) -> str:
    """What the command is about, for task names and log lines."""
    if cmd.request is not None:
        return cmd.request.request_id
    return cmd.request_id or cmd.instance_id or ""

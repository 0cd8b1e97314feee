"""Every NATS message the node sends, in one place: token messages to the gateways, replies to
commands, commands to other nodes, requests handed back to the request stream, memory-op
completions to the reservation-station stream, and queries to other nodes' multicast endpoints.

Token messages are best effort (core NATS: a lost one is recovered by the gateway from the final
message, or by asking the node). A request handed back must not be lost: a failed publish is
retried in the background until the request's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.node.observe import NodeObserver
from shared import wire
from shared.bus import PUBLISH_RETRY_S, publish_retrying
from shared.cluster import announcement, decode_reply, encode_reply
from shared.schemas import (DirectAdmission, InferenceRequest, MemOpCompletion, NodeCommand,
                            NodeReply, TokenMessage)
from shared.subjects import (DIRECT_ADMITTED_SUBJECT, REQUEST_SUBJECT, memop_subject,
                             node_command_subject, token_subject)

log = logging.getLogger("slinfer.node")

REQUEUE_PAUSE_S = 2.0  # between rounds of retries while NATS is away (not an election)


class Outbox:
    def __init__(self, nc: NATS, node_id: str, obs: NodeObserver) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.node_id = node_id
        self.obs = obs
        self.closed = False  # the node is stopping: background retries give up
        self._retries: set[asyncio.Task] = set()

    # --- to the gateways ----------------------------------------------------------------------
    async def token(self, message: TokenMessage, headers: bool = True) -> None:
        """Best effort (core NATS): a message lost while NATS is down is recovered by the
        gateway from the final message, or by asking this node (STATUS)."""
        try:
            trace = self.obs.message_headers(message.request_id, message.finished) \
                if headers else None
            await self.nc.publish(token_subject(message.request_id), wire.encode(message),
                                  headers=trace)
        except Exception as exc:
            log.warning("token message for %s not sent: %r", message.request_id, exc)

    async def announce(self, req: InferenceRequest) -> None:
        """An empty token message that tells the gateway which node holds the request now (its
        watchdog asks that node if the stream goes quiet). No trace headers: those ride the
        request's token messages as `observe` counts them."""
        await self.token(announcement(req, self.node_id), headers=False)

    # --- to the placers ---------------------------------------------------------------------------
    async def admitted_direct(self, req: InferenceRequest, instance_id: str) -> None:
        """Tell the placers a request of the warm fast path runs here (their arrival histories:
        pre-warming, pre-loading, burst detection), in the request's trace. Best effort: a lost
        note costs one arrival in a rate, never the request."""
        note = DirectAdmission(replace(req, prompt_token_ids=[], resumed_token_ids=[]),
                               self.node_id, instance_id)
        try:
            await self.nc.publish(DIRECT_ADMITTED_SUBJECT, wire.encode(note),
                                  headers=self.obs.headers(req.request_id))
        except Exception as exc:
            log.warning("direct admission of %s not told: %r", req.request_id, exc)

    # --- commands -------------------------------------------------------------------------------
    async def respond(self, msg: Msg, reply: NodeReply) -> None:
        try:
            await msg.respond(encode_reply(reply))  # its view as a snapshot
        except Exception as exc:  # NATS gone: the asker times out and asks again
            log.warning("could not answer a command: %r", exc)

    async def ask(self, node_id: str, cmd: NodeCommand, timeout: float) -> NodeReply | None:
        """A command to another node; None if it did not answer in time."""
        try:
            return await self.command(node_id, cmd, timeout)
        except Exception as exc:
            log.warning("%s to %s: no answer (%r)", cmd.kind.value, node_id, exc)
            return None

    async def command(self, node_id: str, cmd: NodeCommand, timeout: float) -> NodeReply:
        """A command to another node; raises when it does not answer."""
        msg = await self.nc.request(node_command_subject(node_id), wire.encode(cmd),
                                    timeout=timeout)
        return decode_reply(msg.data, time.time())  # its view on our clock

    async def query(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """A request on `subject` (another node's multicast endpoint); its answer's bytes."""
        return (await self.nc.request(subject, payload, timeout=timeout)).data

    # --- streams --------------------------------------------------------------------------------
    async def memop_done(self, done: MemOpCompletion) -> None:
        """Into the reservation-station stream (raises when NATS cannot take it)."""
        await self.js.publish(memop_subject(self.node_id), wire.encode(done))

    async def requeue(self, resumed: InferenceRequest) -> None:
        """Back to the placers through the durable request stream, with its tokens so far. If
        the stream cannot take it now (NATS down), retried in the background until the request's
        deadline: the request left this node and must not be lost."""
        try:
            await self._publish_request(resumed)
        except Exception as exc:
            log.warning("requeue of %s failed (%r); retrying", resumed.request_id, exc)
            task = asyncio.create_task(self._requeue_later(resumed),
                                       name=f"requeue-{resumed.request_id}")
            self._retries.add(task)  # a reference, so the task is not collected mid-way
            task.add_done_callback(self._retries.discard)

    async def hand_back(self, resumed: InferenceRequest, within_s: float) -> None:
        """Back to the placers now, retried through an election for `within_s`; raises when the
        stream did not take it (the node is stopping: no background retry outlives it)."""
        await self._publish_request(resumed, within_s=within_s)

    async def _publish_request(self, resumed: InferenceRequest, within_s: float = 0.0) -> None:
        """One id per requeue, on every try: a try stored with only its ack lost is not stored
        twice. `within_s`: how long to retry through a stream-leader election (0: one try)."""
        msg_id = f"{resumed.request_id}:resume:{resumed.attempt}:{len(resumed.resumed_token_ids)}"
        await publish_retrying(self.js, REQUEST_SUBJECT, wire.encode(resumed),  # in its trace
                               {**resumed.trace_context, "Nats-Msg-Id": msg_id}, within_s=within_s)

    async def _requeue_later(self, resumed: InferenceRequest) -> None:
        while not self.closed:
            left = resumed.deadline - time.time() if resumed.deadline else PUBLISH_RETRY_S
            if left <= 0:
                log.warning("gave up requeueing %s: its deadline passed", resumed.request_id)
                return
            try:
                await self._publish_request(resumed, within_s=min(PUBLISH_RETRY_S, left))
                return
            except Exception as exc:  # NATS down longer than an election: try again
                log.info("requeue of %s still failing (%r)", resumed.request_id, exc)
                await asyncio.sleep(REQUEUE_PAUSE_S)

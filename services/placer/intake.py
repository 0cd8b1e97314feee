"""The placer's intake: the durable request stream and the cancel stream in, the queue of
requests this placer holds, and the answers that take one out of the queue (placed, failed,
given up). See services/placer/placer.py's docstring for what survives which fault.

A request is acked only once it is answered, and every request in the queue is kept claimed
(`keep_claims`), so a placer that dies loses nothing: JetStream redelivers it. A request that
waited in the stream while no live placer held it gets that wait as TTFT grace."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from services.placer.port import PlacerPort
from shared import telemetry as tm
from shared import wire
from shared.outcomes import record_outcome
from shared.bus import STREAM_MAX_AGE_S, ensure_streams
from shared.schemas import CancelNotice, FinishReason, InferenceRequest, TokenMessage
from shared.subjects import (CANCEL_STREAM, CANCEL_SUBJECT, PLACER_DURABLE, REQUEST_SUBJECT,
                             token_subject)

log = logging.getLogger("slinfer.placer")
CANCEL_REPLAY_S = 5.0  # at start, wait at most this long for the cancel stream's replay


@dataclass
class Pending:
    msg: Msg
    request: InferenceRequest
    received: float  # placer clock when first seen
    tries: int = 0  # nodes that refused it so far
    next_try: float = 0.0  # back off after a refusal: the next view may be fresher
    last_refusal: str = ""
    refused_by_fault: bool = False  # the last refusal was a node's error, not its load
    last_progress: float = 0.0  # last in_progress() sent to JetStream
    trace_parent: Context = field(default_factory=Context)  # from the message's headers
    queue_decisions: int = 0  # QUEUE plans so far

    def rank(self) -> tuple[int, int]:
        """Of two messages for one request, the later one: a higher attempt (the gateway resumed
        it), else more tokens (a node handed it back after generating more)."""
        return self.request.attempt, len(self.request.resumed_token_ids)


Arrival = Callable[[InferenceRequest, float], None]  # a new request and when it was seen


class RequestIntake:
    def __init__(self, port: PlacerPort, on_arrival: list[Arrival]) -> None:
        self.port = port
        self.js = port.nc.jetstream()
        self.on_arrival = on_arrival  # told of every new request (not of a redelivered copy)
        self.queue: dict[str, Pending] = {}
        # request id -> cancel every attempt below this (math.inf: all), and when it was seen
        self.cancelled: dict[str, tuple[float, float]] = {}
        self._cancel_seq = 0  # last cancel-stream sequence seen
        self.started_at = time.time()

    async def start(self) -> None:
        await ensure_streams(self.js)
        self.sub = await self.js.pull_subscribe(
            REQUEST_SUBJECT, durable=PLACER_DURABLE,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.port.s.ack_wait_s,
                                  max_ack_pending=10_000))
        # Every cancel of the last hour, then the new ones (an ordered consumer: it re-creates
        # itself after a NATS restart). Placing starts once the replay caught up, so a request
        # cancelled while no placer ran is not placed now.
        last = (await self.js.stream_info(CANCEL_STREAM)).state.last_seq
        await self.js.subscribe(CANCEL_SUBJECT, cb=self._on_cancel, ordered_consumer=True,
                                deliver_policy=DeliverPolicy.ALL, idle_heartbeat=1.0)
        deadline = time.monotonic() + CANCEL_REPLAY_S
        while self._cancel_seq < last and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def held_since_now(self) -> None:
        """From now on this placer holds what it fetches (the grace of earlier waits ends)."""
        self.started_at = time.time()

    async def fetch(self, timeout: float) -> None:
        try:
            msgs = await self.sub.fetch(batch=64, timeout=timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            return
        for msg in msgs:
            try:
                req = wire.decode(InferenceRequest, msg.data)
            except wire.WireError as exc:
                log.warning("dropping undecodable request message: %s", exc)
                await msg.term()
                continue
            await self._enqueue(msg, req)

    async def _enqueue(self, msg: Msg, req: InferenceRequest) -> None:
        unclaimed = _unclaimed_since(msg, req, self.started_at)
        if unclaimed > 0:  # it waited for a live placer (module docstring)
            req = replace(req, grace_s=max(req.grace_s, unclaimed))
        new = Pending(msg, req, time.time(), trace_parent=tm.extract_context(msg.headers,
                                                                          req.trace_context))
        old = self.queue.get(req.request_id)
        if old is None:
            self.queue[req.request_id] = new
            for note in self.on_arrival:
                note(req, new.received)
        elif _stream_seq(old.msg) == _stream_seq(msg):
            old.msg = msg  # redelivered while we still hold it: answer the latest delivery
        elif new.rank() > old.rank():
            self.queue[req.request_id] = new  # a resumed or handed-back copy supersedes it
            await old.msg.ack()
        else:
            await msg.ack()  # an older copy of one we hold

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            self._cancel_seq = max(self._cancel_seq, msg.metadata.sequence.stream)
        except Exception:
            pass
        try:
            notice = wire.decode(CancelNotice, msg.data)
        except wire.WireError:
            return
        below = math.inf if notice.below_attempt is None else notice.below_attempt
        now = time.time()
        earlier = self.cancelled.get(notice.request_id, (0.0, now))[0]
        self.cancelled[notice.request_id] = (max(below, earlier), now)
        pending = self.queue.get(notice.request_id)
        if pending is not None and pending.request.attempt < below:
            del self.queue[notice.request_id]
            await pending.msg.ack()
        if len(self.cancelled) > 1024 and now - next(iter(self.cancelled.values()))[1] > STREAM_MAX_AGE_S:
            self.cancelled = {k: v for k, v in self.cancelled.items()
                              if now - v[1] <= STREAM_MAX_AGE_S}

    def given_up(self, req: InferenceRequest, now: float) -> str | None:
        """Why nobody waits for this request any more, if so."""
        below = self.cancelled.get(req.request_id, (0.0, 0.0))[0]
        if req.attempt < below:
            return "cancelled"
        if req.deadline and now > req.deadline:
            return "deadline passed"
        return None

    def queued_for(self, model: str, besides: str) -> int:
        """Requests of `model` in the queue, the request `besides` left out."""
        return sum(1 for q in self.queue.values()
                   if q.request.model == model and q.request.request_id != besides)

    async def keep_claims(self) -> None:
        """Tell JetStream that every request in the queue is still ours (else it redelivers it
        after ack_wait), whatever is happening to it (queued, backing off after a refusal)."""
        now = time.time()
        for p in list(self.queue.values()):
            if now - p.last_progress > self.port.s.ack_wait_s / 3:
                await p.msg.in_progress()
                p.last_progress = now

    # --- answers: each takes the request out of the queue and acks its message ----------------
    async def forget(self, p: Pending, why: str) -> None:
        """Ack without placing: nobody waits for it (no message: nobody would read it)."""
        self.queue.pop(p.request.request_id, None)
        self.port.count("given_up")
        await p.msg.ack()
        log.info("not placing %s: %s", p.request.request_id, why)

    async def placed(self, p: Pending, node_id: str | None, instance_id: str | None,
                     action: str) -> None:
        self.queue.pop(p.request.request_id, None)
        await p.msg.ack()
        log.info("placed %s on %s/%s (%s)", p.request.request_id, node_id, instance_id, action)

    async def fail(self, p: Pending, reason: FinishReason, error: str) -> None:
        """Answer the request with a final token message that says why (the current span, the
        decision's, is marked failed)."""
        self.queue.pop(p.request.request_id, None)
        span = trace.get_current_span()
        span.set_status(Status(StatusCode.ERROR, error))
        span.set_attribute("slinfer.finish_reason", reason.value)
        final = TokenMessage(
            p.request.request_id, len(p.request.resumed_token_ids), [], finished=True,
            finish_reason=reason, output_token_ids=list(p.request.resumed_token_ids),
            prompt_tokens=len(p.request.prompt_token_ids), error=error,
            attempt=p.request.attempt)
        # Kept first: the core-NATS message is lost if the gateway is reconnecting, and its
        # watchdog then reads the answer back (shared/outcomes.py) instead of waiting.
        try:
            await record_outcome(self.port.redis, final)
        except Exception as exc:  # Redis away: the message below may still arrive
            log.warning("could not keep the answer to %s: %r", p.request.request_id, exc)
        await self.port.nc.publish(token_subject(p.request.request_id), wire.encode(final))
        await p.msg.ack()
        log.info("%s %s: %s", reason.value, p.request.request_id, error)


def _unclaimed_since(msg: Msg, req: InferenceRequest, started_at: float) -> float:
    """Seconds the request waited in the stream with no live placer holding it."""
    try:
        redelivered = msg.metadata.num_delivered > 1
    except Exception:  # not a JetStream message (tests)
        redelivered = False
    held_from = time.time() if redelivered else started_at
    return max(0.0, held_from - req.arrival)


def _stream_seq(msg: Msg) -> int | None:
    try:
        return msg.metadata.sequence.stream
    except Exception:  # not a JetStream message (tests)
        return None

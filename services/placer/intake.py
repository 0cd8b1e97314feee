"""The placer's intake: the durable request stream and the cancel stream in, the queue of
requests this placer holds, and the answers that take one out of the queue (placed, failed,
given up). See services/placer/placer.py's docstring for what survives which fault.

A request is acked only once it is answered, and every request in the queue is kept claimed
(`keep_claims`), so a placer that dies loses nothing: JetStream redelivers it. A request that
waited in the stream while no live placer held it gets that wait as TTFT grace, and so does one
that arrived while this placer was cut off from NATS (a restart of nats-server): the gateway could
publish it only once the bus was back, and the seconds it waited for the bus are not load.

An ack can be lost too (sent while NATS restarts or a stream leader is being elected): JetStream
then redelivers a request that was already answered, and placing it again would run it twice on
two nodes. So an answer is noted in Redis by the message's stream sequence before the ack, the ack
is retried until the server confirms it, and a redelivered message whose answer is noted is acked
without a decision. (A node's own redelivery gate, services/node/book.py, is the second line: it
catches a redelivery that comes back to the same node.) A restarted nats-server may redeliver an
unacked message as a first delivery (its count not persisted yet), so the sequences this placer
answered are also kept in memory, and every delivery shortly after a reconnect is checked."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from nats.aio.msg import Msg
from nats.errors import MsgAlreadyAckdError, NotJSMessageError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from services.placer.port import PlacerPort
from shared import telemetry as tm
from shared import wire
from shared.outcomes import record_outcome
from shared.bus import START_RETRY_S, STREAM_MAX_AGE_S, ensure_streams, retrying
from shared.schemas import (CancelNotice, DirectAdmission, FinishReason, InferenceRequest,
                            TokenMessage)
from shared.subjects import (CANCEL_STREAM, CANCEL_SUBJECT, DIRECT_ADMITTED_SUBJECT,
                             PLACER_DURABLE, PLACER_QUEUE_GROUP, REQUEST_SUBJECT, answered_key,
                             token_subject)

log = logging.getLogger("slinfer.placer")
CANCEL_REPLAY_S = 5.0  # at start, wait at most this long for the cancel stream's replay
ACK_CONFIRM_S = 30.0  # retry an unconfirmed ack this long: past a NATS restart or an election
# A NATS restart can redeliver an unacked message as a first delivery (its count not yet
# persisted): for this long after a reconnect, every delivery is checked against the notes.
SUSPECT_AFTER_RECONNECT_S = 120.0
ANSWERED_KEPT = 65536  # stream sequences this placer answered, remembered locally


@dataclass
class Pending:
    msg: Msg
    request: InferenceRequest
    received: float  # placer clock when first seen
    tries: int = 0  # nodes that refused it so far
    next_try: float = 0.0  # back off after a refusal: the next view may be fresher
    last_refusal: str = ""
    refused_by_fault: bool = False  # the last refusal was a node's error, not its load
    # Last in_progress() sent to JetStream, or the delivery, which starts the ack-wait clock too:
    # a request placed within ack_wait / 3 of its arrival (every warm one) needs none.
    last_progress: float = 0.0
    trace_parent: Context = field(default_factory=Context)  # from the message's headers
    queue_decisions: int = 0  # QUEUE plans so far
    # A node that was sent its admission and did not answer (the reply, or the command, lost in
    # a NATS outage): it may be running it. Asked before the request goes anywhere else.
    unanswered: str | None = None
    silent_since: float = 0.0  # when that node first did not answer a STATUS question either

    def rank(self) -> tuple[int, int]:
        """Of two messages for one request, the later one: a higher attempt (the gateway resumed
        it), else more tokens (a node handed it back after generating more)."""
        return self.request.attempt, len(self.request.resumed_token_ids)


Arrival = Callable[[InferenceRequest, float], None]  # a new request and when it was seen
# A request left the queue: its id, the node it was placed on (None: answered without one:
# dropped, failed, cancelled, given up) and when.
Answer = Callable[[str, str | None, float], None]


class RequestIntake:
    def __init__(self, port: PlacerPort, on_arrival: list[Arrival]) -> None:
        self.port = port
        self.js = port.nc.jetstream()
        self.on_arrival = on_arrival  # told of every new request (not of a redelivered copy)
        self.on_answer: list[Answer] = []  # told of every request that leaves the queue
        self.queue: dict[str, Pending] = {}
        # request id -> cancel every attempt below this (math.inf: all), and when it was seen
        self.cancelled: dict[str, tuple[float, float]] = {}
        self._cancel_seq = 0  # last cancel-stream sequence seen
        self.started_at = time.time()
        self._reconnects = self._reconnect_count()
        self._settling: set[asyncio.Task] = set()  # answers whose ack is not confirmed yet
        self._answered: OrderedDict[int, str] = OrderedDict()  # stream seq -> request id
        self._suspect_until = 0.0  # (monotonic) deliveries before this may be redeliveries

    async def start(self) -> None:
        """The streams, the durable consumer, the cancel replay. Each JetStream call is retried
        while a cluster settles (a placer started with its servers, or during an election)."""
        await ensure_streams(self.js, self.port.s.stream_replicas)
        self.sub = await retrying(lambda: self.js.pull_subscribe(
            REQUEST_SUBJECT, durable=PLACER_DURABLE,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.port.s.ack_wait_s,
                                  max_ack_pending=10_000)), "the request consumer",
            within_s=START_RETRY_S)
        # Every cancel of the last hour, then the new ones (an ordered consumer: it re-creates
        # itself after a NATS restart). Placing starts once the replay caught up, so a request
        # cancelled while no placer ran is not placed now.
        info = await retrying(lambda: self.js.stream_info(CANCEL_STREAM), "the cancel stream",
                              within_s=START_RETRY_S)
        last = info.state.last_seq
        await retrying(lambda: self.js.subscribe(
            CANCEL_SUBJECT, cb=self._on_cancel, ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL, idle_heartbeat=1.0), "the cancel replay",
            within_s=START_RETRY_S)
        deadline = time.monotonic() + CANCEL_REPLAY_S
        while self._cancel_seq < last and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.port.nc.subscribe(DIRECT_ADMITTED_SUBJECT, queue=PLACER_QUEUE_GROUP,
                                     cb=self._on_direct)

    async def _on_direct(self, msg: Msg) -> None:
        """A node admitted a request a gateway sent it directly (the warm fast path): noted as
        an arrival placed on that node, as if this placer had placed it."""
        try:
            note = wire.decode(DirectAdmission, msg.data)
        except wire.WireError as exc:
            log.warning("dropping undecodable direct-admission note: %s", exc)
            return
        now = time.time()
        self.port.count("route_direct")
        req = note.request
        with trace.use_span(trace.get_current_span(tm.extract_context(msg.headers)),
                            end_on_exit=False):  # the log line in the request's trace
            log.info("placed %s on %s/%s (direct, by its gateway)", req.request_id, note.node_id,
                     note.instance_id)
        for arrived in self.on_arrival:
            arrived(req, now)
        for told in self.on_answer:
            told(req.request_id, note.node_id, now)

    def held_since_now(self) -> None:
        """From now on this placer holds what it fetches (the grace of earlier waits ends)."""
        self.started_at = time.time()

    def _reconnect_count(self) -> int:
        return self.port.nc.stats.get("reconnects", 0)

    async def fetch(self, timeout: float) -> None:
        try:
            msgs = await self.sub.fetch(batch=64, timeout=timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            return
        if (reconnects := self._reconnect_count()) != self._reconnects:
            self._reconnects = reconnects  # (checked after the fetch: one can span the outage)
            self.held_since_now()  # back from an outage: what arrived meanwhile waited for it
            self._suspect_until = time.monotonic() + SUSPECT_AFTER_RECONNECT_S
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
        now = time.time()
        # `asked_node`: a gateway's direct admission got no answer there; that node is asked
        # before the request goes anywhere else (`Placer._settled_by_unanswered`).
        new = Pending(msg, req, now, last_progress=now,
                      trace_parent=tm.extract_context(msg.headers, req.trace_context),
                      unanswered=req.asked_node)
        old = self.queue.get(req.request_id)
        if old is None and await self._already_answered(msg, req):
            return
        if old is None:
            self.queue[req.request_id] = new
            for note in self.on_arrival:
                note(req, new.received)
        elif _stream_seq(old.msg) == _stream_seq(msg):
            old.msg = msg  # redelivered while we still hold it: answer the latest delivery
        elif new.rank() > old.rank():
            self.queue[req.request_id] = new  # a resumed or handed-back copy supersedes it
            self._settle(old.msg, req.request_id)
        else:
            self._settle(msg, req.request_id)  # an older copy of one we hold

    async def _already_answered(self, msg: Msg, req: InferenceRequest) -> bool:
        """Whether `msg` is a redelivery of a message some placer answered (its ack was lost);
        if so it is acked here. One this placer answered is known here; another placer's is
        looked up in its note when the message says it was delivered before, or shortly after a
        reconnect: a restarted nats-server redelivered an unacked message as a first delivery,
        and it ran on two nodes (the fault suite's NATS restart)."""
        seq = _stream_seq(msg)
        if seq is None:
            return False
        answered: str | None = self._answered.get(seq)
        if answered is None and (_deliveries(msg) >= 2 or time.monotonic() < self._suspect_until):
            try:
                note = await self.port.redis.get(answered_key(seq))
            except Exception as exc:  # unknown: decide again; the node's gate is the second line
                log.warning("could not read whether %s was answered: %r", req.request_id, exc)
                return False
            answered = note.decode() if note is not None else None
        if answered != req.request_id:
            return False  # never answered (or a note from a stream that was since re-created)
        self.port.count("redelivery_already_answered")
        self._settle(msg, req.request_id, note=False)
        log.info("%s was answered before (a lost ack): acked, not placed again", req.request_id)
        return True

    def _settle(self, msg: Msg, request_id: str, note: bool = True) -> None:
        """Note the answer and ack `msg` until confirmed, in the background (NATS may be away
        for seconds; the run loop goes on)."""
        seq = _stream_seq(msg)
        if seq is not None:  # known here at once: a redelivery may come before the note is
            self._answered[seq] = request_id
            while len(self._answered) > ANSWERED_KEPT:
                self._answered.popitem(last=False)
        task = asyncio.create_task(self._note_and_ack(msg, request_id, note),
                                   name=f"ack-{request_id}")
        self._settling.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._settling.discard)

    async def _note_and_ack(self, msg: Msg, request_id: str, note: bool) -> None:
        seq = _stream_seq(msg)
        if note and seq is not None:
            try:
                await self.port.redis.set(answered_key(seq), request_id, ex=int(STREAM_MAX_AGE_S))
            except Exception as exc:  # Redis away: the ack below may still get through
                log.warning("could not note that %s was answered: %r", request_id, exc)
        await confirm_ack(msg, ACK_CONFIRM_S)

    async def settled(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the acks still being retried: at shutdown."""
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=timeout_s)

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
            self._settle(pending.msg, notice.request_id)
            self._answered_to(notice.request_id, None)
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
        self._settle(p.msg, p.request.request_id)
        self._answered_to(p.request.request_id, None)
        log.info("not placing %s: %s", p.request.request_id, why)

    async def placed(self, p: Pending, node_id: str | None, instance_id: str | None,
                     action: str) -> None:
        self.queue.pop(p.request.request_id, None)
        self._settle(p.msg, p.request.request_id)
        self._answered_to(p.request.request_id, node_id)
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
        self._settle(p.msg, p.request.request_id)
        self._answered_to(p.request.request_id, None)
        log.info("%s %s: %s", reason.value, p.request.request_id, error)

    def _answered_to(self, request_id: str, node_id: str | None) -> None:
        now = time.time()
        for told in self.on_answer:
            told(request_id, node_id, now)


async def confirm_ack(msg: Msg, within_s: float) -> bool:
    """Ack `msg` and wait for the server's confirmation, retrying with back-off for `within_s`
    (a plain ack is lost silently while NATS is away). False if it never got through."""
    deadline = time.monotonic() + within_s
    delay = 0.1
    while True:
        try:
            await msg.ack_sync(timeout=1.0)
            return True
        except MsgAlreadyAckdError:
            return True
        except NotJSMessageError:  # a plain NATS message (tests): nothing to confirm
            return True
        except Exception as exc:
            if time.monotonic() + delay > deadline:
                log.warning("gave up acking a request message after %.0f s: %r", within_s, exc)
                return False
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)


def _deliveries(msg: Msg) -> int:
    try:
        return msg.metadata.num_delivered
    except Exception:  # not a JetStream message (tests)
        return 1


def _unclaimed_since(msg: Msg, req: InferenceRequest, started_at: float) -> float:
    """Seconds the request waited in the stream with no live placer holding it."""
    held_from = time.time() if _deliveries(msg) > 1 else started_at
    return max(0.0, held_from - req.arrival)


def _stream_seq(msg: Msg) -> int | None:
    try:
        return msg.metadata.sequence.stream
    except Exception:  # not a JetStream message (tests)
        return None

"""The gateway's NATS side: publish requests to the JetStream request stream, read the token
stream back in order, publish cancellations (through JetStream too, retried until stored).

Ordering contract with the node (`shared.schemas.TokenMessage`): `seq` is the output index of
`token_ids[0]`; messages may arrive out of order or not at all; the final message
(`finished=True`) carries the complete output in `output_token_ids`, which fills any gap.

A stream that goes quiet is looked after by its watchdog (`watchdog.py`): it asks the node that
serves the request, and resumes the request elsewhere, from the tokens already streamed, when
that node is gone. Each resume is a new `attempt`; only the current attempt's messages are read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from redis.asyncio import Redis

from services.gateway.direct import DirectRoutes, Outcome
from services.gateway.watchdog import Probe, Verdict, Watch, WatchdogConfig
from shared import wire
from shared.bus import PUBLISH_RETRY_S, publish_retrying
from shared.cluster import grace_from_now
from shared.outcomes import read_outcome
from shared.schemas import (CancelNotice, CommandKind, FinishReason, InferenceRequest, NodeCommand,
                            NodeReply, RequestState, TokenLogprob, TokenMessage)
from shared.subjects import (CANCEL_SUBJECT, REQUEST_SUBJECT, node_command_subject, node_key,
                             token_subject)
from shared.telemetry import inject_headers

log = logging.getLogger("slinfer.gateway")

# A stream without a leader (NATS restarting, or a cluster electing one: about 5 s) stores
# nothing, and a core-NATS publish is dropped silently then, so a cancel goes through JetStream
# and is tried again for this long (pauses growing to CANCEL_MAX_PAUSE_S).
CANCEL_RETRY_S, CANCEL_MAX_PAUSE_S = 20.0, 4.0
# A resumed attempt has no client waiting on its publish: it may wait out a whole election.
RESUBMIT_RETRY_S = PUBLISH_RETRY_S


def submit_window(request: InferenceRequest, timeout_s: float, now: float) -> float:
    """How long a new request's publish is retried: through a stream-leader election, but not
    past its TTFT SLO (published later, the placers drop it as overloaded: a 503 now is the
    same answer, sooner, and before a stream's headers went out) nor its timeout."""
    ttft_left = request.arrival + request.ttft_slo_s - now
    return max(0.0, min(timeout_s, PUBLISH_RETRY_S, ttft_left))


class BackendUnavailable(Exception):
    pass


class StreamTimeout(Exception):
    pass


@dataclass(frozen=True)
class Tokens:
    """Output tokens, in order, continuing right after the previous `Tokens`; with each one's
    logprobs where its message carried them (None: it did not, or the request asked none)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    """The request ended; no more events follow."""

    reason: FinishReason
    error: str | None = None
    node_id: str | None = None


TokenEvent = Tokens | Finished


class InferenceBackend:
    """Collaborators: a connected NATS client and its JetStream context; Redis (the cluster view,
    for the watchdog; None: a node that does not answer is never judged dead)."""

    def __init__(self, nc: NATS, js: JetStreamContext, redis: Redis | None = None,
                 watchdog: WatchdogConfig = WatchdogConfig(),
                 direct: DirectRoutes | None = None) -> None:
        self._nc = nc
        self._js = js
        self._redis = redis
        self.watchdog = watchdog
        self.direct = direct  # the warm fast path (direct.py); None: every request to placers
        self._cancels: set[asyncio.Task] = set()  # held: a bare task may be garbage-collected

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    async def submit(self, request: InferenceRequest, timeout_s: float,
                     trace_headers: dict[str, str] | None = None) -> TokenStream:
        """Subscribe to the request's token subject, then publish the request (in that order, so no
        token can be missed). `trace_headers`: the W3C trace context the request carries (its
        gateway span's). Raises BackendUnavailable if the stream does not take it, tried again
        (same message id) through a stream-leader election, within the request's timeout."""
        sub = await TokenInbox.subscribe(self._nc, token_subject(request.request_id))
        if self.direct is not None \
                and (route := self.direct.pick(request, time.monotonic())) is not None:
            headers = trace_headers if trace_headers is not None else inject_headers({})
            outcome = await self.direct.admit(request, route, headers or None)
            if outcome is Outcome.ADMITTED:
                stream = TokenStream(request.request_id, sub,
                                     deadline=time.monotonic() + timeout_s, request=request,
                                     backend=self, trace_headers=trace_headers)
                if stream.watch is not None:  # the node does not announce what it was sent so
                    stream.watch.heard(time.monotonic(), route.node_id)
                return stream
            if outcome is Outcome.SILENT:  # it may run there: the placer asks that node first
                request = replace(request, asked_node=route.node_id)
        try:
            await publish_retrying(self._js, REQUEST_SUBJECT, wire.encode(request),
                                   self.request_headers(request, trace_headers),
                                   within_s=submit_window(request, timeout_s, time.time()))
        except Exception as exc:  # nats raises timeouts, no-responders, API errors
            await _unsubscribe(sub)
            # The stream may have stored it with only the acknowledgement lost (NATS going down):
            # the client is told 503, so the request must not run (the cancel is retried until
            # the cancel stream stores it, and placers replay that stream).
            await self.cancel(request.request_id, "not accepted")
            raise BackendUnavailable(f"request stream did not accept the request: {exc!r}") from exc
        return TokenStream(request.request_id, sub, deadline=time.monotonic() + timeout_s,
                           request=request, backend=self, trace_headers=trace_headers)

    async def resubmit(self, request: InferenceRequest, trace_headers: dict[str, str] | None,
                       within_s: float = RESUBMIT_RETRY_S) -> None:
        """Publish a resumed attempt (its own message id: the stream must not drop it as a
        duplicate of the first), retried through a stream-leader election. Raises what the last
        try raised."""
        headers = {**self.request_headers(request, trace_headers),
                   "Nats-Msg-Id": f"{request.request_id}:attempt:{request.attempt}"}
        await publish_retrying(self._js, REQUEST_SUBJECT, wire.encode(request), headers,
                               within_s=within_s)

    async def probe(self, node_id: str, request_id: str, attempt: int) -> Probe:
        """Ask the node what became of the request; without an answer, look for the node in the
        cluster view."""
        try:
            msg = await self._nc.request(node_command_subject(node_id), wire.encode(NodeCommand(
                CommandKind.STATUS, request_id=request_id, attempt=attempt)),
                timeout=self.watchdog.probe_timeout_s)
            reply = wire.decode(NodeReply, msg.data)
            return Probe(RequestState(reply.reason), final=reply.final)
        except Exception as exc:  # no responders, timeout, NATS down, an odd answer
            log.info("node %s did not answer about %s: %r", node_id, request_id, exc)
        if self._redis is None:
            return Probe(None, None)
        try:
            return Probe(None, in_view=bool(await self._redis.exists(node_key(node_id))))
        except Exception:  # Redis down too: nothing says the node is gone
            return Probe(None, None)

    async def placer_answer(self, request_id: str, attempt: int) -> Probe | None:
        """A placer's kept answer to this attempt (it ended the request while no node had it),
        as a FINISHED probe; None when there is none or Redis cannot say."""
        if self._redis is None:
            return None
        try:
            final = await read_outcome(self._redis, request_id, attempt)
        except Exception as exc:  # Redis down: the next check asks again
            log.info("could not read the placer's answer about %s: %r", request_id, exc)
            return None
        return None if final is None else Probe(RequestState.FINISHED, final=final)

    def request_headers(self, request: InferenceRequest,
                        trace_headers: dict[str, str] | None = None) -> dict[str, str]:
        """NATS headers on the request stream: dedup by request id, and the trace context
        (W3C traceparent/tracestate: `trace_headers`, else the current context's; nothing when
        tracing is off)."""
        if trace_headers is not None:
            return {**trace_headers, "Nats-Msg-Id": request.request_id}
        return inject_headers({"Nats-Msg-Id": request.request_id})

    async def cancel(self, request_id: str, reason: str, below_attempt: int | None = None) -> None:
        """Cancel the request wherever it is (`below_attempt`: only its attempts before that).
        The notice is stored in the cancel stream (placers replay it) and reaches the nodes'
        subscriptions; it is sent in the background, retried until the stream acknowledges it,
        so the caller's cleanup never waits on NATS."""
        notice = wire.encode(CancelNotice(request_id, reason, below_attempt))
        # One id per cancel: a retry whose first try was stored after all is not stored twice.
        msg_id = f"cancel:{request_id}:{below_attempt}"
        task = asyncio.create_task(self._send_cancel(notice, msg_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _send_cancel(self, notice: bytes, msg_id: str) -> None:
        try:
            await publish_retrying(self._js, CANCEL_SUBJECT, notice, {"Nats-Msg-Id": msg_id},
                                   within_s=CANCEL_RETRY_S, max_pause_s=CANCEL_MAX_PAUSE_S)
        except Exception as exc:
            log.warning("cancel %s not stored within %.0fs: %r", msg_id, CANCEL_RETRY_S, exc)

    async def settle_cancels(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the cancels still being sent: at shutdown, before the
        NATS connection is drained."""
        if self._cancels:
            await asyncio.wait(set(self._cancels), timeout=timeout_s)


def resumed_request(req: InferenceRequest, output: list[int], attempt: int,
                    now: float) -> InferenceRequest:
    """`req` put back as `attempt`, from the tokens the client has (`output`). The request lost
    the time since its node died: it is judged like a new arrival for its next token (the core's
    `resume_grace` moves its deadline by that time), or every placer would drop it as late."""
    grace = grace_from_now(req, len(output), now)
    return replace(req, attempt=attempt, resumed_token_ids=list(output), grace_s=grace,
                   target_node=None, target_instance=None, asked_node=None)


class TokenStream:
    """The token messages of one request, reordered: yields `Tokens` in output order, then one
    `Finished`. Raises `StreamTimeout` at the deadline. Always `close()` it.

    With `request` and `backend` given, a watchdog looks after the stream (module docstring)."""

    def __init__(self, request_id: str, sub: TokenInbox, deadline: float,
                 request: InferenceRequest | None = None, backend: InferenceBackend | None = None,
                 trace_headers: dict[str, str] | None = None) -> None:
        self.request_id = request_id
        self._sub = sub
        self._deadline = deadline
        self._next = 0  # output index of the next token to yield
        # output index -> (token id, its logprobs if its message had them), beyond a gap
        self._pending: dict[int, tuple[int, TokenLogprob | None]] = {}
        self.output: list[int] = []  # every token yielded, in order (what a resume starts from)
        self.prompt_tokens = 0  # as counted by the node (0 until it says)
        self.finished: Finished | None = None
        self.node_headers: dict[str, str] | None = None  # trace context of the first token message
        self.prefill_s: float | None = None  # the node's engine prefill time (first token message)
        # The prompt's logprobs (a request that asked): from the first message that has them.
        self.prompt_logprobs: list[TokenLogprob] = []
        self.embedding = b""  # an embedding request's vector (its final message's)
        self._request = request
        self._backend = backend
        self._trace_headers = trace_headers
        self.attempt = request.attempt if request is not None else 0
        self.watch = (Watch(backend.watchdog, time.monotonic())
                      if backend is not None and request is not None else None)
        self.verdicts: list[Verdict] = []  # what the watchdog decided, in order (tests, logs)
        # The final message filled tokens whose messages (and so logprobs) were lost: the rest
        # is asked again from a new attempt instead of answered without them.
        self._logprobs_gap = False

    async def events(self) -> AsyncIterator[TokenEvent]:
        while self.finished is None:
            now = time.monotonic()
            remaining = self._deadline - now
            if remaining <= 0:
                raise StreamTimeout(self.request_id)
            wait = remaining if self.watch is None else min(remaining, self.watch.due_in(now))
            try:
                msg = await self._sub.next(timeout=max(wait, 0.001))
            except TimeoutError:
                if self.watch is None or time.monotonic() >= self._deadline:
                    raise StreamTimeout(self.request_id) from None
                if self.watch.due_in(time.monotonic()) <= 0:
                    for event in await self._check():
                        yield event
                continue
            except nats.errors.ConnectionClosedError:
                raise StreamTimeout(self.request_id) from None
            try:
                token_msg = wire.decode(TokenMessage, msg.data)
            except wire.WireError:
                log.warning("undecodable token message for %s dropped", self.request_id)
                continue
            if token_msg.attempt != self.attempt:
                continue  # an earlier attempt that still ran somewhere: not ours any more
            if self.watch is not None:
                self.watch.heard(time.monotonic(), token_msg.node_id)
            if self.node_headers is None and msg.headers:
                self.node_headers = msg.headers
            if self.prefill_s is None and token_msg.prefill_s is not None:
                self.prefill_s = token_msg.prefill_s
            for event in self._accept(token_msg):
                yield event
            if self._logprobs_gap:
                self._logprobs_gap = False
                why = "lost the logprobs of some tokens"
                for event in await self._resume(token_msg.node_id, why):
                    yield event

    async def _check(self) -> list[TokenEvent]:
        """The watchdog's due check: ask, judge, act (module docstring)."""
        watch = self.watch
        assert watch is not None and self._backend is not None and self._request is not None
        if watch.needs_probe():
            probe = await self._backend.probe(watch.node_id, self.request_id, self.attempt)
        else:
            probe = await self._backend.placer_answer(self.request_id, self.attempt)
        verdict = watch.judge(time.monotonic(), probe)
        self.verdicts.append(verdict)
        if verdict is Verdict.FINISH and probe is not None and probe.final is not None:
            log.info("request %s: its final message was lost; %s had it", self.request_id,
                     f"node {watch.node_id}" if watch.node_id else "the placer")
            events = self._accept(replace(probe.final, attempt=self.attempt))
            if self._logprobs_gap:
                self._logprobs_gap = False
                events += await self._resume(watch.node_id, "lost the logprobs of some tokens")
            return events
        if verdict is Verdict.RESUME:
            return await self._resume(watch.node_id, "lost it")
        if verdict is Verdict.FAIL:
            error = (f"the node serving the request was lost {watch.resumes + 1} times "
                     f"(last: {watch.node_id}); gave up after {watch.resumes} resumes")
            log.warning("request %s: %s", self.request_id, error)
            return self._end(FinishReason.ERROR, error)
        return []

    async def _resume(self, lost_node: str | None, why: str) -> list[TokenEvent]:
        """Put the request back on the request stream as the next attempt, from the tokens the
        client already has; the stream goes on from the next one."""
        req = self._request
        assert req is not None and self._backend is not None and self.watch is not None
        done = self._nothing_left(req)
        if done is not None:
            return self._end(done)
        resumed = resumed_request(req, self.output, self.attempt + 1, time.time())
        try:
            # Retried through an election, but not past the request's own deadline.
            await self._backend.resubmit(resumed, self._trace_headers, within_s=min(
                RESUBMIT_RETRY_S, max(0.0, self._deadline - time.monotonic())))
        except Exception as exc:  # NATS down: the next check tries again
            log.warning("request %s: resume failed (%r); retrying at the next check",
                        self.request_id, exc)
            return []
        log.warning("request %s: node %s %s; resumed as attempt %d from %d tokens",
                    self.request_id, lost_node, why, resumed.attempt, len(self.output))
        self.attempt = resumed.attempt
        self._pending.clear()  # beyond a gap, from the lost attempt: the new one sends them again
        self.watch.resumed(time.monotonic())
        # An older attempt still running somewhere (a node that only looked dead) stops.
        await self._backend.cancel(self.request_id, "resumed elsewhere", below_attempt=self.attempt)
        return []

    def _nothing_left(self, req: InferenceRequest) -> FinishReason | None:
        """The output is complete already (only its final message was lost with the node)."""
        if req.embedding is not None:
            return None  # its one answer is the final message's vector
        if self.output and self.output[-1] in req.eos_token_ids:
            return FinishReason.STOP
        if len(self.output) >= req.max_tokens:
            return FinishReason.LENGTH
        return None

    def _end(self, reason: FinishReason, error: str | None = None) -> list[TokenEvent]:
        self.finished = Finished(reason=reason, error=error,
                                 node_id=self.watch.node_id if self.watch else None)
        return [self.finished]

    def _accept(self, m: TokenMessage) -> list[TokenEvent]:
        if m.prompt_tokens:
            self.prompt_tokens = m.prompt_tokens
        if m.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = m.prompt_logprobs
        if m.embedding:
            self.embedding = m.embedding
        logprobs = m.logprobs if len(m.logprobs) == len(m.token_ids) else []
        for i, token in enumerate(m.token_ids):
            if m.seq + i >= self._next:
                self._pending[m.seq + i] = (token, logprobs[i] if logprobs else None)
        if m.finished:
            for i, token in enumerate(m.output_token_ids):
                if i >= self._next:  # the final word on every position (its logprobs stay)
                    known = self._pending.get(i)
                    self._pending[i] = (token, known[1] if known and known[0] == token else None)
        gap = m.finished and self._may_resume_for_logprobs(m)
        ready = []
        while self._next in self._pending:
            if gap and self._pending[self._next][1] is None:
                break  # from here on, a new attempt sends the tokens with their logprobs
            ready.append(self._pending.pop(self._next))
            self._next += 1
        self.output.extend(token for token, _ in ready)
        events: list[TokenEvent] = ([Tokens([t for t, _ in ready], [lp for _, lp in ready])]
                                    if ready else [])
        if gap and self._pending:
            self._pending.clear()
            self._logprobs_gap = True
            return events
        if m.finished:
            if self._pending:
                log.warning("request %s finished with a gap before output index %d; %d tokens dropped",
                            self.request_id, self._next, len(self._pending))
            reason = m.finish_reason or (FinishReason.ERROR if m.error else FinishReason.STOP)
            self.finished = Finished(reason=reason, error=m.error, node_id=m.node_id)
            events.append(self.finished)
        return events

    def _may_resume_for_logprobs(self, final: TokenMessage) -> bool:
        """A completed request that asked for logprobs, with resumes left, can be asked again
        for the tokens whose logprobs were lost (the client has not seen those tokens yet)."""
        req = self._request
        return (req is not None and req.logprobs is not None and self._backend is not None
                and self.watch is not None and final.error is None
                and final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, None)
                and self.watch.resumes < self._backend.watchdog.max_resumes)

    async def close(self) -> None:
        await _unsubscribe(self._sub)


class TokenInbox:
    """A request's token subject, its messages queued here. (nats-py's `next_msg` starts two
    tasks per message, each a turn of the event loop before the token is read; a callback that
    queues the message costs none.)"""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.sub: Subscription | None = None

    @classmethod
    async def subscribe(cls, nc: NATS, subject: str) -> TokenInbox:
        inbox = cls(nc)
        inbox.sub = await nc.subscribe(subject, cb=inbox._on_msg)
        return inbox

    async def _on_msg(self, msg: Msg) -> None:
        self._queue.put_nowait(msg)

    async def next(self, timeout: float) -> Msg:
        """The next message. Raises TimeoutError after `timeout` seconds without one, and
        nats.errors.ConnectionClosedError when none is left and the connection is closed."""
        try:
            async with asyncio.timeout(timeout):
                if self._queue.empty() and self._nc.is_closed:
                    raise nats.errors.ConnectionClosedError
                return await self._queue.get()
        except TimeoutError:
            if self._nc.is_closed:
                raise nats.errors.ConnectionClosedError from None
            raise

    async def unsubscribe(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()


async def _unsubscribe(sub: TokenInbox) -> None:
    try:
        await sub.unsubscribe()
    except Exception:  # connection closing or already unsubscribed
        pass

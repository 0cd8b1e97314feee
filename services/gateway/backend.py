"""The gateway's NATS side: publish requests to the JetStream request stream, read the token
stream back in order, publish cancellations.

Ordering contract with the node (`shared.schemas.TokenMessage`): `seq` is the output index of
`token_ids[0]`; messages may arrive out of order or not at all; the final message
(`finished=True`) carries the complete output in `output_token_ids`, which fills any gap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from shared import wire
from shared.schemas import CancelNotice, FinishReason, InferenceRequest, TokenMessage
from shared.subjects import CANCEL_SUBJECT, REQUEST_SUBJECT, token_subject
from shared.telemetry import inject_headers

log = logging.getLogger("slinfer.gateway")


class BackendUnavailable(Exception):
    pass


class StreamTimeout(Exception):
    pass


@dataclass(frozen=True)
class Tokens:
    """Output tokens, in order, continuing right after the previous `Tokens`."""

    token_ids: list[int]


@dataclass(frozen=True)
class Finished:
    """The request ended; no more events follow."""

    reason: FinishReason
    error: str | None = None
    node_id: str | None = None


TokenEvent = Tokens | Finished


class InferenceBackend:
    """Collaborators: a connected NATS client and its JetStream context."""

    def __init__(self, nc: NATS, js: JetStreamContext) -> None:
        self._nc = nc
        self._js = js

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    async def submit(self, request: InferenceRequest, timeout_s: float,
                     trace_headers: dict[str, str] | None = None) -> TokenStream:
        """Subscribe to the request's token subject, then publish the request (in that order, so no
        token can be missed). `trace_headers`: the W3C trace context the request carries (its
        gateway span's). Raises BackendUnavailable if the stream does not take it."""
        sub = await self._nc.subscribe(token_subject(request.request_id))
        try:
            await self._js.publish(REQUEST_SUBJECT, wire.encode(request), timeout=min(timeout_s, 10.0),
                                   headers=self.request_headers(request, trace_headers))
        except Exception as exc:  # nats raises timeouts, no-responders, API errors
            await _unsubscribe(sub)
            raise BackendUnavailable(f"request stream did not accept the request: {exc!r}") from exc
        return TokenStream(request.request_id, sub, deadline=time.monotonic() + timeout_s)

    def request_headers(self, request: InferenceRequest,
                        trace_headers: dict[str, str] | None = None) -> dict[str, str]:
        """NATS headers on the request stream: dedup by request id, and the trace context
        (W3C traceparent/tracestate: `trace_headers`, else the current context's; nothing when
        tracing is off)."""
        if trace_headers is not None:
            return {**trace_headers, "Nats-Msg-Id": request.request_id}
        return inject_headers({"Nats-Msg-Id": request.request_id})

    async def cancel(self, request_id: str, reason: str) -> None:
        try:
            await self._nc.publish(CANCEL_SUBJECT, wire.encode(CancelNotice(request_id, reason)))
            await self._nc.flush(timeout=2)
        except Exception:  # a cancel that cannot be sent must not fail the caller's cleanup
            log.warning("could not publish cancel for %s", request_id, exc_info=True)


class TokenStream:
    """The token messages of one request, reordered: yields `Tokens` in output order, then one
    `Finished`. Raises `StreamTimeout` at the deadline. Always `close()` it."""

    def __init__(self, request_id: str, sub: Subscription, deadline: float) -> None:
        self.request_id = request_id
        self._sub = sub
        self._deadline = deadline
        self._next = 0  # output index of the next token to yield
        self._pending: dict[int, int] = {}  # output index -> token id, beyond a gap
        self.prompt_tokens = 0  # as counted by the node (0 until it says)
        self.finished: Finished | None = None
        self.node_headers: dict[str, str] | None = None  # trace context of the first token message
        self.prefill_s: float | None = None  # the node's engine prefill time (first token message)

    async def events(self) -> AsyncIterator[TokenEvent]:
        while self.finished is None:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise StreamTimeout(self.request_id)
            try:
                msg = await self._sub.next_msg(timeout=remaining)
            except nats.errors.TimeoutError:
                raise StreamTimeout(self.request_id) from None
            try:
                token_msg = wire.decode(TokenMessage, msg.data)
            except wire.WireError:
                log.warning("undecodable token message for %s dropped", self.request_id)
                continue
            if self.node_headers is None and msg.headers:
                self.node_headers = msg.headers
            if self.prefill_s is None and token_msg.prefill_s is not None:
                self.prefill_s = token_msg.prefill_s
            for event in self._accept(token_msg):
                yield event

    def _accept(self, m: TokenMessage) -> list[TokenEvent]:
        if m.prompt_tokens:
            self.prompt_tokens = m.prompt_tokens
        for i, token in enumerate(m.token_ids):
            if m.seq + i >= self._next:
                self._pending[m.seq + i] = token
        if m.finished:
            for i, token in enumerate(m.output_token_ids):
                if i >= self._next:
                    self._pending[i] = token  # the final word on every position
        ready = []
        while self._next in self._pending:
            ready.append(self._pending.pop(self._next))
            self._next += 1
        events: list[TokenEvent] = [Tokens(ready)] if ready else []
        if m.finished:
            if self._pending:
                log.warning("request %s finished with a gap before output index %d; %d tokens dropped",
                            self.request_id, self._next, len(self._pending))
            reason = m.finish_reason or (FinishReason.ERROR if m.error else FinishReason.STOP)
            self.finished = Finished(reason=reason, error=m.error, node_id=m.node_id)
            events.append(self.finished)
        return events

    async def close(self) -> None:
        await _unsubscribe(self._sub)


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception:  # connection closing or already unsubscribed
        pass

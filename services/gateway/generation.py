"""One request's output, from token events to text: incremental detokenization, stop sequences
applied at the gateway (which then cancels the request on the node), finish reasons and errors
mapped to the OpenAI API's."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from opentelemetry import trace

from services.gateway import errors
from services.gateway.backend import Finished, InferenceBackend, StreamTimeout, Tokens, TokenStream
from services.gateway.logprobs import TokenEntry
from services.gateway.observe import RequestObserver
from services.gateway.tokenization import IncrementalDetokenizer
from shared.model_state import FAILED, parse_lifecycle_error
from shared.schemas import FinishReason, TokenLogprob

log = logging.getLogger("slinfer.gateway")

OPENAI_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass
class RequestTimings:
    """Monotonic timestamps of one request, for logs now and metrics later."""

    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None


class Generation:
    """Iterate `deltas()` for text; afterwards `finish_reason` and `completion_tokens` are set.
    With `logprobs`, each token's logprobs are collected as it arrives: `take_logprobs()` hands
    out those not handed out yet (a stream's next chunk), `logprobs` holds them all.

    `deltas()` raises `errors.APIError` for a dropped, failed or timed-out request. A request
    dropped or failed before its first token, for a reason that names no lifecycle of its model,
    is first put to `cause` (services/gateway/files_check.py): its answer, when it has one,
    replaces the overload or inference error. Whatever way the iteration ends, `close()` must
    run: it cancels the request on the node unless the node already finished it, and drops the
    subscription.
    """

    def __init__(
        self,
        backend: InferenceBackend,
        stream: TokenStream,
        detokenizer: IncrementalDetokenizer,
        stop: tuple[str, ...],
        timeout_s: float,
        observer: RequestObserver | None = None,
        on_close: Callable[[], None] | None = None,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        hidden_ids: frozenset[int] = frozenset(),
        cause: Callable[[], Awaitable[errors.APIError | None]] | None = None,
        echo_only: bool = False,
    ) -> None:
        self.request_id = stream.request_id
        self._backend = backend
        self._stream = stream
        self._detok = detokenizer
        self._stop = stop
        self._timeout_s = timeout_s
        self._text = ""  # detokenized output so far (may run past a stop sequence)
        self._sent = 0  # characters of _text already handed out
        self.completion_tokens = 0
        self.finish_reason: str | None = None  # "stop" | "length" once done
        self.timings = RequestTimings()
        self._node_done = False  # the node finished the request itself: nothing to cancel
        self._closed = False
        self._observer = observer  # span and metrics of this request
        self._on_close = on_close  # gives back the request's admission slot
        self.failure: str | None = None  # why it ended without output: dropped, timeout, ...
        self.failure_detail: str | None = None
        self._want_logprobs = logprobs
        self._want_prompt_logprobs = prompt_logprobs
        self.logprobs: list[TokenEntry] = []  # every token's, in order (a request that asked)
        self._taken = 0  # entries of `logprobs` already handed out by take_logprobs
        # The client's stop_token_ids: they end the output like an EOS and, like it, add no text.
        self._hidden = hidden_ids
        self._cause = cause
        # The request scores its prompt only (max_tokens 0 with echo): the engine's one token
        # is not the client's, and the output ends at max_tokens, as OpenAI and vLLM say.
        self._echo_only = echo_only

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas, in order; one per token message (possibly empty while a character or a
        possible stop sequence is incomplete)."""
        try:
            async for event in self._stream.events():
                if isinstance(event, Tokens):
                    if self.timings.first_token is None:
                        self._first_output()
                    elif self._observer is not None:
                        self._observer.tokens(time.monotonic(), len(event.token_ids))
                    self._accept(event)
                    delta, stopped = self._take()
                    if stopped:
                        yield delta
                        await self._finish_by_stop_sequence()
                        return
                    yield delta
                else:
                    self._node_done = True
                    if self._stream.embedding and self.timings.first_token is None:
                        self._first_output()  # an embedding request's one output: its vector
                    await self._check(event)
                    self._text += self._detok.flush()
                    delta, stopped = self._take(final=True)
                    self.finish_reason = "stop" if stopped else OPENAI_FINISH[event.reason]
                    if self._echo_only:
                        self.finish_reason = "length"
                    self.timings.finished = time.monotonic()
                    if delta:
                        yield delta
                    return
        except StreamTimeout:
            self.failure = "timeout"
            await self._cancel("timeout")
            raise errors.request_timeout(self._timeout_s) from None

    def _first_output(self) -> None:
        self.timings.first_token = time.monotonic()
        if self._observer is not None:
            self._observer.first_token(self.timings.first_token)

    @property
    def embedding(self) -> bytes:
        """An embedding request's vector (float32 little-endian), once it finished; b"" else."""
        return self._stream.embedding

    def _accept(self, event: Tokens) -> None:
        """Each token's text, one at a time (so each knows where its text starts), and its
        logprobs where the request asked."""
        if self._want_prompt_logprobs and not self._stream.prompt_logprobs:
            # They ride the first token's message; the final one, which fills a lost token,
            # does not repeat them.
            self.failure = "error"
            self.failure_detail = "the prompt's logprobs were lost on the way from the node"
            raise errors.inference_failed(self.failure_detail)
        if self._echo_only:
            return
        for i, token in enumerate(event.token_ids):
            if self._want_logprobs:
                logprobs = event.logprobs[i] if i < len(event.logprobs) else None
                if logprobs is None:  # a lost token message: the final one fills no logprobs
                    self.failure = "error"
                    self.failure_detail = (f"the logprobs of output token {self.completion_tokens}"
                                           " were lost on the way from the node")
                    raise errors.inference_failed(self.failure_detail)
                self.logprobs.append(TokenEntry(token, logprobs, len(self._text)))
            self.completion_tokens += 1
            if token not in self._hidden:
                self._text += self._detok.push([token])

    @property
    def prompt_logprobs(self) -> list[TokenLogprob]:
        """The prompt's logprobs, one per prompt token after the first (a request that asked
        for them; they arrive with its first token)."""
        return self._stream.prompt_logprobs

    def take_logprobs(self) -> list[TokenEntry]:
        """The logprob entries that arrived since the last call."""
        fresh = self.logprobs[self._taken:]
        self._taken = len(self.logprobs)
        return fresh

    async def _check(self, event: Finished) -> None:
        if event.reason in OPENAI_FINISH:
            return
        self.failure, self.failure_detail = event.reason.value, event.error
        await self._check_cause(event)
        if event.reason is FinishReason.DROPPED:
            raise errors.request_dropped(event.error)
        lifecycle = parse_lifecycle_error(event.error)
        if lifecycle is not None:  # the model is not servable yet (services/placer/readiness.py)
            code, message = lifecycle
            raise (errors.model_failed if code == FAILED else errors.model_not_ready)(message)
        if event.reason is FinishReason.CANCELLED:
            raise errors.inference_failed(event.error or "the request was cancelled by the system")
        raise errors.inference_failed(event.error)

    async def _check_cause(self, event: Finished) -> None:
        """A drop or failure before any output, not told as the model's lifecycle: the model's
        own fault (broken files) is the answer if `cause` finds one."""
        if self._cause is None or self.completion_tokens or event.reason not in (
                FinishReason.DROPPED, FinishReason.ERROR) or parse_lifecycle_error(event.error):
            return
        error = await self._cause()
        if error is not None:
            self.failure, self.failure_detail = "error", error.message
            raise error

    def _take(self, final: bool = False) -> tuple[str, bool]:
        """The next safe piece of text and whether a stop sequence ended the output."""
        hit = self._first_stop()
        if hit is not None:
            delta = self._text[self._sent:hit]
            self._sent = hit
            return delta, True
        end = len(self._text) if final else len(self._text) - self._holdback()
        delta = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta, False

    def _first_stop(self) -> int | None:
        # Text before _sent never held a stop's start (it would have been held back), so search on.
        hits = [i for s in self._stop if (i := self._text.find(s, self._sent)) >= 0]
        return min(hits) if hits else None

    def _holdback(self) -> int:
        """Length of the longest tail of the unsent text that could still grow into a stop."""
        tail = self._text[self._sent:]
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best

    async def _finish_by_stop_sequence(self) -> None:
        self.finish_reason = "stop"
        self.timings.finished = time.monotonic()
        await self._cancel("stop sequence")

    async def _cancel(self, reason: str) -> None:
        if not self._node_done:
            self._node_done = True  # one cancel is enough
            with anyio.CancelScope(shield=True):
                await self._backend.cancel(self.request_id, reason)

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    async def close(self, reason: str = "client disconnected") -> None:
        """Idempotent. Cancels the request on the node if it is still running there."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                if self.finish_reason is None:
                    if self.failure is None:
                        self.failure, self.failure_detail = "cancelled", reason
                    await self._cancel(reason)
                await self._stream.close()
            finally:
                if self._on_close is not None:
                    self._on_close()
        if self._observer is None:
            self._log_finished()
            return
        with trace.use_span(self._observer.span, end_on_exit=False):  # ids on the log line
            self._log_finished()
        self._observer.finished(self, self._stream.node_headers, self._stream.prefill_s)

    def _log_finished(self) -> None:
        if self.finish_reason is None:
            log.info("request %s ended without output: %s (%s)", self.request_id, self.failure,
                     self.failure_detail)
        else:
            t = self.timings
            log.info("request %s finished: %s, %d tokens, ttft %.3fs, total %.3fs", self.request_id,
                     self.finish_reason, self.completion_tokens,
                     (t.first_token or t.submitted) - t.submitted, (t.finished or t.submitted) - t.submitted)

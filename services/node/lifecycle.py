"""What happens to a request this node owns, from the book's records to the engine, the core and
the outbox: it becomes ours, joins its engine, streams its tokens, and ends (finished, handed
back to the request stream, dropped as a stale attempt, or moved away by a live migration).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from services.node.book import (Live, RequestBook, finish_reason, sampling_params, wire_logprobs,
                                wire_prompt_logprobs)
from services.node.engines.base import TokenLogprobs
from services.node.runtime import NodeRuntime
from shared.core.node_scheduler import Eviction
from shared.cluster import grace_from_now
from shared.schemas import FinishReason, InferenceRequest, RequestState, TokenLogprob, TokenMessage

log = logging.getLogger("slinfer.node")


class RequestLifecycle:
    def __init__(self, rt: NodeRuntime, book: RequestBook) -> None:
        self.rt, self.book = rt, book

    # --- becoming ours ----------------------------------------------------------------------------
    def adopt(self, req: InferenceRequest, instance_id: str, output: list[int], cold: bool,
              in_engine: bool = False) -> Live:
        """The request is ours now (admitted, or committed by a migration); `cold`: its
        instance was started for it."""
        live = Live(req, instance_id, output=list(output), in_engine=in_engine)
        self.book.live[req.request_id] = live
        self.book.recent.pop(req.request_id, None)
        self.rt.obs.admitted(req, instance_id, cold=cold)
        return live

    def engine_add(self, live: Live) -> None:
        if live.in_engine or live.error is not None:
            return
        req = live.request
        if not self.rt.adapter_ready(live.instance_id, req.adapter):
            return  # LoRA (issue 12): its adapter's load completion adds it
        try:
            self.rt.engines[live.instance_id].add_request(req.request_id, live.all_tokens,
                                                          sampling_params(req, len(live.output)))
        except Exception as exc:  # e.g. a token id outside the vocabulary
            live.error = f"engine rejected the request: {exc}"
            self.rt.wake.set()
            return
        live.in_engine = True

    # --- streaming and finishing ------------------------------------------------------------------
    async def emit(self, live: Live, token: int, prefill_s: float | None = None,
                   count_in_core: bool = True, logprobs: TokenLogprobs | None = None,
                   prompt_logprobs: list[TokenLogprobs] | None = None) -> bool:
        """A new output token (with its logprobs where the request asked, and the prompt's
        after the prefill of one that asked for those): streamed, or the final message if it
        ends the request (True)."""
        live.output.append(token)
        live.last_logprobs = wire_logprobs(logprobs)
        prompt = wire_prompt_logprobs(prompt_logprobs)
        reason = finish_reason(live, token, self.rt.records[live.instance_id].max_context)
        if reason is None:
            await self.rt.outbox.token(TokenMessage(
                live.request.request_id, len(live.output) - 1, [token], node_id=self.rt.s.node_id,
                prefill_s=prefill_s, attempt=live.request.attempt, logprobs=live.last_logprobs,
                prompt_logprobs=prompt))
            return False
        await self.finish(live, reason, count_in_core=count_in_core, prefill_s=prefill_s,
                          prompt_logprobs=prompt)
        return True

    async def finish(self, live: Live, reason: FinishReason, error: str | None = None,
                     count_in_core: bool = True, prefill_s: float | None = None,
                     prompt_logprobs: list[TokenLogprob] | None = None,
                     embedding: bytes = b"") -> TokenMessage:
        """Send the final message (whole output, so the gateway can fill gaps) and forget it.
        Before its first await, the request is gone from the book and the core, and its K/V
        are freed. Returns the final message (with `prompt_logprobs` when its one token is the
        request's first; with `embedding`, an embedding request's vector, after its prefill)."""
        rid = live.request.request_id
        self.book.live.pop(rid, None)
        self._release(live.instance_id, rid)
        if count_in_core:
            self.rt.start_ops(self.rt.sched.cancel(rid, time.time()))
        last = live.output[-1:] if reason is not FinishReason.CANCELLED else []
        final = TokenMessage(
            rid, max(0, len(live.output) - len(last)), last, finished=True,
            finish_reason=reason, output_token_ids=list(live.output),
            prompt_tokens=len(live.request.prompt_token_ids), error=error,
            node_id=self.rt.s.node_id, prefill_s=prefill_s, attempt=live.request.attempt,
            logprobs=live.last_logprobs if last else [], prompt_logprobs=prompt_logprobs or [],
            embedding=embedding)
        self.book.remember(live, RequestState.FINISHED, final)
        await self.rt.outbox.token(final)
        self.rt.obs.ended(rid, reason.value, live.generated_here, error)
        return final

    async def drop_ended(self) -> None:
        """Finish what must not run on: cancelled, refused by its engine, or past its deadline."""
        for live in [lv for lv in self.book.live.values() if lv.cancelled]:
            await self.finish(live, FinishReason.CANCELLED)
        for live in [lv for lv in self.book.live.values() if lv.error is not None]:
            await self.finish(live, FinishReason.ERROR, live.error)
        for live in self.book.overdue(time.time()):
            await self.finish(live, FinishReason.CANCELLED, "deadline passed: nobody waits for it")

    # --- leaving ---------------------------------------------------------------------------------
    def take_back(self, request_id: str, grace_s: float) -> InferenceRequest | None:
        """Remove a request from this node, returning it with its tokens so far and its grace
        (to resume elsewhere)."""
        live = self.book.live.pop(request_id, None)
        if live is None:
            return None
        self._release(live.instance_id, request_id)
        # Its trace goes with it (in the body: it travels on the request stream again).
        trace_context = self.rt.obs.headers(request_id) or live.request.trace_context
        self.rt.obs.ended(request_id, "handed_back", live.generated_here)
        self.book.remember(live, RequestState.MOVED)
        return replace(live.request, resumed_token_ids=list(live.output),
                       trace_context=trace_context, grace_s=grace_s)

    async def leave(self, live: Live, within_s: float) -> None:
        """The node is stopping (SIGTERM: a rolling update, a scale-down): hand the request back
        to the placers with its tokens, so it resumes elsewhere and its client sees no error.
        The stop is not load, so it is judged from now on, as a resumed request is. If the
        stream cannot take it within `within_s` (NATS down), the gateway's watchdog resumes it
        once this node has left the cluster view."""
        req = live.request
        resumed = self.take_back(req.request_id, grace_from_now(req, len(live.output), time.time()))
        if resumed is None:
            return
        try:
            await self.rt.outbox.hand_back(resumed, within_s)
        except Exception as exc:
            log.warning("could not hand %s back while stopping (%r): its gateway resumes it",
                        req.request_id, exc)

    async def reschedule(self, eviction: Eviction) -> None:
        """An evicted request goes back to the placers with its tokens (token-based migration)."""
        rid = eviction.request.request_id
        with self.rt.obs.use(rid):
            log.info("evicting %s from %s for rescheduling", rid, eviction.instance_id)
        resumed = self.take_back(rid, eviction.request.grace_s)
        if resumed is not None:
            await self.rt.outbox.requeue(resumed)

    def drop_stale(self, live: Live) -> None:
        """Forget an attempt the gateway no longer reads (no final message: nobody listens)."""
        rid = live.request.request_id
        self.book.live.pop(rid, None)
        self._release(live.instance_id, rid)
        self.rt.start_ops(self.rt.sched.cancel(rid, time.time()))
        self.rt.obs.ended(rid, "cancelled", live.generated_here, "superseded by a later attempt")

    def moved_away(self, live: Live) -> None:
        """A live migration's destination took the request over."""
        rid = live.request.request_id
        self._release(live.instance_id, rid)
        self.rt.obs.ended(rid, "migrated", live.generated_here)
        self.book.remember(live, RequestState.MOVED)
        self.rt.wake.set()

    def _release(self, instance_id: str, request_id: str) -> None:
        engine = self.rt.engines.get(instance_id)
        if engine is not None:
            engine.release(request_id)

"""The token loop: at token granularity, `step` (the core's `StepPlan`: memory ops, evictions, at
most one iteration) -> run (the engine's prefill, prefill chunk or decode, in a thread) ->
`postprocess` (tokens streamed or finished, the outcome fed back to the core, calibration). A
failing turn is logged and the loop goes on: it never silently stops generating for everyone.

Chunked prefill (SLINFER_PREFILL_CHUNK_TOKENS): the core plans a prefill as chunks only on
instances whose model's engine chunks (`ModelSpec.chunked_prefill`); the node runs each with the
engine's `prefill_chunk` (`ChunksPrefill`). A chunk that is not the last gives no token; the
request's prefill time is the sum of its chunks'.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from services.node.book import RequestBook
from services.node.cluster_sync import ClusterSync
from services.node.engines import KVCacheFull
from services.node.engines.base import StepResult, chunks_prefill
from services.node.lifecycle import RequestLifecycle
from services.node.runtime import NodeRuntime
from shared.core.iteration import IterationChoice, IterationKind
from shared.core.node_scheduler import StepPlan
from shared.schemas import FinishReason

log = logging.getLogger("slinfer.node")
HISTORY_LEN = 4096


@dataclass(frozen=True)
class IterationRecord:
    """One executed iteration, kept in a bounded history (tests, debugging, metrics)."""

    started: float
    finished: float
    instance_id: str
    kind: IterationKind
    request_ids: tuple[str, ...]
    considered: tuple[tuple[str, float], ...]  # runnable instances and their least headroom
    # A prefill chunk (chunked prefill): its request, tokens already written, its tokens, and
    # whether it is the request's last; None: a whole prefill or a decode step.
    chunk: tuple[str, int, int, bool] | None = None


class TokenLoop:
    def __init__(self, rt: NodeRuntime, book: RequestBook, requests: RequestLifecycle,
                 sync: ClusterSync) -> None:
        self.rt, self.book, self.requests, self.sync = rt, book, requests, sync
        self.iterations = 0
        self.history: deque[IterationRecord] = deque(maxlen=HISTORY_LEN)
        self._chunk_s: dict[str, float] = {}  # engine seconds of a chunked prefill's chunks so far

    async def run(self) -> None:
        while not self.rt.stopping:
            try:
                await self.turn()
                self.rt.trouble("token loop", None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never silently stop generating for everyone
                log.exception("token loop turn failed")
                self.rt.trouble("token loop", exc)
                await asyncio.sleep(0.1)

    async def turn(self) -> None:
        """One turn: drop ended requests, start memory ops, run at most one iteration (or wait
        for something to do)."""
        await self.requests.drop_ended()
        async with self.rt.iter_lock:
            plan = await self._step()
            if plan.iteration is not None:
                await self._run(plan)
                return
        self.rt.wake.clear()
        try:  # (not wait_for: its extra task would put a turn of the loop between wake and step)
            async with asyncio.timeout(self._idle_wait(time.time())):
                await self.rt.wake.wait()
        except TimeoutError:
            pass

    def _idle_wait(self, now: float) -> float:
        """How long to wait for work: a quarter of the default keep-alive, less when an
        instance's own window (a request's keep_alive of 0, say) runs out sooner."""
        wait = self.rt.s.core.keep_alive_s / 4
        due = self.rt.sched.next_reclaim_at()
        if due is not None:
            wait = min(wait, due - now)
        return max(0.05, wait)

    async def _step(self) -> StepPlan:
        """The core's plan for now, its memory ops started and its evictions handed back."""
        sched, now = self.rt.sched, time.time()
        self.rt.start_ops(sched.reclaim_idle(now))
        plan = sched.step(now)
        self.rt.start_ops(plan.start_ops)
        for ev in plan.evictions:
            await self.requests.reschedule(ev)
        return plan

    async def _run(self, plan: StepPlan) -> None:
        choice = plan.iteration
        engine = self.rt.engines[choice.instance_id]
        model = self.rt.records[choice.instance_id].name
        base_s = self.sync.base_prediction(plan, model)
        if self.rt.obs.tracing and (choice.chunk is None or choice.chunk.start == 0):
            first = self.book.live.get(_subjects(choice)[0])
            self.rt.obs.iteration_started(_whole(choice), len(first.all_tokens) if first else 0)
        try:
            started = time.perf_counter()
            if choice.chunk is not None and not choice.chunk.final:
                if not chunks_prefill(engine):  # the core plans none for it
                    raise TypeError(f"the {engine.name} engine cannot run a prefill chunk")
                result = await asyncio.to_thread(engine.prefill_chunk, choice.chunk.request_id,
                                                 choice.chunk.tokens)
            elif choice.kind is IterationKind.PREFILL:  # whole, or a last chunk: all the rest
                result = await asyncio.to_thread(engine.prefill, _subjects(choice)[0])
            else:
                result = await asyncio.to_thread(engine.decode, list(choice.request_ids))
            elapsed = time.perf_counter() - started
        except KVCacheFull:
            await self._kv_full(plan)
            return
        except Exception as exc:
            await self._failed(plan, exc)
            return
        self.iterations += 1
        self.sync.note_prediction(plan, elapsed)
        await self._postprocess(plan, result, elapsed)
        self.sync.calibrate(model, plan, base_s, elapsed)  # (after the tokens went out)

    async def _kv_full(self, plan: StepPlan) -> None:
        choice = plan.iteration
        for rid in _subjects(choice):
            self.rt.obs.event(rid, "kv_cache_full", **{"slinfer.instance_id": choice.instance_id})
        eviction = self.rt.sched.evict_for_memory(choice.instance_id, time.time())
        if eviction is not None:
            await self.requests.reschedule(eviction)

    async def _failed(self, plan: StepPlan, exc: Exception) -> None:
        choice = plan.iteration
        log.error("iteration failed on %s", choice.instance_id, exc_info=exc)
        self.rt.sched.abort_iteration(time.time())
        for rid in _subjects(choice):
            self._chunk_s.pop(rid, None)
            if rid in self.book.live:
                await self.requests.finish(self.book.live[rid], FinishReason.ERROR,
                                           f"engine error: {exc}")

    async def _postprocess(self, plan: StepPlan, result: StepResult, elapsed: float) -> None:
        """Stream or finish each request's token; tell the core the iteration ended."""
        choice = plan.iteration
        now = time.time()
        prefill_s = self._prefill_s(choice, elapsed)
        if prefill_s is not None:  # (before the token: it may end the request and its spans)
            self.rt.obs.prefill_done(_subjects(choice)[0], prefill_s)
        finished: set[str] = set()
        for rid, token in result.tokens.items():
            live = self.book.live.get(rid)
            if live is not None and await self.requests.emit(
                    live, token, prefill_s, count_in_core=False,
                    logprobs=result.logprobs.get(rid),
                    prompt_logprobs=result.prompt_logprobs.get(rid)):
                finished.add(rid)
        for rid, vector in result.embeddings.items():  # a prefill with no decode: done
            live = self.book.live.get(rid)
            if live is not None:
                await self.requests.finish(live, FinishReason.STOP, count_in_core=False,
                                           prefill_s=prefill_s, embedding=vector)
                finished.add(rid)
        chunk = choice.chunk
        self.history.append(IterationRecord(
            now - elapsed, now, choice.instance_id, choice.kind, choice.request_ids,
            plan.considered,
            None if chunk is None else (chunk.request_id, chunk.start, chunk.tokens, chunk.final)))
        self.rt.start_ops(self.rt.sched.finish_iteration(choice, time.time(), finished))
        # nats-py writes what was published from its flusher task, at the loop's next turn.
        # Give it that turn now: else the next iteration's engine thread starts first and the
        # write waits for the GIL behind it (a first token ~1 ms later, seen in strace).
        await asyncio.sleep(0)

    def _prefill_s(self, choice: IterationChoice, elapsed: float) -> float | None:
        """The engine time of a prefill that ended with this iteration (a chunked one: all its
        chunks'); None where none ended (a decode step, a chunk before the last)."""
        chunk = choice.chunk
        if chunk is None:
            return elapsed if choice.kind is IterationKind.PREFILL else None
        if not chunk.final:
            for rid in [r for r in self._chunk_s if r not in self.book.live]:
                del self._chunk_s[rid]  # left mid-prefill (cancelled, moved)
            self._chunk_s[chunk.request_id] = self._chunk_s.get(chunk.request_id, 0.0) + elapsed
            return None
        return self._chunk_s.pop(chunk.request_id, 0.0) + elapsed


def _subjects(choice: IterationChoice) -> tuple[str, ...]:
    """The requests the iteration works for: those it gives a token, or a chunk's request."""
    if choice.chunk is not None and not choice.request_ids:
        return (choice.chunk.request_id,)
    return choice.request_ids


def _whole(choice: IterationChoice) -> IterationChoice:
    """A first chunk seen as the prefill it starts (the request's prefill span opens with it)."""
    if choice.chunk is None or choice.request_ids:
        return choice
    return IterationChoice(choice.instance_id, choice.kind, (choice.chunk.request_id,),
                           choice.headroom, choice.chunk)

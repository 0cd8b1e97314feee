"""The token loop: at token granularity, `step` (the core's `StepPlan`: memory ops, evictions, at
most one iteration) -> run (the engine's prefill or decode, in a thread) -> `postprocess` (tokens
streamed or finished, the outcome fed back to the core, calibration). A failing turn is logged
and the loop goes on: it never silently stops generating for everyone.
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
from services.node.engines.base import StepResult
from services.node.lifecycle import RequestLifecycle
from services.node.runtime import NodeRuntime
from shared.core.iteration import IterationKind
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


class TokenLoop:
    def __init__(self, rt: NodeRuntime, book: RequestBook, requests: RequestLifecycle,
                 sync: ClusterSync) -> None:
        self.rt, self.book, self.requests, self.sync = rt, book, requests, sync
        self.iterations = 0
        self.history: deque[IterationRecord] = deque(maxlen=HISTORY_LEN)

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
        try:
            await asyncio.wait_for(self.rt.wake.wait(), timeout=self._idle_wait(time.time()))
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
        if self.rt.obs.tracing:
            first = self.book.live.get(choice.request_ids[0])
            self.rt.obs.iteration_started(choice, len(first.all_tokens) if first else 0)
        try:
            started = time.perf_counter()
            if choice.kind is IterationKind.PREFILL:
                result = await asyncio.to_thread(engine.prefill, choice.request_ids[0])
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
        self.sync.calibrate(model, plan, base_s, elapsed)
        await self._postprocess(plan, result, elapsed)

    async def _kv_full(self, plan: StepPlan) -> None:
        choice = plan.iteration
        for rid in choice.request_ids:
            self.rt.obs.event(rid, "kv_cache_full", **{"slinfer.instance_id": choice.instance_id})
        eviction = self.rt.sched.evict_for_memory(choice.instance_id, time.time())
        if eviction is not None:
            await self.requests.reschedule(eviction)

    async def _failed(self, plan: StepPlan, exc: Exception) -> None:
        choice = plan.iteration
        log.error("iteration failed on %s", choice.instance_id, exc_info=exc)
        self.rt.sched.abort_iteration(time.time())
        for rid in choice.request_ids:
            if rid in self.book.live:
                await self.requests.finish(self.book.live[rid], FinishReason.ERROR,
                                           f"engine error: {exc}")

    async def _postprocess(self, plan: StepPlan, result: StepResult, elapsed: float) -> None:
        """Stream or finish each request's token; tell the core the iteration ended."""
        choice = plan.iteration
        now = time.time()
        self.history.append(IterationRecord(now - elapsed, now, choice.instance_id, choice.kind,
                                            choice.request_ids, plan.considered))
        prefill_s = elapsed if choice.kind is IterationKind.PREFILL else None
        if prefill_s is not None:
            self.rt.obs.prefill_done(choice.request_ids[0], prefill_s)
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
        self.rt.start_ops(self.rt.sched.finish_iteration(choice, time.time(), finished))

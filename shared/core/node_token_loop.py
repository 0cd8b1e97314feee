"""The token-level loop of a node: which iteration runs next, and its outcome fed back
(SLINFER §VI-A).

`step` picks one iteration among the instances that may run (not loading, not behind a memory
op, not waiting for an adapter or a live handover): the batch whose least headroom is smallest
(`shared.core.iteration.choose_iteration`). If its requests need more KV than the instance holds
(the lengths were underestimated, §VII-D), the instance scales up first where the node has room;
otherwise the request with the most headroom is evicted and the pick is made again.
`finish_iteration` credits the tokens, drops finished requests and scales a pool down lazily
when it fell below the watermark (§VII-B) and the requests it keeps can wait for the resize
(`evaluate.may_shrink`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.core.busy import BusyMeter
from shared.core.cost import contended, contention, kv_ceiling, kv_demand
from shared.core.evaluate import may_shrink
from shared.core.iteration import (IterationChoice, IterationKind, apply_iteration,
                                   choose_iteration, kv_tokens_needed, least_headroom,
                                   plan_chunk, predict_seconds, runnable)
from shared.core.memory import MemOp, watermark_target
from shared.core.node_memops import MemoryOps
from shared.core.node_state import NodeState
from shared.core.types import InstanceStatus, InstanceView, RequestView, RunningIteration

LATE_EPS_S = 1e-9  # a token this close to its deadline is on time (float rounding; the sim's too)
_RUNS = (InstanceStatus.READY, InstanceStatus.HANDOVER)  # statuses whose instances run iterations


@dataclass(frozen=True)
class Eviction:
    request: RequestView  # removed from the node; reschedule it elsewhere (it keeps its tokens)
    instance_id: str


@dataclass(frozen=True)
class StepPlan:
    iteration: IterationChoice | None  # the one iteration to run now; None: nothing runnable
    predicted_s: float = 0.0  # profile's estimate of its duration
    start_ops: tuple[MemOp, ...] = ()  # memory ops to begin now (underestimation scale-ups)
    evictions: tuple[Eviction, ...] = ()  # requests evicted because memory could not grow
    # Every instance that could have run, with its least headroom at the pick: why this one won.
    considered: tuple[tuple[str, float], ...] = ()


class TokenLoop:
    def __init__(self, state: NodeState, memops: MemoryOps) -> None:
        self.state = state
        self.memops = memops

    def step(self, now: float) -> StepPlan:
        """Choose the next iteration; resolve KV shortfalls first (scale up, else evict)."""
        state, node = self.state, self.state.node
        running = state.running_ops()
        blocked = {i.instance_id for i in node.instances
                   if i.status not in _RUNS or i.instance_id in running}
        blocked |= state.adapters_busy() | set(state.waits_for)
        ops: list[MemOp] = []
        evictions: list[Eviction] = []
        while True:
            choice = choose_iteration(node.instances, now, blocked)
            if choice is None:
                return StepPlan(None, 0.0, tuple(ops), tuple(evictions))
            inst = state.instance(choice.instance_id)
            if choice.kind is IterationKind.PREFILL and state.config.prefill_chunk_tokens \
                    and inst.model.chunked_prefill:
                choice = self._chunked(choice, now, blocked)
            if kv_tokens_needed(choice, inst) <= state.kv_capacity_tokens(inst):
                if self._outlasts_handover(choice, inst, now):
                    blocked.add(inst.instance_id)
                    continue
                return self._start(choice, inst, now, blocked, ops, evictions)
            blocked.add(inst.instance_id)
            if inst.status is InstanceStatus.HANDOVER:
                pass  # never grows (its unload is held): evict below, it moves stop-and-resume
            elif state.ledger.busy(inst.instance_id):
                continue  # its scale-up is parked or running: others go first meanwhile
            grown = None if inst.status is InstanceStatus.HANDOVER else \
                self._grow_for(inst, kv_tokens_needed(choice, inst), now)
            if grown is not None:
                ops.extend(grown)
                continue
            evictions.append(_evict_longest(inst, now))
            blocked.discard(inst.instance_id)  # it may fit now

    def _chunked(self, choice: IterationChoice, now: float, blocked: set[str]) -> IterationChoice:
        """Chunked prefill: the chosen prefill's next chunk, sized as the validation sizes it
        (its overestimate, slower by the stages the node hosts: `plan_chunk`)."""
        state = self.state
        config = contended(state.config, state.node.stage_load)
        profiles = {i.instance_id: state.profile(i) for i in state.node.instances
                    if runnable(i, now, blocked)}
        return plan_chunk(choice, state.node.instances, profiles, now, blocked,
                          config.prefill_chunk_tokens, 1 + config.overestimate)

    def _outlasts_handover(self, choice: IterationChoice, inst: InstanceView, now: float) -> bool:
        """Would this iteration of a live preemption's victim end after its handover
        (`leaves_at`), as the validation times it? Its handover, and the preemptor promised to
        run then, would wait for it: a victim runs only what ends by then (`shadow._pick`)."""
        if inst.status is not InstanceStatus.HANDOVER:
            return False
        config = contended(self.state.config, self.state.node.stage_load)
        seconds = predict_seconds(choice, inst, self.state.profile(inst))
        return now + seconds * (1 + config.overestimate) > inst.leaves_at

    def _start(self, choice: IterationChoice, inst: InstanceView, now: float, blocked: set[str],
               ops: list[MemOp], evictions: list[Eviction]) -> StepPlan:
        """The iteration is chosen and fits: the node runs it from now."""
        node = self.state.node
        predicted = predict_seconds(choice, inst, self.state.profile(inst))
        # Its end as the node's validation expects it: slower by the stages it hosts.
        node.busy_until = now + predicted * contention(node.stage_load)
        chunk = choice.chunk
        partial = chunk is not None and not chunk.final
        node.running = RunningIteration(
            choice.instance_id, choice.request_ids, choice.kind is IterationKind.PREFILL,
            chunk.request_id if partial else "", chunk.start + chunk.tokens if partial else 0)
        self.state.started = (choice.instance_id, now)
        considered = tuple((i.instance_id, least_headroom(i, now)) for i in node.instances
                           if runnable(i, now, blocked))
        return StepPlan(choice, predicted, tuple(ops), tuple(evictions), considered)

    def _grow_for(self, inst: InstanceView, tokens: int, now: float) -> list[MemOp] | None:
        """Underestimation (§VII-D): try to scale up again; None if the node has no room."""
        spec = inst.model
        need = max(tokens * spec.kv_bytes_per_token, kv_demand(spec, inst.requests))
        ceiling = kv_ceiling(inst)
        if ceiling is not None and need > ceiling:
            return None  # its stages' hosts reserved no more: evict instead (issue 22 #1)
        target = int(need * (1 + self.state.config.watermark))
        if ceiling is not None:
            target = min(target, ceiling)
        for size in (target, need):
            if self.state.ledger.fits(inst.instance_id, spec.weight_bytes + size):
                return self.memops.resize(inst, size, now)
        return None

    def finish_iteration(self, choice: IterationChoice, now: float,
                         finished: set[str] = frozenset()) -> list[MemOp]:
        """The iteration ran: credit its tokens (counting those that came after their deadline),
        drop finished requests, maybe scale down."""
        inst = self.state.find(choice.instance_id)
        self._idle(now)
        if inst is None:
            return []
        chosen = set(choice.request_ids)
        self.state.node.late_tokens += sum(1 for r in inst.requests if r.request_id in chosen
                                           and now > r.deadline() + LATE_EPS_S)
        apply_iteration(choice, inst)
        inst.last_active = now
        return self._remove_requests(inst, finished, now)

    def evict_for_memory(self, instance_id: str, now: float) -> Eviction | None:
        """The engine ran out of KV blocks mid-iteration (its block rounding outran our token
        accounting): the iteration did not happen; evict the longest-headroom request (§VII-D)."""
        self._idle(now)
        inst = self.state.find(instance_id)
        if inst is None or not inst.requests:
            return None
        return _evict_longest(inst, now)

    def abort_iteration(self, now: float) -> None:
        """The iteration failed; its requests are dealt with by the caller (cancel or evict)."""
        self._idle(now)

    def cancel(self, request_id: str, now: float) -> list[MemOp]:
        for inst in self.state.node.instances:
            if any(r.request_id == request_id for r in inst.requests):
                return self._remove_requests(inst, {request_id}, now)
        return []

    def _idle(self, now: float) -> None:
        state = self.state
        state.node.busy_until = now
        state.node.running = None
        if state.started is not None:  # the instance's busy fraction (module scaling reads it)
            iid, started = state.started
            state.started = None
            inst = state.find(iid)
            if inst is not None:
                meter = inst.busy or BusyMeter.start(state.config.busy_window_s, started)
                inst.busy = meter.observe(started, now)

    def _remove_requests(self, inst: InstanceView, ids: set[str], now: float) -> list[MemOp]:
        if not ids:
            return []
        inst.requests = [r for r in inst.requests if r.request_id not in ids]
        for rid in ids:  # a chunked prefill's K/V goes with its request
            inst.prefill_progress.pop(rid, None)
        inst.last_active = now
        need = kv_demand(inst.model, inst.requests)
        target = watermark_target(inst.kv_bytes, need, self.state.config.watermark)
        if target is not None and target < inst.kv_bytes and inst.status is InstanceStatus.READY \
                and may_shrink(self.state.node, inst, target, self.state.perf, now,
                               self.state.config):
            return self.memops.resize(inst, target, now)  # lazy scale-down (§VII-B)
        return []


def _evict_longest(inst: InstanceView, now: float) -> Eviction:
    """Take the request with the most headroom off the instance (it can best afford a move)."""
    victim = max(inst.requests, key=lambda r: (r.headroom(now), r.request_id))
    inst.requests.remove(victim)
    inst.prefill_progress.pop(victim.request_id, None)
    return Eviction(victim, inst.instance_id)

"""The node's brain: token-level scheduling plus the memory subsystem, as a pure state machine.

The node worker (real engines) and the simulator (profile-timed engines) drive it the same way:

    result = sched.admit(request, instance_id, model, now)   # re-check, then commit
    result = sched.preempt_and_admit(victims, request, instance_id, model, now)  # §VIII-A
    result = sched.preempt_and_admit(..., handover_s=h)   # live: the victims hand over first
    left, ops = sched.finish_handover(victim, now)            # a victim's requests have moved
    plan = sched.step(now)                                    # what to run now (+ memory ops)
    ...execute plan.iteration and plan.start_ops...
    sched.finish_iteration(plan.iteration, now, finished)     # feed the outcome back
    sched.memop_done(op, now)                                 # a memory op completed
    sched.reclaim_idle(now)                                   # keep-alive expiry

LoRA adapters (ServerlessLoRA §4.4) ride on an instance of their backbone: a request that runs
through an adapter is admitted to a backbone instance with `adapter=AdapterSpec(...)`; where the
instance does not hold the adapter yet, its memory demand is the adapter's bytes plus its KV (the
backbone's weights are there already), and the adapter gets its own entry in the memory ledger
(`adapter_key`) and its own LOAD op, which the node executes like any other memory op. The
instance runs nothing while one of its adapters loads (the op is priced by its bytes, and the
admission is validated with that wait: `shared.core.lora.evaluate_through`); unloading the
instance detaches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared.core.admission import Admission, AdmitReason
from shared.core.busy import BusyMeter
from shared.core.config import CoreConfig
from shared.core.consolidation import idle_instances, preemption_victims
from shared.core.cost import (instance_profile, kv_ceiling, kv_demand, kv_for_layers,
                              layout_spec)
from shared.core.evaluate import evaluate, handing_over, without_instances
from shared.core.iteration import (IterationChoice, IterationKind, apply_iteration,
                                   choose_iteration, kv_tokens_needed, least_headroom,
                                   predict_seconds, runnable)
from shared.core.lora import ADAPTER_LOAD_BYTES_PER_S  # noqa: F401 (the pre-loaders' import)
from shared.core.lora import (Artifact, CallRates, adapter_load_s, adapter_ready_at,
                              admission_through, evaluate_through, may_hold, offload_order)
from shared.core.memory import (UNLOAD_S, MemOp, MemOpKind, MemoryLedger, memop_seconds,
                                watermark_target)
from shared.core.perf_model import PerfModel
from shared.core.readiness import (handover_ready_at, load_seconds, memop_timeline,
                                   new_instance_view)
from shared.core.readiness import op_owner as _owner_id
from shared.core.types import (AdapterSpec, Hardware, InstanceLayout, InstanceStatus, InstanceView, ModelSpec,
                               NodeView, PipelineMode, RequestView, RunningIteration, adapter_key,
                               adapter_owner)


LATE_EPS_S = 1e-9  # a token this close to its deadline is on time (float rounding; the sim's too)
_RUNS = (InstanceStatus.READY, InstanceStatus.HANDOVER)  # statuses whose instances run iterations


@dataclass(frozen=True)
class AdmitResult:
    admission: Admission
    instance_id: str | None = None  # where the request now lives (a new id if created)
    start_ops: tuple[MemOp, ...] = ()  # memory operations to begin now (load or KV scale-up)
    evicted: tuple[RequestView, ...] = ()  # preempt-and-admit: the victims' requests, to move
    # Live preempt-and-admit: the victims' requests, still running here, to migrate live; each
    # victim is unloaded by `finish_handover` once its requests have gone.
    migrating: tuple[RequestView, ...] = ()


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


@dataclass
class NodeScheduler:
    node: NodeView  # authoritative state of this node (instances, requests, KV sizes)
    perf: PerfModel
    config: CoreConfig = field(default_factory=CoreConfig)

    def __post_init__(self) -> None:
        self.ledger = MemoryLedger(self.node.memory_bytes)
        self._next_instance = 1
        self._op_estimates: dict[int, float] = {}  # op id -> its estimated duration
        self._adapter_of: dict[str, str] = {}  # request -> the adapter it runs through
        # Model or adapter -> its recent admission times (a request through an adapter counts
        # for the adapter and for its backbone): the invocation rates offloading and
        # pre-loading weigh artifacts by (ServerlessLoRA §4.1, §4.3).
        self._rates = CallRates()
        # Live preemption: preemptor instance -> the victims it waits for (runs nothing until
        # they are unloaded: the handover the admission was validated with).
        self._waits_for: dict[str, set[str]] = {}
        self._loads: dict[str, float] = {}  # hold key -> the compute share it takes (`hold`)
        self._started: tuple[str, float] | None = None  # the running iteration's instance, start

    # --- admission -----------------------------------------------------------------------------
    def admit(self, request: RequestView, instance_id: str | None, model: ModelSpec,
              now: float, adapter: AdapterSpec | None = None,
              not_before: float | None = None) -> AdmitResult:
        """Re-check the placer's decision against this node's own state, then commit it.
        `adapter`: the LoRA adapter the request runs through on this backbone instance.
        `not_before`: the instance runs nothing before then (a live preemption's handover)."""
        def check(freed: int = 0) -> Admission:
            """The admission with `freed` more bytes of idle adapters offloaded first."""
            return evaluate_through(self.view(), instance_id, request, model, adapter, self.perf,
                                    now, self.config, not_before, freed)

        admission = check()
        ops: list[MemOp] = []
        if admission.reason is AdmitReason.MEMORY:
            admission, ops = self._offload_for(check, adapter, now)
        if not admission.ok:
            return AdmitResult(admission, start_ops=tuple(ops))
        self._note_use(request.request_id, model.name, adapter, now)
        if instance_id is None:
            result = self._admit_new(request, model, admission, now, adapter)
            inst = self._instance(result.instance_id)
            return replace(result, start_ops=(*ops, *result.start_ops,
                                              *self._attach(inst, adapter, now)))
        inst = self._instance(instance_id)
        if admission.kv_target_bytes is not None:
            ops.extend(self._resize(inst, admission.kv_target_bytes, now))
        ops.extend(self._attach(inst, adapter, now))
        inst.requests.append(self._joining(request, admission, adapter))
        inst.last_active = now
        return AdmitResult(admission, instance_id, tuple(ops))

    # --- LoRA adapters on backbone instances ----------------------------------------------------
    @staticmethod
    def _joining(request: RequestView, admission: Admission,
                 adapter: AdapterSpec | None) -> RequestView:
        """The request as its instance holds it: with its cold-start grace and, where it runs
        through an adapter, the adapter's name (its batch's LoRA cost counts distinct adapters)."""
        name = adapter.name if adapter is not None else request.adapter
        return replace(request, grace_s=admission.grace_s, adapter=name)

    def _attach(self, inst: InstanceView, adapter: AdapterSpec | None, now: float) -> list[MemOp]:
        if adapter is None or adapter.name in inst.adapters:
            return []
        ok, ops = self.ledger.request(MemOpKind.LOAD, adapter_key(inst.instance_id, adapter.name),
                                      adapter.bytes, now)
        assert ok, "admit() checked the budget with the adapter's bytes"
        inst.adapters[adapter.name] = adapter.bytes
        self._sync(now)
        return ops

    def detach_adapter(self, instance_id: str, adapter: str, now: float) -> list[MemOp]:
        """Unload an adapter from a backbone instance (offloading, §4.3): its bytes leave the
        budget; the UNLOAD op (and anything it releases) is returned to execute. The caller
        makes sure no request still runs through it."""
        inst = self._find(instance_id)
        if inst is None or adapter not in inst.adapters:
            return []
        del inst.adapters[adapter]
        _, ops = self.ledger.request(MemOpKind.UNLOAD, adapter_key(instance_id, adapter), 0, now)
        self._sync(now)
        return ops

    # --- dynamic offloading (ServerlessLoRA §4.3) ----------------------------------------------
    def _note_use(self, request_id: str, model: str, adapter: AdapterSpec | None,
                  now: float) -> None:
        if adapter is not None:
            live = {r.request_id for i in self.node.instances for r in i.requests}
            self._adapter_of = {rid: a for rid, a in self._adapter_of.items() if rid in live}
            self._adapter_of[request_id] = adapter.name
        self._rates.note(model, adapter.name if adapter is not None else None, now)

    def rate(self, name: str, now: float) -> float:
        """Invocations per second of a model (its adapters' calls included) or an adapter on
        this node: its recent admissions over the time they span (to now), so it falls while
        nothing calls it; 0 for one never admitted here."""
        return self._rates.rate(name, now)

    def adapter_rate(self, adapter: str, now: float) -> float:
        return self.rate(adapter, now)

    def called(self) -> list[str]:
        """Every model and adapter admitted here (the ones with a rate)."""
        return self._rates.called()

    def preload_adapter(self, instance_id: str, adapter: AdapterSpec, now: float) -> list[MemOp]:
        """Attach an adapter to a ready backbone instance before any request asks for it
        (pre-loading, §4.1), if the node's budget has room for it now: its LOAD op, or nothing.
        Under pressure it is offloaded like any idle adapter (§4.3)."""
        inst = self._find(instance_id)
        if inst is None or inst.status is not InstanceStatus.READY or adapter.name in inst.adapters:
            return []
        if self.ledger.budget + adapter.bytes > self.ledger.capacity:
            return []
        # Its load holds the instance up: only where the requests running there can wait for it.
        until = adapter_ready_at(self.node, adapter.bytes, now)
        if not may_hold(self.view(), instance_id, until, self.perf, now, self.config):
            return []
        return self._attach(inst, adapter, now)

    def offloadable(self, now: float, keep: str | None = None) -> list[tuple[str, str, int]]:
        """Attached adapters without a request in flight, least valuable first (`offload_order`:
        value = load time saved x invocation rate, per byte): (instance, adapter, bytes)."""
        busy: set[str] = set()
        artifacts: list[Artifact] = []
        for inst in self.node.instances:
            running = {self._adapter_of.get(r.request_id) for r in inst.requests}
            for name, nbytes in inst.adapters.items():
                key = adapter_key(inst.instance_id, name)
                if name in running or name == keep:
                    busy.add(key)
                artifacts.append(Artifact(key, nbytes, adapter_load_s(nbytes),
                                          self.adapter_rate(name, now), inst.instance_id))
        order = offload_order(artifacts, busy)
        sizes = {a.name: a.bytes for a in artifacts}
        return [(*adapter_owner(key), sizes[key]) for key in order]

    def _offload_for(self, check, adapter: AdapterSpec | None,
                     now: float) -> tuple[Admission, list[MemOp]]:
        """A memory refusal: offload idle adapters, least valuable first, until the admission
        passes; nothing is offloaded when even all of them would not make it pass."""
        candidates = self.offloadable(now, keep=adapter.name if adapter else None)
        if not candidates or not check(sum(c[2] for c in candidates)).ok:
            return Admission(AdmitReason.MEMORY), []
        ops: list[MemOp] = []
        admission = Admission(AdmitReason.MEMORY)
        for iid, name, _ in candidates:
            ops.extend(self.detach_adapter(iid, name, now))
            admission = check()
            if admission.ok:
                break
        return admission, ops

    def _adapters_busy(self) -> set[str]:
        """Instances with an adapter op running or parked: they run nothing until it is done."""
        ops = (*self.ledger.running(), *self.ledger.parked())
        return {owner[0] for op in ops if (owner := adapter_owner(op.instance_id)) is not None}

    def start_instance(self, like: RequestView, model: ModelSpec, now: float) -> AdmitResult:
        """Start an instance of `model` with no request yet (a burst's extra instance,
        `shared.core.burst`): checked and sized as a new instance for `like` would be, which
        stays with its own instance elsewhere; requests join this one by later placements."""
        admission = evaluate(self.view(), None, like, model, self.perf, now, self.config)
        if not admission.ok:
            return AdmitResult(admission)
        return self._admit_new(None, model, admission, now)

    def _admit_new(self, request: RequestView | None, model: ModelSpec, admission: Admission,
                   now: float, adapter: AdapterSpec | None = None) -> AdmitResult:
        iid = f"{model.name}@{self.node.node_id}#{self._next_instance}"
        self._next_instance += 1
        kv = admission.kv_target_bytes or 0
        inst = InstanceView(iid, model, self.node.node_id, InstanceStatus.LOADING, kv_bytes=kv,
                            ready_at=now, last_active=now,  # through a pipeline: the startup's
                            pipeline=new_instance_view(self.node, model, now).pipeline)
        if request is not None:
            inst.requests.append(self._joining(request, admission, adapter))
        self.node.instances.append(inst)
        ok, ops = self.ledger.request(MemOpKind.LOAD, iid, model.weight_bytes + kv, now)
        assert ok, "evaluate() approved the budget"
        self._sync(now)
        return AdmitResult(admission, iid, tuple(ops))

    def preempt_and_admit(self, victims: list[str], request: RequestView, instance_id: str | None,
                          model: ModelSpec, now: float, adapter: AdapterSpec | None = None,
                          handover_s: float | None = None) -> AdmitResult:
        """Proactive preemption (§VIII-A) as one step the node re-checks first: the victims must
        still be strictly smaller than the preemptor, and the request must pass on this node
        without them. Only then are they unloaded (their requests come back in `evicted`, to be
        moved where the plan validated them) and the request admitted. A refusal leaves the
        victims untouched.

        `handover_s` (live preemption): the victims are not unloaded now. Their requests run on
        here while they migrate live (`migrating`), for about `handover_s`; the request must
        pass with the victims' work until then and its instance waiting for the handover."""
        preemptor = self._find(instance_id) if instance_id is not None else None
        allowed = {v.instance_id for v in preemption_victims(self.node, preemptor)}
        if (instance_id is not None and preemptor is None) or not set(victims) <= allowed:
            return AdmitResult(Admission(AdmitReason.VICTIMS_CHANGED))
        if handover_s is not None:
            return self._preempt_live(victims, request, instance_id, model, now, adapter, handover_s)
        gone = without_instances(self.view(), set(victims))
        # Their unloads run first: an op that needs their memory (the newcomer's adapter) starts
        # after them, as the admission that follows the unloads sees it in the timeline.
        if victims:
            gone = replace(gone, memops_until=max(gone.memops_until, now + UNLOAD_S))
        admission = self._trial(gone, instance_id, request, model, adapter, now)
        if not admission.ok:
            return AdmitResult(admission)
        evicted, unload_ops = self.preempt(victims, now)
        result = self.admit(request, instance_id, model, now, adapter)
        return replace(result, start_ops=(*unload_ops, *result.start_ops), evicted=tuple(evicted))

    def _trial(self, view: NodeView, instance_id: str | None, request: RequestView,
               model: ModelSpec, adapter: AdapterSpec | None, now: float,
               not_before: float | None = None) -> Admission:
        """What `admit` would answer on `view` (the node once the victims are gone), committing
        nothing: the same check, the same offloading of idle adapters on a memory refusal (the
        victims' are not on the view: they go with them)."""
        return admission_through(view, instance_id, request, model, adapter, self.perf, now,
                                 self.config, not_before)

    def _preempt_live(self, victims: list[str], request: RequestView, instance_id: str | None,
                      model: ModelSpec, now: float, adapter: AdapterSpec | None,
                      handover_s: float) -> AdmitResult:
        if any(self._instance(v).status is not InstanceStatus.READY and self._instance(v).requests
               for v in victims):  # a loading victim's requests cannot move live (as planned)
            return AdmitResult(Admission(AdmitReason.VICTIMS_CHANGED))
        leaves_at = now + max(0.0, handover_s)
        ready = handover_ready_at(leaves_at)
        trial = handing_over(self.view(), set(victims), leaves_at)
        admission = self._trial(trial, instance_id, request, model, adapter, now, ready)
        if not admission.ok:
            return AdmitResult(admission)
        targets = {v: self.ledger.target(v) for v in victims}
        ops = self._hand_over(victims, leaves_at, now)
        result = self.admit(request, instance_id, model, now, adapter, not_before=ready)
        if not result.admission.ok:  # cannot happen after the check above; undo, to be safe
            self._undo_handover(targets, now)
            return result
        self._waits_for[result.instance_id] = set(victims)
        self._refresh_timeline(now)
        moving = tuple(replace(r) for v in victims for r in self._instance(v).requests)
        return replace(result, start_ops=(*ops, *result.start_ops), migrating=moving)

    def _hand_over(self, victims: list[str], leaves_at: float, now: float) -> list[MemOp]:
        """The victims stop taking work; their memory leaves the optimistic budget (promised to
        the newcomer) but stays counted by pessimistic tracking: their unloads are held in the
        reservation station until `finish_handover`."""
        ops: list[MemOp] = []
        for iid in victims:
            inst = self._instance(iid)
            inst.status, inst.leaves_at = InstanceStatus.HANDOVER, leaves_at
            ops.extend(self.ledger.request(MemOpKind.UNLOAD, iid, 0, now, hold=True)[1])
        self._sync(now)
        return ops

    def _undo_handover(self, targets: dict[str, int], now: float) -> None:
        for iid, target in targets.items():
            inst = self._instance(iid)
            inst.status, inst.leaves_at = InstanceStatus.READY, 0.0
            self.ledger.request(MemOpKind.SCALE, iid, target, now)  # cancels the held unload
        self._sync(now)

    def handing_over(self) -> list[str]:
        return [i.instance_id for i in self.node.instances if i.status is InstanceStatus.HANDOVER]

    def finish_handover(self, instance_id: str, now: float) -> tuple[list[RequestView], list[MemOp]]:
        """A victim's live migrations have ended: it is unloaded now. Requests still on it (a
        migration that was refused or failed) come back, to move stop-and-resume."""
        inst = self._find(instance_id)
        if inst is None or inst.status is not InstanceStatus.HANDOVER:
            return [], []
        left, inst.requests = inst.requests, []
        inst.status = InstanceStatus.UNLOADING
        ops: list[MemOp] = []
        for adapter in list(inst.adapters):  # its adapters go with it
            ops.extend(self.detach_adapter(instance_id, adapter, now))
        ops.extend(self.ledger.release(instance_id, now))
        self._sync(now)
        return left, ops

    # --- the token-level loop ---------------------------------------------------------------
    def step(self, now: float) -> StepPlan:
        """Choose the next iteration; resolve KV shortfalls first (scale up, else evict)."""
        blocked = {i.instance_id for i in self.node.instances
                   if i.status not in _RUNS or i.instance_id in self._running_ops()}
        blocked |= self._adapters_busy() | set(self._waits_for)
        ops: list[MemOp] = []
        evictions: list[Eviction] = []
        while True:
            choice = choose_iteration(self.node.instances, now, blocked)
            if choice is None:
                return StepPlan(None, 0.0, tuple(ops), tuple(evictions))
            inst = self._instance(choice.instance_id)
            if kv_tokens_needed(choice, inst) <= self._kv_capacity_tokens(inst):
                predicted = predict_seconds(choice, inst, self._profile(inst))
                self.node.busy_until = now + predicted
                self.node.running = RunningIteration(choice.instance_id, choice.request_ids,
                                                     choice.kind is IterationKind.PREFILL)
                self._started = (choice.instance_id, now)
                considered = tuple((i.instance_id, least_headroom(i, now)) for i in self.node.instances
                                   if runnable(i, now, blocked))
                return StepPlan(choice, predicted, tuple(ops), tuple(evictions), considered)
            blocked.add(inst.instance_id)
            if inst.status is InstanceStatus.HANDOVER:
                pass  # never grows (its unload is held): evict below, it moves stop-and-resume
            elif self.ledger.busy(inst.instance_id):
                continue  # its scale-up is parked or running: others go first meanwhile
            grown = None if inst.status is InstanceStatus.HANDOVER else \
                self._grow_for(inst, kv_tokens_needed(choice, inst), now)
            if grown is not None:
                ops.extend(grown)
                continue
            victim = max(inst.requests, key=lambda r: (r.headroom(now), r.request_id))
            inst.requests.remove(victim)
            evictions.append(Eviction(victim, inst.instance_id))
            blocked.discard(inst.instance_id)  # it may fit now

    def _grow_for(self, inst: InstanceView, tokens: int, now: float) -> list[MemOp] | None:
        """Underestimation (§VII-D): try to scale up again; None if the node has no room."""
        spec = inst.model
        need = max(tokens * spec.kv_bytes_per_token, kv_demand(spec, inst.requests))
        ceiling = kv_ceiling(inst)
        if ceiling is not None and need > ceiling:
            return None  # its stages' hosts reserved no more: evict instead (issue 22 #1)
        target = int(need * (1 + self.config.watermark))
        if ceiling is not None:
            target = min(target, ceiling)
        for size in (target, need):
            if self.ledger.fits(inst.instance_id, spec.weight_bytes + size):
                return self._resize(inst, size, now)
        return None

    def finish_iteration(self, choice: IterationChoice, now: float,
                         finished: set[str] = frozenset()) -> list[MemOp]:
        """The iteration ran: credit its tokens (counting those that came after their deadline),
        drop finished requests, maybe scale down."""
        inst = self._find(choice.instance_id)
        self._idle(now)
        if inst is None:
            return []
        chosen = set(choice.request_ids)
        self.node.late_tokens += sum(1 for r in inst.requests
                                     if r.request_id in chosen and now > r.deadline() + LATE_EPS_S)
        apply_iteration(choice, inst)
        inst.last_active = now
        return self._remove_requests(inst, finished, now)

    def evict_for_memory(self, instance_id: str, now: float) -> Eviction | None:
        """The engine ran out of KV blocks mid-iteration (its block rounding outran our token
        accounting): the iteration did not happen; evict the longest-headroom request (§VII-D)."""
        self._idle(now)
        inst = self._find(instance_id)
        if inst is None or not inst.requests:
            return None
        victim = max(inst.requests, key=lambda r: (r.headroom(now), r.request_id))
        inst.requests.remove(victim)
        return Eviction(victim, instance_id)

    def abort_iteration(self, now: float) -> None:
        """The iteration failed; its requests are dealt with by the caller (cancel or evict)."""
        self._idle(now)

    def _idle(self, now: float) -> None:
        self.node.busy_until = now
        self.node.running = None
        if self._started is not None:  # the instance's busy fraction (module scaling reads it)
            iid, started = self._started
            self._started = None
            inst = self._find(iid)
            if inst is not None:
                meter = inst.busy or BusyMeter.start(self.config.busy_window_s, started)
                inst.busy = meter.observe(started, now)

    def cancel(self, request_id: str, now: float) -> list[MemOp]:
        for inst in self.node.instances:
            if any(r.request_id == request_id for r in inst.requests):
                return self._remove_requests(inst, {request_id}, now)
        return []

    def _remove_requests(self, inst: InstanceView, ids: set[str], now: float) -> list[MemOp]:
        if not ids:
            return []
        inst.requests = [r for r in inst.requests if r.request_id not in ids]
        inst.last_active = now
        spec = inst.model
        need = kv_demand(spec, inst.requests)
        target = watermark_target(inst.kv_bytes, need, self.config.watermark)
        if target is not None and target < inst.kv_bytes and inst.status is InstanceStatus.READY:
            return self._resize(inst, target, now)  # lazy scale-down (§VII-B)
        return []

    # --- memory operations ------------------------------------------------------------------
    def memop_done(self, op: MemOp, now: float) -> list[MemOp]:
        """A memory op completed (reservation-station stream): release what is now safe."""
        started = self.ledger.complete(op.instance_id, op.op_id, now)
        self._op_estimates.pop(op.op_id, None)
        inst = self._find(op.instance_id)
        if inst is not None and op.kind is MemOpKind.LOAD and inst.status is InstanceStatus.LOADING:
            inst.status = InstanceStatus.READY
            if not inst.requests:  # (a burst's instance, started empty): its keep-alive counts
                inst.last_active = now  # from when it can serve, not from its admission
        owner = self._find(_owner_id(op.instance_id))  # the instance, also for an adapter's op
        if owner is not None and not self.ledger.busy(owner.instance_id) and \
                owner.instance_id not in self._adapters_busy():
            owner.ready_at = min(owner.ready_at, now)  # free to run now, however long we guessed
        if op.kind is MemOpKind.UNLOAD and self.ledger.target(op.instance_id) == 0:
            self.node.instances = [i for i in self.node.instances if i.instance_id != op.instance_id]
            self._handed_over(op.instance_id, now)
        self._sync(now)
        return started

    def _handed_over(self, victim: str, now: float) -> None:
        """A victim is unloaded: a preemptor that waited for it alone may run now."""
        for iid in list(self._waits_for):
            self._waits_for[iid].discard(victim)
            if self._waits_for[iid]:
                continue
            del self._waits_for[iid]
            inst = self._find(iid)
            if inst is not None and not self.ledger.busy(iid):
                inst.ready_at = min(inst.ready_at, now)

    def reclaim_idle(self, now: float) -> list[MemOp]:
        ops: list[MemOp] = []
        for inst in idle_instances(self.node, now, self.config.keep_alive_s):
            if not self.ledger.busy(inst.instance_id):
                ops.extend(self._unload(inst, now))
        return ops

    def next_reclaim_at(self) -> float | None:
        """When the next idle instance's keep-alive expires (None: no idle instance waits for
        one). An idle instance with a memory op in flight is not counted: that op's completion
        is the next event that matters for it."""
        times = [i.last_active + self.config.keep_alive_s for i in self.node.instances
                 if i.status is InstanceStatus.READY and not i.requests
                 and not self.ledger.busy(i.instance_id)]
        return min(times, default=None)

    def preempt(self, instance_ids: list[str], now: float) -> tuple[list[RequestView], list[MemOp]]:
        """Unload these instances; their requests come back for rescheduling elsewhere."""
        evicted: list[RequestView] = []
        ops: list[MemOp] = []
        for iid in instance_ids:
            inst = self._find(iid)
            if inst is None or inst.status is InstanceStatus.UNLOADING:
                continue
            evicted.extend(inst.requests)
            inst.requests = []
            ops.extend(self._unload(inst, now))
        return evicted, ops

    def _unload(self, inst: InstanceView, now: float) -> list[MemOp]:
        inst.status = InstanceStatus.UNLOADING
        ops: list[MemOp] = []
        for adapter in list(inst.adapters):  # its adapters go with it
            ops.extend(self.detach_adapter(inst.instance_id, adapter, now))
        ops.extend(self.ledger.request(MemOpKind.UNLOAD, inst.instance_id, 0, now)[1])
        if self.ledger.target(inst.instance_id) == 0 and not self.ledger.busy(inst.instance_id):
            # a load that never started was cancelled outright: nothing to execute
            self.node.instances = [i for i in self.node.instances if i.instance_id != inst.instance_id]
        self._sync(now)
        return ops

    def _resize(self, inst: InstanceView, kv_bytes: int, now: float) -> list[MemOp]:
        # A load not yet started absorbs the new size (the ledger merges it); once the load is
        # running, the growth is a separate scale-up that runs after it.
        loading = inst.status is InstanceStatus.LOADING and inst.instance_id not in self._running_ops()
        kind = MemOpKind.LOAD if loading else MemOpKind.SCALE
        ok, ops = self.ledger.request(kind, inst.instance_id, inst.model.weight_bytes + kv_bytes, now)
        if ok:
            inst.kv_bytes = kv_bytes
        self._sync(now)
        return ops

    def hold(self, key: str, nbytes: int, now: float,
             load: float | None = None) -> tuple[bool, list[MemOp]]:
        """Hold `nbytes` on this node under `key` (0: release them) for something that is not an
        instance of the node: a layer replica of another node's instance (CoCoServe). The budget,
        pessimistic tracking and the reservation station account it like an instance's bytes;
        the ops returned are executed and completed (`memop_done`) like any other. `load`: the
        share of the node's compute it takes (`modules.stage_load`; None: as held so far), in
        the node's `stage_load` until it is released."""
        kind = MemOpKind.LOAD if nbytes else MemOpKind.UNLOAD
        ok, ops = self.ledger.request(kind, key, nbytes, now)
        if not nbytes:
            self._loads.pop(key, None)
        elif ok and load is not None:
            self._loads[key] = load
        self.node.stage_load = sum(self._loads.values())
        self._sync(now)
        return ok, ops

    def stage_measured(self, key: str, load: float) -> None:
        """The share of the node's compute the stage held under `key` took, as the node
        measured it (`busy.BusyMeter`): it replaces the planned figure in `stage_load`."""
        if key in self._loads:
            self._loads[key] = min(1.0, max(0.0, load))
            self.node.stage_load = sum(self._loads.values())

    def set_layout(self, instance_id: str, layout: InstanceLayout | None,
                   now: float) -> tuple[bool, list[MemOp]]:
        """CoCoServe: the instance's layers now run as `layout` says (None: all of them here).
        Its bytes on this node follow: its share's weights (`modules.layout_spec`) and its K/V
        pool per local layer (the block count is kept: moved layers take their pools along,
        rounded up so the engine keeps every block). Fewer local layers shrink its ledger entry
        (the op changes nothing on the engine, whose memory the move already freed); more
        (layers taken back) must fit the budget first, else False and nothing changes."""
        inst = self._instance(instance_id)
        full = inst.layout.model if inst.layout is not None else inst.model
        if full.layers <= 0:
            raise ValueError(f"{full.name} has no layer count: its layers cannot move")
        if layout is not None and layout.model != full:
            raise ValueError(f"a layout of {layout.model.name} for an instance of {full.name}")
        layout = layout if layout is not None and layout.runs else None
        before = inst.layout.local_layers() if inst.layout is not None else full.layers
        after = layout.local_layers() if layout is not None else full.layers
        if not 0 < after <= full.layers:
            raise ValueError(f"an instance keeps 1 to {full.layers} layers here, not {after}")
        spec = layout_spec(layout) if after < full.layers else full  # replicas move nothing off
        kv = kv_for_layers(inst.kv_bytes, before, after)
        ok, ops = self.ledger.request(MemOpKind.SCALE, instance_id, spec.weight_bytes + kv, now)
        if not ok:
            return False, []
        inst.model, inst.kv_bytes, inst.layout = spec, kv, layout
        self._sync(now)
        return True, ops

    # --- requests held out of the batches (live migration) ------------------------------------
    def park(self, instance_id: str, request_id: str) -> RequestView | None:
        """Take a request out of its instance's batches, its memory still counted: a live
        migration's destination before the commit, or its source while the commit is asked.
        The request's view (None: not on that instance), for `unpark` or `commit_parked`."""
        inst = self._find(instance_id)
        view = next((r for r in inst.requests if r.request_id == request_id), None) \
            if inst is not None else None
        if view is not None:
            inst.requests.remove(view)
        return view

    def unpark(self, instance_id: str, view: RequestView) -> bool:
        """A parked request goes back into its instance's batches as it was (False: the
        instance is gone)."""
        inst = self._find(instance_id)
        if inst is None:
            return False
        inst.requests.append(view)
        return True

    def commit_parked(self, instance_id: str, view: RequestView, generated: int,
                      now: float) -> bool:
        """A migrated request joins its instance's batches, prefilled, with `generated` output
        tokens (its KV computed here); False: the instance is gone."""
        inst = self._find(instance_id)
        if inst is None:
            return False
        view.generated, view.prefilled = generated, True
        inst.requests.append(view)
        inst.last_active = now
        return True

    def set_pipeline(self, instance_id: str, mode: PipelineMode | None) -> None:
        """The instance serves through the pipeline `mode` as it really formed (None: it runs
        every layer here); shadow validation then prices its requests with those hops."""
        inst = self._find(instance_id)
        if inst is not None and (mode is None or inst.pipeline is not None):
            inst.pipeline = mode

    # --- views and helpers ------------------------------------------------------------------
    def view(self) -> NodeView:
        """A snapshot for the placer (and for evaluate()): copies, safe to publish."""
        return replace(self.node, instances=copy_instances(self.node.instances))

    def kv_capacity_bytes(self, instance_id: str) -> int:
        """KV bytes the instance really holds now (what the engine was last resized to)."""
        inst = self._instance(instance_id)
        return max(0, self.ledger.allocated(instance_id) - inst.model.weight_bytes)

    def _kv_capacity_tokens(self, inst: InstanceView) -> int:
        """Whole blocks only: the engine rounds its pool down to blocks."""
        block_bytes = max(1, inst.model.kv_bytes_per_token) * inst.model.kv_block_tokens
        return self.kv_capacity_bytes(inst.instance_id) // block_bytes * inst.model.kv_block_tokens

    def _running_ops(self) -> set[str]:
        return {op.instance_id for op in self.ledger.running()}

    def _profile(self, inst: InstanceView):
        profile = instance_profile(self.perf, inst, self.node.hardware)
        if profile is None:
            raise KeyError(f"no profile for {inst.model.name} on {self.node.hardware.value}")
        return profile

    def _find(self, instance_id: str) -> InstanceView | None:
        return self.node.instance(instance_id)

    def _instance(self, instance_id: str) -> InstanceView:
        inst = self._find(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id}")
        return inst

    def _sync(self, now: float) -> None:
        self.node.budget_bytes = self.ledger.budget
        self.node.pessimistic_bytes = self.ledger.pessimistic
        self._refresh_timeline(now)

    def _refresh_timeline(self, now: float) -> None:
        """Put the memory ops into the timeline the shadow validation simulates
        (`readiness.memop_timeline`): an instance with an op running, parked or held behind, runs
        nothing until it ends; a live preemptor, nothing until its victims are gone."""
        def leaves_at(iid: str) -> float | None:
            inst = self._find(iid)
            return inst.leaves_at if inst is not None else None

        timeline = memop_timeline(self.ledger.running(), self.ledger.parked(), self._op_s,
                                  leaves_at, now)
        for inst in self.node.instances:
            if inst.instance_id in timeline.ends:
                inst.ready_at = max(timeline.ends[inst.instance_id], now)
        for iid, victims in self._waits_for.items():  # a preemptor waits for its handover
            inst = self._find(iid)
            if inst is not None:
                inst.ready_at = timeline.handover_ready_at(inst.ready_at, victims, now)
        self.node.memops_until = timeline.until
        self.node.parked_start = timeline.gate

    def _op_s(self, op: MemOp) -> float:
        """The op's duration, estimated once when first seen: for a load, its n/b plus the
        loads ahead of it on the node's I/O then (later it would count in its own queue)."""
        if op.op_id not in self._op_estimates and op.kind is MemOpKind.LOAD \
                and adapter_owner(op.instance_id) is not None:  # an adapter's: by its bytes
            queued = self.node.storage.pending_s if self.node.storage is not None else 0.0
            self._op_estimates[op.op_id] = queued + adapter_load_s(op.bytes_after - op.bytes_before)
        if op.op_id not in self._op_estimates:
            inst = self._find(op.instance_id)
            profile = self.perf.get(inst.model.name, self.node.hardware) if inst is not None else None
            if inst is None or profile is None:
                return UNLOAD_S
            load = load_seconds(self.node, inst.model, profile)
            if self.node.storage is not None:
                load += self.node.storage.pending_s
            self._op_estimates[op.op_id] = memop_seconds(op, profile, inst.model.weight_bytes, load)
        return self._op_estimates[op.op_id]


def copy_instances(instances: list[InstanceView]) -> list[InstanceView]:
    """Copies deep enough that changing requests on them leaves the originals untouched."""
    return [replace(i, requests=[replace(r) for r in i.requests], adapters=dict(i.adapters))
            for i in instances]


def new_node(node_id: str, hardware: Hardware, memory_bytes: int, perf: PerfModel,
             config: CoreConfig | None = None, matrix_accel: bool = False) -> NodeScheduler:
    node = NodeView(node_id, hardware, memory_bytes, matrix_accel=matrix_accel)
    return NodeScheduler(node, perf, config or CoreConfig())

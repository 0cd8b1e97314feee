"""Preemption on a node: smaller instances make room for a request that needs it (§VIII-A).

`preempt_and_admit` is one step the node re-checks first: the victims must still be strictly
smaller than the preemptor (`consolidation.preemption_victims`) and the request must pass on this
node without them (a trial admission on a copy of the node with the victims unloaded). Only then
does anything change, so a refusal leaves the victims untouched.

Two ways to free the victims:
- stop-and-resume: they are unloaded now and their requests come back (`evicted`) to be moved
  where the plan validated them;
- live (`handover_s`): their requests run on here while they migrate live (`migrating`). The
  victims take no new work; their bytes leave the optimistic budget but stay counted by
  pessimistic tracking (their unloads are held in the reservation station), and the preemptor
  runs nothing until they are gone (`NodeState.waits_for`). `finish_handover` unloads a victim
  once its requests have left.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from shared.core.admission import Admission, AdmitReason
from shared.core.consolidation import preemption_victims
from shared.core.prewarm import spare_instances
from shared.core.evaluate import handing_over
from shared.core.lora import admission_through
from shared.core.memory import MemOp, MemOpKind
from shared.core.node_adapters import InstanceAdapters
from shared.core.node_admission import AdmitResult, Admitter
from shared.core.node_memops import MemoryOps
from shared.core.node_state import NodeState
from shared.core.node_timeline import MemOpTimeline
from shared.core.readiness import handover_ready_at
from shared.core.types import AdapterSpec, InstanceStatus, ModelSpec, NodeView, RequestView


class Preemption:
    def __init__(self, state: NodeState, timeline: MemOpTimeline, memops: MemoryOps,
                 adapters: InstanceAdapters, admitter: Admitter) -> None:
        self.state = state
        self.timeline = timeline
        self.memops = memops
        self.adapters = adapters
        self.admitter = admitter

    def preempt_and_admit(self, victims: list[str], request: RequestView, instance_id: str | None,
                          model: ModelSpec, now: float, adapter: AdapterSpec | None = None,
                          handover_s: float | None = None) -> AdmitResult:
        """Proactive preemption as one re-checked step (see the module's docstring).
        `handover_s` (live preemption): the request must pass with the victims' work until then
        and its instance waiting for the handover."""
        state = self.state
        preemptor = state.find(instance_id) if instance_id is not None else None
        spare = spare_instances(state.node, now, state.config)
        allowed = {v.instance_id for v in preemption_victims(state.node, preemptor, spare)}
        if (instance_id is not None and preemptor is None) or not set(victims) <= allowed:
            return AdmitResult(Admission(AdmitReason.VICTIMS_CHANGED))
        if handover_s is not None:
            return self._preempt_live(victims, request, instance_id, model, now, adapter,
                                      handover_s)
        # The trial runs on a copy of the node with the victims unloaded: the admission that
        # follows sees their unloads run first, and every op that needs their memory (the
        # newcomer's growth or adapter, a load parked before) wait for them. A view with them
        # left out misses some of that, and the victims would be gone when it refuses.
        twin = copy.deepcopy(self, {id(state.perf): state.perf})
        twin.preempt(victims, now)
        admission = self._trial(twin.state.view(), instance_id, request, model, adapter, now)
        if not admission.ok:
            return AdmitResult(admission)
        evicted, unload_ops = self.preempt(victims, now)
        result = self.admitter.admit(request, instance_id, model, now, adapter)
        return replace(result, start_ops=(*unload_ops, *result.start_ops), evicted=tuple(evicted))

    def preempt(self, instance_ids: list[str], now: float) -> tuple[list[RequestView], list[MemOp]]:
        """Unload these instances; their requests come back for rescheduling elsewhere."""
        evicted: list[RequestView] = []
        ops: list[MemOp] = []
        for iid in instance_ids:
            inst = self.state.find(iid)
            if inst is None or inst.status is InstanceStatus.UNLOADING:
                continue
            evicted.extend(inst.requests)
            inst.requests = []
            ops.extend(self.memops.unload(inst, now))
        return evicted, ops

    def _trial(self, view: NodeView, instance_id: str | None, request: RequestView,
               model: ModelSpec, adapter: AdapterSpec | None, now: float,
               not_before: float | None = None) -> Admission:
        """What `admit` would answer on `view` (the node once the victims are gone), committing
        nothing: the same check, the same offloading of idle adapters on a memory refusal (the
        victims' are not on the view: they go with them)."""
        return admission_through(view, instance_id, request, model, adapter, self.state.perf, now,
                                 self.state.config, not_before)

    # --- live preemption ---------------------------------------------------------------------
    def _preempt_live(self, victims: list[str], request: RequestView, instance_id: str | None,
                      model: ModelSpec, now: float, adapter: AdapterSpec | None,
                      handover_s: float) -> AdmitResult:
        state = self.state
        if any(state.instance(v).status is not InstanceStatus.READY and state.instance(v).requests
               for v in victims):  # a loading victim's requests cannot move live (as planned)
            return AdmitResult(Admission(AdmitReason.VICTIMS_CHANGED))
        leaves_at = now + max(0.0, handover_s)
        running = state.node.running
        if running is not None and running.instance_id in victims:
            # The handover waits for a victim's iteration in flight (the node's lock).
            leaves_at = max(leaves_at, state.node.busy_until)
        # Their unloads also wait for their own ops under way (a victim still loading).
        ready = handover_ready_at(max([leaves_at, *(state.instance(v).ready_at for v in victims)]))
        trial = handing_over(state.view(), set(victims), leaves_at)
        admission = self._trial(trial, instance_id, request, model, adapter, now, ready)
        if not admission.ok:
            return AdmitResult(admission)
        targets = {v: state.ledger.target(v) for v in victims}
        ops = self._hand_over(victims, leaves_at, now)
        result = self.admitter.admit(request, instance_id, model, now, adapter, not_before=ready)
        if not result.admission.ok:  # cannot happen after the check above; undo, to be safe
            self._undo_handover(targets, now)
            return result
        state.waits_for[result.instance_id] = set(victims)
        self.timeline.refresh(now)
        moving = tuple(replace(r) for v in victims for r in state.instance(v).requests)
        return replace(result, start_ops=(*ops, *result.start_ops), migrating=moving)

    def _hand_over(self, victims: list[str], leaves_at: float, now: float) -> list[MemOp]:
        """The victims stop taking work; their memory leaves the optimistic budget (promised to
        the newcomer) but stays counted by pessimistic tracking: their unloads are held in the
        reservation station until `finish_handover`."""
        ops: list[MemOp] = []
        for iid in victims:
            inst = self.state.instance(iid)
            inst.status, inst.leaves_at = InstanceStatus.HANDOVER, leaves_at
            ops.extend(self.state.ledger.request(MemOpKind.UNLOAD, iid, 0, now, hold=True)[1])
        self.timeline.sync(now)
        return ops

    def _undo_handover(self, targets: dict[str, int], now: float) -> None:
        for iid, target in targets.items():
            inst = self.state.instance(iid)
            inst.status, inst.leaves_at = InstanceStatus.READY, 0.0
            self.state.ledger.request(MemOpKind.SCALE, iid, target, now)  # cancels the held unload
        self.timeline.sync(now)

    def handing_over(self) -> list[str]:
        """The victims of live preemptions whose requests are still moving."""
        return [i.instance_id for i in self.state.node.instances
                if i.status is InstanceStatus.HANDOVER]

    def finish_handover(self, instance_id: str,
                        now: float) -> tuple[list[RequestView], list[MemOp]]:
        """A victim's live migrations have ended: it is unloaded now. Requests still on it (a
        migration that was refused or failed) come back, to move stop-and-resume."""
        inst = self.state.find(instance_id)
        if inst is None or inst.status is not InstanceStatus.HANDOVER:
            return [], []
        left, inst.requests = inst.requests, []
        inst.status = InstanceStatus.UNLOADING
        ops = self.adapters.detach_all(inst, now)
        ops.extend(self.state.ledger.release(instance_id, now))
        self.timeline.sync(now)
        return left, ops

"""Admission commit on a node: the placer's decision re-checked against the node's own state,
then made real.

`admit` asks the same shadow validation the placer asked (`shared.core.lora.evaluate_through`,
on this node's current view), offloads idle adapters first where the answer is a memory refusal,
and only then changes the node: a new instance and its LOAD op, or the request joining an
existing instance with a KV scale-up if the admission asked for one, plus the LOAD op of an
adapter the instance does not hold yet. A refusal changes nothing, apart from adapters already
offloaded on the way (their UNLOAD ops come back in `start_ops`). `start_instance` starts an
instance with no request (a burst's extra instance).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.core.admission import Admission, AdmitReason
from shared.core.evaluate import evaluate
from shared.core.keepalive import instance_window
from shared.core.lora import evaluate_through
from shared.core.memory import MemOp, MemOpKind
from shared.core.node_adapters import InstanceAdapters
from shared.core.node_memops import MemoryOps
from shared.core.node_state import NodeState
from shared.core.node_timeline import MemOpTimeline
from shared.core.readiness import new_instance_view
from shared.core.types import AdapterSpec, InstanceStatus, InstanceView, ModelSpec, RequestView


@dataclass(frozen=True)
class AdmitResult:
    admission: Admission
    instance_id: str | None = None  # where the request now lives (a new id if created)
    start_ops: tuple[MemOp, ...] = ()  # memory operations to begin now (load or KV scale-up)
    evicted: tuple[RequestView, ...] = ()  # preempt-and-admit: the victims' requests, to move
    # Live preempt-and-admit: the victims' requests, still running here, to migrate live; each
    # victim is unloaded by `finish_handover` once its requests have gone.
    migrating: tuple[RequestView, ...] = ()


class Admitter:
    def __init__(self, state: NodeState, timeline: MemOpTimeline, memops: MemoryOps,
                 adapters: InstanceAdapters) -> None:
        self.state = state
        self.timeline = timeline
        self.memops = memops
        self.adapters = adapters

    def admit(self, request: RequestView, instance_id: str | None, model: ModelSpec,
              now: float, adapter: AdapterSpec | None = None,
              not_before: float | None = None) -> AdmitResult:
        """Re-check the placer's decision against this node's own state, then commit it.
        `adapter`: the LoRA adapter the request runs through on this backbone instance.
        `not_before`: the instance runs nothing before then (a live preemption's handover)."""
        state = self.state

        def check(freed: int = 0) -> Admission:
            """The admission with `freed` more bytes of idle adapters offloaded first."""
            return evaluate_through(state.view(), instance_id, request, model, adapter,
                                    state.perf, now, state.config, not_before, freed)

        admission = check()
        ops: list[MemOp] = []
        if admission.reason is AdmitReason.MEMORY:
            admission, ops = self.adapters.offload_for(check, adapter, now)
        if not admission.ok:
            return AdmitResult(admission, start_ops=tuple(ops))
        self.adapters.note_use(request.request_id, model.name, adapter, now)
        if instance_id is None:
            result = self._admit_new(request, model, admission, now, adapter)
            inst = state.instance(result.instance_id)
            return replace(result, start_ops=(*ops, *result.start_ops,
                                              *self.adapters.attach(inst, adapter, now)))
        inst = state.instance(instance_id)
        if admission.kv_target_bytes is not None:
            ops.extend(self.memops.resize(inst, admission.kv_target_bytes, now))
        ops.extend(self.adapters.attach(inst, adapter, now))
        inst.requests.append(_joining(request, admission, adapter))
        inst.last_active = now
        _keep_alive(inst, request, model)
        return AdmitResult(admission, instance_id, tuple(ops))

    def start_instance(self, like: RequestView, model: ModelSpec, now: float) -> AdmitResult:
        """Start an instance of `model` with no request yet (a burst's extra instance,
        `shared.core.burst`): checked and sized as a new instance for `like` would be, which
        stays with its own instance elsewhere; requests join this one by later placements."""
        state = self.state
        admission = evaluate(state.view(), None, like, model, state.perf, now, state.config)
        if not admission.ok:
            return AdmitResult(admission)
        return self._admit_new(None, model, admission, now)

    def _admit_new(self, request: RequestView | None, model: ModelSpec, admission: Admission,
                   now: float, adapter: AdapterSpec | None = None) -> AdmitResult:
        node = self.state.node
        iid = self.state.new_instance_id(model)
        kv = admission.kv_target_bytes or 0
        inst = InstanceView(iid, model, node.node_id, InstanceStatus.LOADING, kv_bytes=kv,
                            ready_at=now, last_active=now,  # through a pipeline: the startup's
                            pipeline=new_instance_view(node, model, now).pipeline)
        if request is not None:
            inst.requests.append(_joining(request, admission, adapter))
        _keep_alive(inst, request, model)
        node.instances.append(inst)
        ok, ops = self.state.ledger.request(MemOpKind.LOAD, iid, model.weight_bytes + kv, now)
        assert ok, "evaluate() approved the budget"
        self.timeline.sync(now)
        return AdmitResult(admission, iid, tuple(ops))


def _keep_alive(inst: InstanceView, request: RequestView | None, model: ModelSpec) -> None:
    """The instance's keep-alive after an admission (`shared.core.keepalive`): the request's
    own, else its model's as registered now; pinned while its model asks for warm instances."""
    inst.keep_alive_s = instance_window(request.keep_alive_s if request else None,
                                        model.keep_alive_s)
    inst.pinned = model.min_instances > 0


def _joining(request: RequestView, admission: Admission,
             adapter: AdapterSpec | None) -> RequestView:
    """The request as its instance holds it: with its cold-start grace and, where it runs
    through an adapter, the adapter's name (its batch's LoRA cost counts distinct adapters)."""
    name = adapter.name if adapter is not None else request.adapter
    return replace(request, grace_s=admission.grace_s, adapter=name)

"""LoRA adapters on a node's backbone instances (ServerlessLoRA §4.1, §4.3, §4.4).

A request that runs through an adapter is admitted to an instance of its backbone; where the
instance does not hold the adapter yet, `attach` gives the adapter its own entry in the memory
ledger (`types.adapter_key`) and its own LOAD op, which the node executes like any other memory op.
The instance runs nothing while one of its adapters loads (`NodeState.adapters_busy`); the
admission was validated with that wait (`shared.core.lora.evaluate_through`).

This part also keeps what offloading and pre-loading weigh adapters by: which adapter each request
runs through and the invocation rates of models and adapters on this node. Under memory pressure
idle adapters are offloaded, least valuable first (`offload_for`); a pre-loaded adapter is attached
only where the node has room and the instance's requests can wait for its load (`preload`).
"""

from __future__ import annotations

from collections.abc import Callable

from shared.core.admission import Admission, AdmitReason
from shared.core.evaluate import may_hold
from shared.core.lora import Artifact, adapter_load_s, adapter_ready_at, offload_order
from shared.core.memory import MemOp, MemOpKind
from shared.core.node_state import NodeState
from shared.core.node_timeline import MemOpTimeline
from shared.core.types import AdapterSpec, InstanceStatus, InstanceView, adapter_key, adapter_owner


class InstanceAdapters:
    def __init__(self, state: NodeState, timeline: MemOpTimeline) -> None:
        self.state = state
        self.timeline = timeline

    # --- attaching and detaching ----------------------------------------------------------------
    def attach(self, inst: InstanceView, adapter: AdapterSpec | None, now: float) -> list[MemOp]:
        """Load `adapter` onto `inst` (nothing if there is none or it is there already); the
        caller has checked the budget with its bytes."""
        if adapter is None or adapter.name in inst.adapters:
            return []
        ok, ops = self.state.ledger.request(MemOpKind.LOAD,
                                            adapter_key(inst.instance_id, adapter.name),
                                            adapter.bytes, now)
        assert ok, "admit() checked the budget with the adapter's bytes"
        inst.adapters[adapter.name] = adapter.bytes
        self.timeline.sync(now)
        return ops

    def detach(self, instance_id: str, adapter: str, now: float) -> list[MemOp]:
        """Unload an adapter from a backbone instance (offloading, §4.3): its bytes leave the
        budget; the UNLOAD op (and anything it releases) is returned to execute. The caller
        makes sure no request still runs through it."""
        inst = self.state.find(instance_id)
        if inst is None or adapter not in inst.adapters:
            return []
        del inst.adapters[adapter]
        _, ops = self.state.ledger.request(MemOpKind.UNLOAD, adapter_key(instance_id, adapter),
                                           0, now)
        self.timeline.sync(now)
        return ops

    def detach_all(self, inst: InstanceView, now: float) -> list[MemOp]:
        """The instance leaves: its adapters go with it."""
        ops: list[MemOp] = []
        for adapter in list(inst.adapters):
            ops.extend(self.detach(inst.instance_id, adapter, now))
        return ops

    def preload(self, instance_id: str, adapter: AdapterSpec, now: float) -> list[MemOp]:
        """Attach an adapter to a ready backbone instance before any request asks for it
        (pre-loading, §4.1), if the node's budget has room for it now: its LOAD op, or nothing.
        Under pressure it is offloaded like any idle adapter (§4.3)."""
        state = self.state
        inst = state.find(instance_id)
        if inst is None or inst.status is not InstanceStatus.READY or adapter.name in inst.adapters:
            return []
        if state.ledger.budget + adapter.bytes > state.ledger.capacity:
            return []
        # Its load holds the instance up: only where the requests running there can wait for it.
        until = adapter_ready_at(state.node, adapter.bytes, now)
        if not may_hold(state.view(), instance_id, until, state.perf, now, state.config):
            return []
        return self.attach(inst, adapter, now)

    # --- use and invocation rates ----------------------------------------------------------------
    def note_use(self, request_id: str, model: str, adapter: AdapterSpec | None,
                 now: float) -> None:
        """An admission: the request's adapter (for `offloadable`) and the call (for `rate`)."""
        state = self.state
        if adapter is not None:
            live = {r.request_id for i in state.node.instances for r in i.requests}
            state.adapter_of = {rid: a for rid, a in state.adapter_of.items() if rid in live}
            state.adapter_of[request_id] = adapter.name
        state.rates.note(model, adapter.name if adapter is not None else None, now)

    def rate(self, name: str, now: float) -> float:
        """Invocations per second of a model (its adapters' calls included) or an adapter on
        this node: its recent admissions over the time they span (to now), so it falls while
        nothing calls it; 0 for one never admitted here."""
        return self.state.rates.rate(name, now)

    def called(self) -> list[str]:
        """Every model and adapter admitted here (the ones with a rate)."""
        return self.state.rates.called()

    # --- dynamic offloading (§4.3) ---------------------------------------------------------------
    def offloadable(self, now: float, keep: str | None = None) -> list[tuple[str, str, int]]:
        """Attached adapters without a request in flight, least valuable first (`offload_order`:
        value = load time saved x invocation rate, per byte): (instance, adapter, bytes)."""
        busy: set[str] = set()
        artifacts: list[Artifact] = []
        for inst in self.state.node.instances:
            running = {self.state.adapter_of.get(r.request_id) for r in inst.requests}
            for name, nbytes in inst.adapters.items():
                key = adapter_key(inst.instance_id, name)
                if name in running or name == keep:
                    busy.add(key)
                artifacts.append(Artifact(key, nbytes, adapter_load_s(nbytes),
                                          self.rate(name, now), inst.instance_id))
        order = offload_order(artifacts, busy)
        sizes = {a.name: a.bytes for a in artifacts}
        return [(*adapter_owner(key), sizes[key]) for key in order]

    def offload_for(self, check: Callable[[int], Admission], adapter: AdapterSpec | None,
                    now: float) -> tuple[Admission, list[MemOp]]:
        """A memory refusal: offload idle adapters, least valuable first, until the admission
        (`check(freed)`, freed: bytes offloaded beyond what the ledger shows) passes; nothing is
        offloaded when even all of them would not make it pass."""
        candidates = self.offloadable(now, keep=adapter.name if adapter else None)
        if not candidates or not check(sum(c[2] for c in candidates)).ok:
            return Admission(AdmitReason.MEMORY), []
        ops: list[MemOp] = []
        admission = Admission(AdmitReason.MEMORY)
        for iid, name, _ in candidates:
            ops.extend(self.detach(iid, name, now))
            admission = check(0)
            if admission.ok:
                break
        return admission, ops

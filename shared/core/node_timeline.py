"""The memory-op timeline of one node: when each instance can run again, given its memory ops.

Shadow validation (`shared.core.evaluate`) simulates a node's near future from its view, so the
view must say when every instance is free: an instance with a load, resize or adapter op running,
parked or held behind another, runs nothing until that op ends, and a live preemptor nothing until
its victims are gone. `sync` writes the ledger's budget and that timeline into the node's view;
every part calls it after it changes the ledger. Op durations are estimated once, when an op is
first seen, and kept until it completes.
"""

from __future__ import annotations

from shared.core.lora import adapter_load_s
from shared.core.memory import UNLOAD_S, MemOp, MemOpKind, memop_seconds
from shared.core.node_state import NodeState
from shared.core.readiness import load_seconds, memop_timeline
from shared.core.types import adapter_owner


class MemOpTimeline:
    def __init__(self, state: NodeState) -> None:
        self.state = state

    def sync(self, now: float) -> None:
        node, ledger = self.state.node, self.state.ledger
        node.budget_bytes = ledger.budget
        node.pessimistic_bytes = ledger.pessimistic
        self.refresh(now)

    def refresh(self, now: float) -> None:
        """Put the memory ops into the timeline the shadow validation simulates
        (`readiness.memop_timeline`): an instance with an op running, parked or held behind, runs
        nothing until it ends; a live preemptor, nothing until its victims are gone."""
        state = self.state

        def leaves_at(iid: str) -> float | None:
            inst = state.find(iid)
            return inst.leaves_at if inst is not None else None

        timeline = memop_timeline(state.ledger.running(), state.ledger.parked(), self.op_seconds,
                                  leaves_at, now)
        for inst in state.node.instances:
            if inst.instance_id in timeline.ends:
                inst.ready_at = max(timeline.ends[inst.instance_id], now)
        for iid, victims in state.waits_for.items():  # a preemptor waits for its handover
            inst = state.find(iid)
            if inst is not None:
                inst.ready_at = timeline.handover_ready_at(inst.ready_at, victims, now)
        state.node.memops_until = timeline.until
        state.node.parked_start = timeline.gate

    def op_seconds(self, op: MemOp) -> float:
        """The op's duration, estimated once when first seen: for a load, its n/b plus the
        loads ahead of it on the node's I/O then (later it would count in its own queue)."""
        state, node = self.state, self.state.node
        estimates = state.op_estimates
        if op.op_id not in estimates and op.kind is MemOpKind.LOAD \
                and adapter_owner(op.instance_id) is not None:  # an adapter's: by its bytes
            queued = node.storage.pending_s if node.storage is not None else 0.0
            estimates[op.op_id] = queued + adapter_load_s(op.bytes_after - op.bytes_before)
        if op.op_id not in estimates:
            inst = state.find(op.instance_id)
            profile = state.perf.get(inst.model.name, node.hardware) if inst is not None else None
            if inst is None or profile is None:
                return UNLOAD_S
            load = load_seconds(node, inst.model, profile)
            if node.storage is not None:
                load += node.storage.pending_s
            estimates[op.op_id] = memop_seconds(op, profile, inst.model.weight_bytes, load)
        return estimates[op.op_id]

    def forget(self, op: MemOp) -> None:
        """The op completed: its estimate is no longer needed."""
        self.state.op_estimates.pop(op.op_id, None)

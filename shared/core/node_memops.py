"""A node's memory ops: resizing and unloading instances, holding bytes for others, and what
happens when an op completes (SLINFER §VII, the memory subsystem).

Every change is asked of the memory ledger (`shared.core.memory.MemoryLedger`), which approves
it against the budget and orders it in the reservation station: the ops it returns are the ones
the node starts now; the rest start when `memop_done` releases them. After each change the node's
view is synced with the ledger (`node_timeline`). Unloading an instance detaches its adapters
(`node_adapters`) and, once its memory is free, lets a live preemptor that waited for it run.
"""

from __future__ import annotations

from shared.core.consolidation import idle_instances
from shared.core.keepalive import expires_at, is_idle
from shared.core.memory import MemOp, MemOpKind
from shared.core.node_adapters import InstanceAdapters
from shared.core.node_state import NodeState
from shared.core.node_timeline import MemOpTimeline
from shared.core.readiness import op_owner
from shared.core.types import InstanceStatus, InstanceView


class MemoryOps:
    def __init__(self, state: NodeState, timeline: MemOpTimeline,
                 adapters: InstanceAdapters) -> None:
        self.state = state
        self.timeline = timeline
        self.adapters = adapters

    def resize(self, inst: InstanceView, kv_bytes: int, now: float) -> list[MemOp]:
        """Ask for the instance's KV pool at `kv_bytes` (its weights stay)."""
        ledger = self.state.ledger
        # A load not yet started absorbs the new size (the ledger merges it); once the load is
        # running, the growth is a separate scale-up that runs after it.
        loading = inst.status is InstanceStatus.LOADING \
            and inst.instance_id not in self.state.running_ops()
        kind = MemOpKind.LOAD if loading else MemOpKind.SCALE
        ok, ops = ledger.request(kind, inst.instance_id, inst.model.weight_bytes + kv_bytes, now)
        if ok:
            inst.kv_bytes = kv_bytes
        self.timeline.sync(now)
        return ops

    def unload(self, inst: InstanceView, now: float) -> list[MemOp]:
        """The instance leaves the node, its adapters with it."""
        state = self.state
        inst.status = InstanceStatus.UNLOADING
        ops = self.adapters.detach_all(inst, now)
        ops.extend(state.ledger.request(MemOpKind.UNLOAD, inst.instance_id, 0, now)[1])
        if state.ledger.target(inst.instance_id) == 0 and not state.ledger.busy(inst.instance_id):
            # a load that never started was cancelled outright: nothing to execute
            self._drop(inst.instance_id)
        self.timeline.sync(now)
        return ops

    def hold(self, key: str, nbytes: int, now: float,
             load: float | None = None) -> tuple[bool, list[MemOp]]:
        """Hold `nbytes` on this node under `key` (0: release them) for something that is not an
        instance of the node: a layer replica of another node's instance (CoCoServe). The budget,
        pessimistic tracking and the reservation station account it like an instance's bytes;
        the ops returned are executed and completed (`memop_done`) like any other. `load`: the
        share of the node's compute it takes (`modules.stage_load`; None: as held so far), in
        the node's `stage_load` until it is released."""
        state = self.state
        kind = MemOpKind.LOAD if nbytes else MemOpKind.UNLOAD
        ok, ops = state.ledger.request(kind, key, nbytes, now)
        if not nbytes:
            state.loads.pop(key, None)
        elif ok and load is not None:
            state.loads[key] = load
        state.publish_stage_load()
        self.timeline.sync(now)
        return ok, ops

    def memop_done(self, op: MemOp, now: float) -> list[MemOp]:
        """A memory op completed (reservation-station stream): release what is now safe."""
        state = self.state
        started = state.ledger.complete(op.instance_id, op.op_id, now)
        self.timeline.forget(op)
        inst = state.find(op.instance_id)
        if inst is not None and op.kind is MemOpKind.LOAD and inst.status is InstanceStatus.LOADING:
            inst.status = InstanceStatus.READY
            if not inst.requests:  # (a burst's instance, started empty): its keep-alive counts
                inst.last_active = now  # from when it can serve, not from its admission
        owner = state.find(op_owner(op.instance_id))  # the instance, also for an adapter's op
        if owner is not None and not state.ledger.busy(owner.instance_id) and \
                owner.instance_id not in state.adapters_busy():
            owner.ready_at = min(owner.ready_at, now)  # free to run now, however long we guessed
        if op.kind is MemOpKind.UNLOAD and state.ledger.target(op.instance_id) == 0:
            self._drop(op.instance_id)
            self._handed_over(op.instance_id, now)
        self.timeline.sync(now)
        return started

    def _drop(self, instance_id: str) -> None:
        node = self.state.node
        node.instances = [i for i in node.instances if i.instance_id != instance_id]

    def _handed_over(self, victim: str, now: float) -> None:
        """A victim is unloaded: a preemptor that waited for it alone may run now."""
        state = self.state
        for iid in list(state.waits_for):
            state.waits_for[iid].discard(victim)
            if state.waits_for[iid]:
                continue
            del state.waits_for[iid]
            inst = state.find(iid)
            if inst is not None and not state.ledger.busy(iid):
                inst.ready_at = min(inst.ready_at, now)

    # --- keep-alive --------------------------------------------------------------------------
    def reclaim_idle(self, now: float) -> list[MemOp]:
        """Unload the instances idle for longer than their keep-alive (`shared.core.keepalive`)."""
        state = self.state
        ops: list[MemOp] = []
        for inst in idle_instances(state.node, now, state.config.keep_alive_s):
            if not state.ledger.busy(inst.instance_id):
                ops.extend(self.unload(inst, now))
        return ops

    def next_reclaim_at(self) -> float | None:
        """When the next idle instance's keep-alive expires (None: no idle instance waits for
        one). An idle instance with a memory op in flight is not counted: that op's completion
        is the next event that matters for it."""
        state = self.state
        times = [expires_at(i, state.config.keep_alive_s) for i in state.node.instances
                 if is_idle(i) and not state.ledger.busy(i.instance_id)]
        return min((t for t in times if t is not None), default=None)

    def unload_model(self, model: str, now: float) -> list[MemOp]:
        """Unload every instance of `model` now (the admin's unload): the idle ones at once,
        the busy and loading ones as soon as they are idle (their window becomes 0, unpinned;
        a request admitted later sets both again, from its keep_alive and its model's record)."""
        for inst in self.state.node.instances:
            if inst.model.name == model and inst.accepts:
                inst.keep_alive_s, inst.pinned = 0.0, False
        return self.reclaim_idle(now)

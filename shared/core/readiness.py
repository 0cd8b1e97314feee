"""When an instance can run: the one answer the admission, the node's timeline, placement and
startup ask (issue 22, "one answer per question").

An instance runs nothing before its `InstanceView.ready_at`. What pushes that later, and where
it is answered here:
- a cold start: the loads queued on the node's I/O, a wait for memory when the reservation
  station would park the load, then the load itself, from the fastest tier holding the model or
  from a multicast on its way, or until an execution pipeline serves (`load_seconds`,
  `arrived_load_s`, `cold_start_ready_at`, `new_instance_view`);
- a live migration's destination: after the iteration in flight and its own wait
  (`first_run_at`);
- a KV resize a join needs: after what the instance already waits for, and after the memory ops
  under way when pessimistic tracking would park it (a live preemption's victims still held, a
  running unload or scale-down) (`growth_ready_at`, `blocked_while_growing`);
- a live preemption's handover: the victims have moved and been unloaded (`handover_ready_at`);
- the node's own memory ops, running, parked or held, adapters' ops included (`memop_timeline`,
  which `NodeScheduler` writes into its instances' `ready_at` and `memops_until`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from shared.core.admission import Admission
from shared.core.memory import UNLOAD_S, MemOp
from shared.core.perf_model import Profile
from shared.core.types import (InstanceStatus, InstanceView, ModelSpec, NodeView, RequestView,
                               adapter_owner)

NEW_INSTANCE_ID = "<new>"


def load_seconds(node: NodeView, model: ModelSpec, profile: Profile) -> float:
    """How long the load of `model` itself takes on `node` (the n/b of ServerlessLLM's startup
    time q + n/b, §6): its weights over the bandwidth of the fastest tier holding its checkpoint
    there (the registry if none does), plus the engine's own start-up. A node that reports no
    tiers, or a model its engine loads by itself (`ModelSpec.tiered`): the load time its profile
    measured. A model on its way to the node's DRAM tier by multicast (`StorageView.arriving`)
    counts as there once it arrives. This is a cold start's TTFT grace (§IX-A)."""
    storage = node.storage
    if storage is None or not model.tiered:
        return profile.load_s
    bandwidth = storage.bytes_per_s.get(storage.holds.get(model.name, "registry"), 0.0)
    own = model.weight_bytes / bandwidth + profile.engine_init_s if bandwidth > 0 else profile.load_s
    dram = storage.bytes_per_s.get("dram", 0.0)
    if model.name in storage.pipelines:  # it serves through a pipeline before it is whole
        own = min(own, storage.pipelines[model.name].until)
    if model.name in storage.arriving and dram > 0:  # a multicast brings it to the DRAM tier
        return min(own, arrived_load_s(model, storage.arriving[model.name], dram, profile))
    return own


def arrived_load_s(model: ModelSpec, arrive_s: float, dram_bytes_per_s: float,
                   profile: Profile) -> float:
    """A load of `model` from the DRAM tier once a multicast lands it there in `arrive_s`
    (λScale): the arrival, the read from DRAM, the engine's start-up."""
    return arrive_s + model.weight_bytes / dram_bytes_per_s + profile.engine_init_s


def new_instance_view(node: NodeView, model: ModelSpec, now: float) -> InstanceView:
    """A not-yet-loaded instance, for validation only (its `ready_at` is set once its KV size,
    and so its load, is known: see `cold_start_ready_at`). One that will serve through a
    pipeline (`StorageView.pipelines`) is validated with the pipeline's cost until its switch."""
    storage = node.storage
    mode = storage.pipelines.get(model.name) if storage is not None else None
    if mode is not None:
        mode = replace(mode, until=now + storage.arriving.get(model.name, mode.until))
    return InstanceView(NEW_INSTANCE_ID, model, node.node_id, InstanceStatus.LOADING,
                        kv_bytes=0, ready_at=now, last_active=now, pipeline=mode)


def parks(node: NodeView, grow_bytes: int) -> bool:
    """Would the reservation station park an op that adds `grow_bytes` on `node` now? Pessimistic
    tracking counts what is held: a running op at its larger size, a held unload in full."""
    return node.pessimistic_bytes + grow_bytes > node.memory_bytes


def cold_start_ready_at(node: NodeView, load_bytes: int, load_s: float, now: float) -> float:
    """When a new instance could run its first iteration: its load starts after the loads ahead
    of it on the node's I/O (q), and, if pessimistic tracking would park it in the reservation
    station, not before the memory ops under way have ended; then it takes `load_s`."""
    start = now + (node.storage.pending_s if node.storage is not None else 0.0)
    if parks(node, load_bytes):  # conservatively after every op, parked ones too (as before;
        start = max(start, node.memops_until)  # a join's growth waits for `parked_start` only)
    return start + load_s


def growth_ready_at(node: NodeView, inst: InstanceView, kv_bytes: int, profile: Profile,
                    now: float) -> float:
    """When `inst` can run again once its KV pool grows to `kv_bytes`: the resize runs after
    what the instance already waits for and, where pessimistic tracking parks it (memory still
    held by a handover's victims, a running unload or scale-down), not before the memory ops
    under way have ended, as the node's reservation station will run it."""
    start = max(inst.ready_at, now)
    if parks(node, kv_bytes - inst.kv_bytes):
        start = max(start, node.parked_start)
    return start + profile.kv_scale_s(inst.kv_bytes, kv_bytes)


def first_run_at(node: NodeView, inst: InstanceView | None, now: float) -> float:
    """The earliest a node can run an iteration of `inst` (None: an instance not there yet):
    after the iteration in flight and after what holds the instance (the rest of a load, a
    resize, a handover)."""
    return max(now, node.busy_until, inst.ready_at if inst is not None else now)


def join_grace(request: RequestView, target: InstanceView, now: float) -> float:
    """§IX-A: a request that waits for a cold start has the wait as TTFT grace, also when it
    joins an instance that is still loading (what is left of the load)."""
    if target.status is InstanceStatus.LOADING and target.ready_at > now:
        return max(request.grace_s, target.ready_at - now)
    return request.grace_s


def blocked_while_growing(node: NodeView, instances: list[InstanceView], target: InstanceView,
                          memory: Admission, profile: Profile, now: float) -> list[InstanceView]:
    """A join that grows the instance's KV pool blocks it until the resize is done
    (`growth_ready_at`), as the node's timeline will; meanwhile the node runs its other
    instances, whose long prefills the newcomer's first token then waits behind."""
    kv = memory.kv_target_bytes
    if kv is None or kv <= target.kv_bytes:
        return instances
    ready = growth_ready_at(node, target, kv, profile, now)
    return [replace(inst, ready_at=ready) if inst is target else inst for inst in instances]


def handover_ready_at(leaves_at: float) -> float:
    """When a live preemption's newcomer can run: the victims have moved and been unloaded."""
    return leaves_at + UNLOAD_S


def op_owner(key: str) -> str:
    """The instance a memory op's key belongs to (its own, or the one its adapter is on)."""
    owner = adapter_owner(key)
    return key if owner is None else owner[0]


@dataclass(frozen=True)
class MemopTimeline:
    """When a node's memory ops should end, as the shadow validation's timeline needs it."""

    ends: dict[str, float]  # instance -> end of its running or parked ops (its adapters' too)
    held: dict[str, float]  # a held unload's instance (a live victim) -> when it should end
    until: float  # when every op running, parked or held should have ended (`memops_until`)
    gate: float  # when an op parked now could start (`NodeView.parked_start`)

    def handover_ready_at(self, ready_at: float, victims: set[str], now: float) -> float:
        """A live preemptor's instance runs nothing before its victims are gone: after their
        held unloads and after any op of theirs still under way (an adapter loading onto a
        victim ends long before its handover, and must not stand in for it)."""
        return max([ready_at, now, *(max(self.ends.get(v, now), self.held.get(v, now))
                                     for v in victims)])


def memop_timeline(running: list[MemOp], parked: list[MemOp], op_s: Callable[[MemOp], float],
                   leaves_at: Callable[[str], float | None], now: float) -> MemopTimeline:
    """The node's memory ops on its timeline: an instance with a load or resize running, or
    parked in the reservation station, runs nothing until that op ends. A parked op starts once
    the ops under way have ended (conservatively all of them: pessimistic tracking releases it
    on some completion), and the unloads and scale-downs parked behind them. A held unload (a
    live preemption's victim) ends once its requests have moved, about at its `leaves_at`;
    every parked op waits for it too (its memory is counted until then). `op_s`: an op's
    estimated duration; `leaves_at`: a victim's (None: gone)."""
    running_end = max((op.started_at + op_s(op) for op in running if op.started_at is not None),
                      default=now)
    ends: dict[str, float] = {}
    for op in running:
        if op.started_at is not None:  # an adapter's op holds up its instance
            key = op_owner(op.instance_id)
            ends[key] = max(ends.get(key, now), op.started_at + op_s(op))
    run_ends = {op.instance_id: op.started_at + op_s(op) for op in running
                if op.started_at is not None}
    held: dict[str, float] = {}
    for op in parked:
        if op.held:  # after its handover, and after the victim's own op under way (a load)
            leaves = leaves_at(op.instance_id)
            held[op.instance_id] = max(leaves if leaves is not None else now, now,
                                       run_ends.get(op.instance_id, now)) + UNLOAD_S
    # An unload or scale-down parked behind its own key's running op (an adapter's unload
    # behind its load) frees memory only once it has run: what waits for memory waits for it.
    releases = [max(run_ends.get(op.instance_id, now), now) + op_s(op) for op in parked
                if not op.held and not op.grows]
    gate = max([running_end, *held.values(), *releases])
    for op in parked:
        if not op.held:
            key = op_owner(op.instance_id)
            ends[key] = max(ends.get(key, now), gate) + op_s(op)
    return MemopTimeline(ends, held, max([now, *ends.values(), *held.values()]), gate)

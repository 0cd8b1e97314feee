"""Hazard-aware memory subsystem (SLINFER §VII).

- `m_require`: eq. 2, the KV bytes an instance needs if all its requests peak together.
- `watermark_target`: early scale-up to M_require*(1+w), lazy scale-down (§VII-B).
- `MemoryLedger`: the optimistic budget that approves operations, the pessimistic tracker that
  decides when they may run, and the reservation station that parks unsafe scale-ups until
  completions make them safe (§VII-C, Fig. 19).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from shared.core.perf_model import Profile

UNLOAD_S = 0.05  # freeing an instance's memory (ASSUMPTION: tens of milliseconds)


def watermark_target(m_cur: int, m_req: int, w: float) -> int | None:
    """The KV size to scale to, or None to stay.

    Scale up when the cache is insufficient (M_cur < M_require), straight to M_recommend;
    scale down only once M_recommend*(1+w) < M_cur, so a steady load never ping-pongs.
    """
    m_rec = int(m_req * (1 + w))
    if m_cur < m_req:
        return m_rec
    if int(m_rec * (1 + w)) < m_cur:
        return m_rec
    return None


class MemOpKind(str, enum.Enum):
    LOAD = "load"
    UNLOAD = "unload"
    SCALE = "scale"


@dataclass(frozen=True)
class MemOp:
    op_id: int
    kind: MemOpKind
    instance_id: str
    bytes_before: int  # instance's total bytes (weights + KV) before the op
    bytes_after: int  # ... and after
    issued_at: float  # when the ledger accepted it (parked time = start - issued)
    started_at: float | None = None  # when it left the reservation station (None: parked)
    # Held in the reservation station until released (`MemoryLedger.release`): a live
    # preemption's victim keeps its memory, counted in full, until its requests have moved.
    held: bool = False

    @property
    def grows(self) -> bool:
        return self.bytes_after > self.bytes_before


def memop_seconds(op: MemOp, profile: Profile, weight_bytes: int,
                  load_s: float | None = None) -> float:
    """How long an op takes: a load (weights and the first KV pool: `load_s`, the node's own
    startup estimate, else the profile's), a KV resize (Fig. 17's cost model) or an unload. The
    node's timeline and the simulator's engines both use this estimate."""
    if op.kind is MemOpKind.UNLOAD:
        return UNLOAD_S
    if op.kind is MemOpKind.LOAD:
        return profile.load_s if load_s is None else load_s
    return profile.kv_scale_s(op.bytes_before - weight_bytes, op.bytes_after - weight_bytes)


class MemoryLedger:
    """Per-node memory accounting. Pure: time comes in, operations to start go out.

    For each instance:
      alloc  - bytes it really holds now (changes only when an op completes)
      target - bytes once every accepted op has run (the optimistic view)
    budget      = sum(target)                    approves scale-ups (never above capacity)
    pessimistic = sum(held), held = alloc, or max(before, after) while an op runs
                                                 decides when an op may start
    Ops of one instance run one at a time in order; a not-yet-started op absorbs later demands
    for the same instance, so at quiescence every parked op is startable (liveness).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity_bytes
        self._alloc: dict[str, int] = {}
        self._target: dict[str, int] = {}
        self._running: dict[str, MemOp] = {}  # instance -> its running op
        self._waiting: list[MemOp] = []  # issue order; includes parked ops
        self._next_id = 1

    # --- views ------------------------------------------------------------------------------
    @property
    def budget(self) -> int:
        return sum(self._target.values())

    @property
    def pessimistic(self) -> int:
        return sum(self._held(i) for i in self._alloc)

    def _held(self, instance_id: str) -> int:
        op = self._running.get(instance_id)
        alloc = self._alloc.get(instance_id, 0)
        return max(op.bytes_before, op.bytes_after) if op else alloc

    def allocated(self, instance_id: str) -> int:
        """Bytes the instance really holds (its last completed op)."""
        return self._alloc.get(instance_id, 0)

    def target(self, instance_id: str) -> int:
        return self._target.get(instance_id, 0)

    def parked(self) -> list[MemOp]:
        return list(self._waiting)

    def running(self) -> list[MemOp]:
        return list(self._running.values())

    def busy(self, instance_id: str) -> bool:
        return instance_id in self._running or any(o.instance_id == instance_id for o in self._waiting)

    def fits(self, instance_id: str, new_bytes: int) -> bool:
        """Would the optimistic budget approve resizing this instance to new_bytes?"""
        return self.budget - self.target(instance_id) + new_bytes <= self.capacity

    # --- transitions ----------------------------------------------------------------------------
    def request(self, kind: MemOpKind, instance_id: str, new_bytes: int,
                now: float, hold: bool = False) -> tuple[bool, list[MemOp]]:
        """Ask to move an instance to new_bytes. Returns (approved, ops that start now).
        `hold`: the op waits, whatever memory allows, until `release` (its budget changes now)."""
        if new_bytes < 0:
            raise ValueError("new_bytes must be >= 0")
        old_target = self.target(instance_id)
        if new_bytes > old_target and not self.fits(instance_id, new_bytes):
            return False, []
        if new_bytes == old_target:
            return True, []
        self._alloc.setdefault(instance_id, 0)
        self._target[instance_id] = new_bytes
        self._enqueue(kind, instance_id, old_target, new_bytes, now, hold)
        return True, self._dispatch(now)

    def release(self, instance_id: str, now: float) -> list[MemOp]:
        """Let an instance's held op go (it starts as soon as it is safe). Returns ops that start."""
        self._waiting = [replace(o, held=False) if o.instance_id == instance_id else o
                         for o in self._waiting]
        return self._dispatch(now)

    def complete(self, instance_id: str, op_id: int, now: float) -> list[MemOp]:
        """An op finished: its bytes are real now. Returns parked ops that may start."""
        op = self._running.get(instance_id)
        if op is None or op.op_id != op_id:
            raise KeyError(f"op {op_id} of {instance_id} is not running")
        del self._running[instance_id]
        self._alloc[instance_id] = op.bytes_after
        if op.bytes_after == 0 and self._target.get(instance_id) == 0 and not self.busy(instance_id):
            self._alloc.pop(instance_id, None)
            self._target.pop(instance_id, None)
        return self._dispatch(now)

    def _enqueue(self, kind: MemOpKind, instance_id: str, before: int, after: int, now: float,
                 hold: bool = False) -> None:
        pending = next((o for o in self._waiting if o.instance_id == instance_id), None)
        if pending is not None:  # not started yet: fold the new demand into it
            self._waiting.remove(pending)
            if pending.bytes_before != after:
                merged_kind = kind if kind is MemOpKind.UNLOAD else pending.kind
                self._waiting.append(replace(pending, kind=merged_kind, bytes_after=after,
                                             held=pending.held or hold))
            elif instance_id not in self._running and self._alloc.get(instance_id, 0) == 0:
                self._alloc.pop(instance_id, None)  # a load cancelled before it started
                self._target.pop(instance_id, None)
            return
        self._waiting.append(MemOp(self._next_id, kind, instance_id, before, after, now, held=hold))
        self._next_id += 1

    def _dispatch(self, now: float) -> list[MemOp]:
        """Start every waiting op that is safe under pessimistic tracking, in issue order."""
        started: list[MemOp] = []
        for op in list(self._waiting):
            if op.instance_id in self._running or op.held:
                continue  # one op at a time per instance; a held op waits for its release
            if op.grows and self.pessimistic - self._held(op.instance_id) + op.bytes_after > self.capacity:
                continue  # stays parked in the reservation station
            self._waiting.remove(op)
            op = replace(op, started_at=now)
            self._running[op.instance_id] = op
            started.append(op)
        return started

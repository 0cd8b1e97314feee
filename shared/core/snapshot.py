"""One clock convention for views that cross the wire (issue 22 #11).

A node reasons in its own clock: every time in its `NodeView` (its iteration's end, its memory
ops' end, its instances' ready, idle and handover times, a pipeline's switch, busy meters, and
its requests' arrivals as it judges them) is a time on that clock. Another process (a placer, a
node reading its peers) has another clock, set apart by an offset nobody measured. So a view
leaves its node as a snapshot: every one of those times as seconds from the snapshot's moment
(`NodeView.heartbeat`, which stays the node's own clock reading), like `StorageView`'s times
already are. The receiver rebases it onto its own clock as of when the snapshot was taken:

    wire = to_snapshot(view)                 # the node, just before it publishes or replies
    view = rebase(wire, now, max_age_s)      # the receiver, on arrival (its own `now`)

When was the snapshot taken, on the receiver's clock? If the heartbeat reads as a time at most
`max_age_s` ago, the clocks are taken to agree (one host, or hosts whose clocks are kept in step)
and the snapshot is that old: its times come back exactly as the node wrote them. Otherwise the
clocks differ and the age cannot be told apart from the offset: the snapshot is taken as current
(its storage bounds how old it can be: a node's view in Redis expires after a few heartbeats).
"""

from __future__ import annotations

from dataclasses import replace

from shared.core.types import InstanceView, NodeView


def to_snapshot(view: NodeView) -> NodeView:
    """`view` with its times relative to its `heartbeat` (the wire form)."""
    return _shifted(view, -view.heartbeat, view.heartbeat)


def snapshot_at(heartbeat: float, now: float, max_age_s: float) -> float:
    """When a snapshot stamped `heartbeat` (the sender's clock) was taken, on the receiver's
    clock at `now` (module docstring)."""
    if 0.0 <= now - heartbeat <= max_age_s:
        return heartbeat  # the same clock: exactly the node's times
    return now  # another clock (or one a little ahead of ours): taken as current


def rebase(snapshot: NodeView, now: float, max_age_s: float) -> NodeView:
    """A wire snapshot onto the receiver's clock (`now`): its `heartbeat` becomes the moment it
    was taken there, and every relative time is counted from that moment."""
    at = snapshot_at(snapshot.heartbeat, now, max_age_s)
    return _shifted(snapshot, at, at)


def _shifted(view: NodeView, delta: float, heartbeat: float) -> NodeView:
    return replace(view, busy_until=view.busy_until + delta,
                   memops_until=view.memops_until + delta,
                   parked_start=view.parked_start + delta, heartbeat=heartbeat,
                   instances=[_shifted_instance(i, delta) for i in view.instances])


def _shifted_instance(inst: InstanceView, delta: float) -> InstanceView:
    pipeline, busy = inst.pipeline, inst.busy
    if pipeline is not None:
        pipeline = replace(pipeline, until=pipeline.until + delta)
    if busy is not None:
        busy = replace(busy, since=busy.since + delta, at=busy.at + delta)
    return replace(inst, ready_at=inst.ready_at + delta, last_active=inst.last_active + delta,
                   leaves_at=inst.leaves_at + delta,
                   requests=[replace(r, arrival=r.arrival + delta) for r in inst.requests],
                   adapters=dict(inst.adapters), pipeline=pipeline, busy=busy,
                   prefill_progress=dict(inst.prefill_progress))

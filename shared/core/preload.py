"""Artifact pre-loading (ServerlessLoRA §3, §4.1) as the services and the simulator carry it out.

The knapsacks are `shared.core.lora`'s (`plan_cluster_preload`, `plan_node_preload`); this
module is what comes before and after them: the artifacts a caller knows turned into their
inputs (sizes, the time a pre-load saves, call rates), the part of a received cluster plan a
node can carry out, and what a node does with its planned checkpoints. The placer
(services/placer/preloader.py), the node (services/node/preload.py) and the simulator
(sim/preload.py) call these and keep only their I/O (the registry, NATS, the loader, the event
loop), so a pre-load seen in a simulation is the one the services make.

- The placer plans every `interval_s` from the calls it saw (every request passes through it),
  over the nodes' views, and sends each node its part (`cluster_preload`), valid for
  `plan_valid_s(interval_s)`.
- A node re-plans every interval: while the placer's plan is fresh (`plan_fresh`) it carries out
  what of it it can (`accept_cluster_plan`), else it plans from its own admissions' rates
  (`node_preload`). Of either plan's adapters it attaches now only what `adapters_to_attach`
  lets through, each by `NodeScheduler.preload_adapter` (its own LOAD op); checkpoints are read
  into or touched in the DRAM tier (`checkpoint_steps`).

Pre-loading only uses memory and I/O no admission is about to want (issue 22 follow-up: the LoRA
runs pre-loaded adapters into the whole free budget, offloaded them for the next join, pre-loaded
them again five seconds later, and queued their loads behind cold starts' registry reads):
- adapters go only into the room left beside each instance's next KV scale-up
  (`lora.preload_room`), in the placer's plan and again on the node;
- none whose load would wait for the node's I/O queue or for memory (it would hold its
  instance up for the whole wait), and one a turn onto an instance serving requests;
- none for `PRESSURE_HOLD_S` after the node gave adapters up for memory (`PressureWatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.core.lora import (Artifact, CallRates, NodePreload, adapter_load_s, adapter_ready_at,
                              plan_cluster_preload, plan_node_preload, preload_room)
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, InstanceStatus, NodeView

# How often the placer and each node re-plan unless their environment says otherwise
# (SLINFER_CLUSTER_PRELOAD_S, SLINFER_PRELOAD_INTERVAL_S); the simulator's default too.
PRELOAD_INTERVAL_S = 5.0
# A node follows a cluster plan for this many of the placer's intervals: two plans may be lost
# before the node falls back on its own rates.
VALID_INTERVALS = 3
# A node that gave up adapters for memory pre-loads none for this long (`PressureWatch`). In the
# simulated LoRA runs an adapter pre-loaded unused waited a median 10-40 s before the pressure
# that offloaded it; a minute spans that and lets the admissions that wanted the memory finish.
PRESSURE_HOLD_S = 60.0


@dataclass(frozen=True)
class Preloadable:
    """An artifact pre-loading may plan, as its registry record (or the simulator's layout) says:
    a backbone (`backbone` None) or a LoRA adapter of `backbone`."""

    name: str
    bytes: int
    backbone: str | None = None


def plan_valid_s(interval_s: float) -> float:
    """How long a node follows the cluster plan the placer sends every `interval_s`."""
    return VALID_INTERVALS * interval_s


def plan_fresh(received_at: float, valid_s: float, now: float) -> bool:
    """Is a cluster plan received at `received_at` (the node's clock) still the one to follow?"""
    return now - received_at <= valid_s


# --- the placer: the cluster's plan ----------------------------------------------------------
def cluster_artifacts(called: Iterable[str], known: Mapping[str, Preloadable], rates: CallRates,
                      nodes: Iterable[NodeView], perf: PerfModel,
                      now: float) -> tuple[list[Artifact], list[Artifact]]:
    """The called artifacts the caller may plan (`known`), with cluster-wide rates. A backbone is
    worth its slowest profiled cold load on the nodes' hardware kinds (what a DRAM-tier copy
    saves, as the nodes weigh it); an adapter, its load at the core's adapter rate."""
    kinds = sorted({n.hardware for n in nodes}, key=lambda h: h.value)
    backbones, adapters = [], []
    for name in called:
        item = known.get(name)
        if item is None:
            continue
        rate = rates.rate(name, now)
        if item.backbone is None:
            load_s = max((p.load_s for k in kinds if (p := perf.get(name, k)) is not None),
                         default=0.0)
            backbones.append(Artifact(name, item.bytes, load_s, rate))
        else:
            adapters.append(Artifact(name, item.bytes, adapter_load_s(item.bytes), rate,
                                     item.backbone))
    return backbones, adapters


def cluster_preload(called: Iterable[str], known: Mapping[str, Preloadable], rates: CallRates,
                    nodes: Iterable[NodeView], perf: PerfModel, now: float,
                    watermark: float) -> dict[str, NodePreload]:
    """The Pre-Loading Scheduler's turn: node -> its part of the plan, over the nodes that are
    not draining (a draining node is about to go: nothing is worth pre-loading there).
    `watermark`: the core's KV watermark (the room each node keeps for its next scale-ups)."""
    live = [n for n in nodes if not n.draining]
    backbones, adapters = cluster_artifacts(called, known, rates, live, perf, now)
    return plan_cluster_preload(live, backbones, adapters, watermark)


# --- a node: its own plan, or the placer's -------------------------------------------------
def ready_backbones(node: NodeView,
                    serving: Callable[[str], bool] | None = None) -> dict[str, str]:
    """Backbone -> a ready instance of it on the node (the lowest id), that adapters can join.
    `serving(instance_id)`: whether its engine runs (the node worker's check; None: all do)."""
    ready: dict[str, str] = {}
    for inst in sorted(node.instances, key=lambda i: i.instance_id):
        if inst.status is InstanceStatus.READY and (serving is None or serving(inst.instance_id)):
            ready.setdefault(inst.model.name, inst.instance_id)
    return ready


def node_artifacts(backbones: Iterable[Preloadable], adapters: Iterable[Preloadable],
                   rate: Callable[[str, float], float], perf: PerfModel, hardware: Hardware,
                   now: float) -> tuple[list[Artifact], list[Artifact]]:
    """The artifacts a node knows, with its own rates (`NodeScheduler.rate`). A backbone is worth
    its profiled cold load on this node (one without a profile here is left out); an adapter,
    its load at the core's adapter rate."""
    arts = [Artifact(b.name, b.bytes, p.load_s, rate(b.name, now))
            for b in backbones if (p := perf.get(b.name, hardware)) is not None]
    return arts, [Artifact(a.name, a.bytes, adapter_load_s(a.bytes), rate(a.name, now),
                           a.backbone) for a in adapters]


def node_preload(node: NodeView, backbones: Iterable[Preloadable],
                 adapters: Iterable[Preloadable], rate: Callable[[str, float], float],
                 perf: PerfModel, now: float, dram_bytes: int, ready: dict[str, str],
                 watermark: float) -> NodePreload:
    """A node's own plan (no fresh cluster plan): `plan_node_preload` over what it knows, with
    its DRAM tier's capacity, the room its admitted demand leaves (`preload_room`) and its ready
    backbone instances."""
    arts, adapter_arts = node_artifacts(backbones, adapters, rate, perf, node.hardware, now)
    attached = {i.instance_id: set(i.adapters) for i in node.instances}
    return plan_node_preload(arts, adapter_arts, dram_bytes, ready, attached,
                             preload_room(node, watermark))


def accept_cluster_plan(sent: NodePreload, node: NodeView, ready: Collection[str],
                        known: Mapping[str, Preloadable]) -> NodePreload:
    """The part of the placer's plan for this node that it can carry out now: the checkpoints of
    backbones it may pre-load (`known`), and the adapters it knows onto a ready instance here
    of their own backbone."""
    checkpoints = tuple(n for n in sent.checkpoints
                        if (item := known.get(n)) is not None and item.backbone is None)
    attach = []
    for iid, name in sent.adapters:
        inst = node.instance(iid)
        item = known.get(name)
        if iid in ready and inst is not None and item is not None \
                and item.backbone == inst.model.name:
            attach.append((iid, name))
    return NodePreload(checkpoints, tuple(attach))


class PressureWatch:
    """When a node last gave up adapters for memory (dynamic offloading, §4.3), as its
    pre-loading turns see it: an adapter attached at one turn (`look`, `attached`) and gone at a
    later one from an instance that is still there and not unloading. Whatever took it (an
    admission's offload, or a failed load the node detached), the node's memory was wanted: the
    node pre-loads nothing for `PRESSURE_HOLD_S` after (`holding`), instead of attaching again at
    the next turn what the next admission offloads again."""

    def __init__(self) -> None:
        self._attached: dict[str, set[str]] = {}  # instance -> its adapters at the last look
        self.pressure_at: float | None = None

    def look(self, node: NodeView, now: float) -> None:
        live = {i.instance_id: set(i.adapters) for i in node.instances
                if i.status is not InstanceStatus.UNLOADING}
        if any(names - live[iid] for iid, names in self._attached.items() if iid in live):
            self.pressure_at = now
        self._attached = live

    def attached(self, instance_id: str, adapter: str) -> None:
        """An adapter the turn attached after its look."""
        self._attached.setdefault(instance_id, set()).add(adapter)

    def holding(self, now: float) -> bool:
        return self.pressure_at is not None and now - self.pressure_at < PRESSURE_HOLD_S


def adapters_to_attach(plan: NodePreload, node: NodeView, sizes: Mapping[str, int],
                       watermark: float, now: float,
                       watch: PressureWatch) -> tuple[tuple[str, str], ...]:
    """The planned adapters (either plan's) a node attaches now, in the plan's order (most
    valuable per byte first): none while `watch` holds pre-loading back (it looks at the node
    first; the caller tells it what attached, `PressureWatch.attached`); within the node's room
    (`preload_room`: the placer planned on a view that may be stale); none whose load would not
    start at once. A load behind the node's I/O queue (a cold start's read) or parked for memory
    holds its instance up for all that wait, a request routed there meanwhile waiting with it;
    an adapter a request asks for later is loaded then, at its own cost. An instance serving
    requests gets one adapter a turn: `may_hold` validates each load alone, while a turn's loads
    onto one instance follow one another on the node's I/O and hold its batch for their sum."""
    watch.look(node, now)
    if watch.holding(now):
        return ()
    room = preload_room(node, watermark)
    chosen: list[tuple[str, str]] = []
    held: set[str] = set()  # instances with requests that got their one adapter this turn
    for iid, name in plan.adapters:
        nbytes = sizes[name]
        if nbytes > room or iid in held \
                or adapter_ready_at(node, nbytes, now) > now + adapter_load_s(nbytes):
            continue
        inst = node.instance(iid)
        if inst is not None and inst.requests:
            held.add(iid)
        room -= nbytes
        chosen.append((iid, name))
    return tuple(chosen)


def checkpoint_steps(checkpoints: Sequence[str], tier_of: Callable[[str], str | None],
                     io_busy: bool) -> tuple[tuple[str, bool], ...]:
    """What a node does with its planned checkpoints, in the plan's order (least valuable first,
    so the most valuable ends the DRAM tier's most recently used): (backbone, read). One in the
    DRAM tier is touched (False); of the others, one per re-plan is read into it (True), and
    none while a load waits for the node's I/O (a cold start's load goes first); one with no
    checkpoint to read yet (`tier_of` None) is passed over."""
    steps: list[tuple[str, bool]] = []
    reading = False
    for name in checkpoints:
        tier = tier_of(name)
        if tier is None:
            continue
        read = tier != "dram"
        if read:
            if reading or io_busy:
                continue
            reading = True
        steps.append((name, read))
    return tuple(steps)

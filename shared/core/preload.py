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
  (`node_preload`). Adapters attach through `NodeScheduler.preload_adapter` (their own LOAD op);
  checkpoints are read into or touched in the DRAM tier (`checkpoint_steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.core.lora import (Artifact, CallRates, NodePreload, adapter_load_s,
                              plan_cluster_preload, plan_node_preload)
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, InstanceStatus, NodeView

# How often the placer and each node re-plan unless their environment says otherwise
# (SLINFER_CLUSTER_PRELOAD_S, SLINFER_PRELOAD_INTERVAL_S); the simulator's default too.
PRELOAD_INTERVAL_S = 5.0
# A node follows a cluster plan for this many of the placer's intervals: two plans may be lost
# before the node falls back on its own rates.
VALID_INTERVALS = 3


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
                    nodes: Iterable[NodeView], perf: PerfModel,
                    now: float) -> dict[str, NodePreload]:
    """The Pre-Loading Scheduler's turn: node -> its part of the plan, over the nodes that are
    not draining (a draining node is about to go: nothing is worth pre-loading there)."""
    live = [n for n in nodes if not n.draining]
    backbones, adapters = cluster_artifacts(called, known, rates, live, perf, now)
    return plan_cluster_preload(live, backbones, adapters)


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
                 perf: PerfModel, now: float, dram_bytes: int, free_bytes: int,
                 ready: dict[str, str]) -> NodePreload:
    """A node's own plan (no fresh cluster plan): `plan_node_preload` over what it knows, with
    its DRAM tier's capacity, its free memory budget and its ready backbone instances."""
    arts, adapter_arts = node_artifacts(backbones, adapters, rate, perf, node.hardware, now)
    attached = {i.instance_id: set(i.adapters) for i in node.instances}
    return plan_node_preload(arts, adapter_arts, dram_bytes, ready, attached, free_bytes)


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

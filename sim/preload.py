"""Artifact pre-loading (ServerlessLoRA §4.1) in a simulated LoRA run, as the services do it: the
placer's Pre-Loading Scheduler (services/placer/preloader.py) and each node's pre-loading
(services/node/preload.py), on the simulator's clock, through the same functions
(shared/core/preload.py), with the services' default interval and plan validity.

Every `interval_s` of simulated time (sim/lora.py runs the turn): the placer plans from the calls
it saw (each arrival, a new request) over the nodes' views and hands each node its part; then
each node carries out the placer's plan while it is fresh, else its own from the rates its
admissions show. A pre-loaded adapter (what `adapters_to_attach` lets through of the plan) is
the node scheduler's `preload_adapter`: its LOAD op runs on the simulated node like any memory
op. A checkpoint read into the DRAM tier takes the node's I/O queue (`NodeStorage.read_ahead`)
and is in the tier once read; one already there is touched.

Simplifications: the placer and the nodes re-plan at the same instants (the services' clocks
run apart) and no plan is lost on the way; a node knows the artifacts it admitted
(`NodeScheduler.called`) or was sent, not also the ones it was offered and refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.core.lora import CallRates, NodePreload
from shared.core.memory import MemOp
from shared.core.node_scheduler import NodeScheduler
from shared.core.perf_model import PerfModel
from shared.core.preload import (PRELOAD_INTERVAL_S, Preloadable, PressureWatch,
                                 accept_cluster_plan, adapters_to_attach, checkpoint_steps,
                                 cluster_preload, node_preload, plan_fresh, plan_valid_s,
                                 ready_backbones)
from shared.core.types import AdapterSpec, NodeView
from sim.cluster_port import SimNode


@dataclass(frozen=True)
class NodeTurn:
    """What one node's re-plan chose and started."""

    plan: NodePreload
    source: str  # "placer": the cluster's plan; "node": the node's own
    ops: tuple[MemOp, ...]  # the adapters' LOAD ops, for the node to run
    attached: tuple[str, ...]  # adapters attached now
    reads: tuple[tuple[str, int, float], ...]  # (backbone, bytes, seconds until in DRAM)


class Preloading:
    """The cluster's pre-loading over the artifacts of a run (`known`: backbones and adapters),
    with the core's KV `watermark` (the room nodes keep for their next scale-ups)."""

    def __init__(self, known: Mapping[str, Preloadable], perf: PerfModel, watermark: float,
                 interval_s: float = PRELOAD_INTERVAL_S) -> None:
        self.known = dict(known)
        self.perf = perf
        self.watermark = watermark
        self.interval_s = interval_s
        self.valid_s = plan_valid_s(interval_s)
        self.rates = CallRates()  # the placer's: every new request
        self.sent: dict[str, tuple[float, NodePreload]] = {}  # node -> (when it came, the plan)
        self.learned: dict[str, set[str]] = {}  # node -> artifacts it learned from a plan
        self.watches: dict[str, PressureWatch] = {}  # node -> when it last offloaded adapters

    def note(self, model: str, adapter: str | None, now: float) -> None:
        """A new request passed the placer: one call of its backbone and its adapter."""
        self.rates.note(model, adapter, now)

    def placer_turn(self, nodes: list[NodeView], now: float) -> dict[str, NodePreload]:
        """The placer plans and sends each node its part (nothing before the first call)."""
        called = self.rates.called()
        if not called:
            return {}
        plans = cluster_preload(called, self.known, self.rates, nodes, self.perf, now,
                                self.watermark)
        for node_id, plan in plans.items():
            self.sent[node_id] = (now, plan)
        return plans

    def choose(self, sched: NodeScheduler, dram_bytes: int, now: float) -> tuple[NodePreload, str]:
        """The placer's fresh plan, as far as the node can carry it out, else the node's own."""
        node = sched.node
        learned = self.learned.setdefault(node.node_id, set())
        ready = ready_backbones(node)
        got = self.sent.get(node.node_id)
        if got is not None and plan_fresh(got[0], self.valid_s, now):
            plan = accept_cluster_plan(got[1], node, set(ready.values()), self.known)
            learned.update(plan.checkpoints, (name for _, name in plan.adapters))
            return plan, "placer"
        names = set(sched.called()) | learned
        backbones = [a for n, a in self.known.items() if n in names and a.backbone is None]
        adapters = [a for n, a in self.known.items() if n in names and a.backbone in names]
        return node_preload(node, backbones, adapters, sched.rate, self.perf, now, dram_bytes,
                            ready, self.watermark), "node"

    def node_turn(self, sn: SimNode, now: float) -> NodeTurn:
        """One node's re-plan, carried out as the node worker does (`Preloader.once`)."""
        storage = sn.storage
        plan, source = self.choose(sn.sched, storage.dram_bytes if storage else 0, now)
        ops: list[MemOp] = []
        attached = []
        sizes = {name: self.known[name].bytes for _, name in plan.adapters}
        watch = self.watches.setdefault(sn.node_id, PressureWatch())
        for iid, name in adapters_to_attach(plan, sn.sched.node, sizes, self.watermark, now,
                                            watch):
            ops += sn.sched.preload_adapter(iid, AdapterSpec(name, sizes[name]), now)
            inst = sn.sched.node.instance(iid)
            if inst is not None and name in inst.adapters:  # attached now (its load may be parked)
                attached.append(name)
                watch.attached(iid, name)
        reads = []
        if storage is not None:
            for name, read in checkpoint_steps(plan.checkpoints, storage.tier_of,
                                               storage.io_busy(now)):
                nbytes = self.known[name].bytes
                if read:
                    reads.append((name, nbytes, storage.read_ahead(name, nbytes, now)))
                else:
                    storage.touch(name, nbytes)
        return NodeTurn(plan, source, tuple(ops), tuple(attached), tuple(reads))

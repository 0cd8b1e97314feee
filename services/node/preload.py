"""Artifact pre-loading on a node (ServerlessLoRA §4.1), a plug-in of the node worker.

Every `SLINFER_PRELOAD_INTERVAL_S` the node re-plans from the invocation rates its own
admissions show (`NodeScheduler.rate`: a request through an adapter counts for the adapter and
its backbone) with `shared.core.preload.node_preload` (the simulator's nodes call the same
functions, sim/preload.py; this file keeps the I/O), then:

- keeps the planned backbones' checkpoints in its loader's DRAM tier: a missing one is read into
  it (one at a time, and only while no cold start waits for the node's I/O), and the planned
  ones are touched least valuable first, so the tier's LRU gives up what the plan left out
  before any of them; the next cold start of a planned backbone is a DRAM-tier load;
- attaches the planned adapters to a ready instance of their backbone before any request asks
  for them (the core's `preload_adapter`: their own LOAD op), so the next request through one
  starts without the adapter's load; only what `adapters_to_attach` lets through: within the
  room beside its instances' next KV scale-ups, not while its I/O queue would delay the load,
  and not for a while after it offloaded adapters for memory.

The placer sees every request and plans the same for the whole cluster
(services/placer/preloader.py): while the plan it sent this node is fresh, the node carries that
out instead of its own (the backbones and adapters it names may be ones this node was never
asked for; their records are read from the registry). With no fresh plan (no placer, or its
plans stopped coming) the node plans alone.

Rates fall while nothing calls an artifact, so a cooled backbone's checkpoint is the first the
tier evicts once a hotter one is planned, and dynamic offloading (§4.3) takes pre-loaded adapters
back first under memory pressure. Only torch-engine backbones are planned (the engines that load
through the node's loader and serve adapters).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from services.node.runtime import NodeRuntime
from shared import wire
from shared.core.lora import NodePreload
from shared.core.preload import (Preloadable, PressureWatch, accept_cluster_plan,
                                 adapters_to_attach, checkpoint_steps, node_preload, plan_fresh,
                                 ready_backbones)
from shared.core.types import AdapterSpec
from shared.registry import ModelRegistry
from shared.schemas import ModelRecord, PreloadPlan
from shared.subjects import preload_subject

log = logging.getLogger("slinfer.node.preload")
HISTORY_LEN = 4096


@dataclass(frozen=True)
class PreloadRecord:
    """One re-plan and what it started (observability, tests)."""

    at: float
    plan: NodePreload
    read: tuple[str, ...]  # backbones read into the DRAM tier now
    attached: tuple[str, ...]  # adapters whose LOAD op started now
    source: str = "node"  # "placer": the cluster's plan; "node": this node's own


class Preloader:
    """The node's pre-loading (module doc) over the backbones and adapters it was asked for:
    `backbones` and `adapters` are the dicts the node's cluster sync and adapters part keep
    (shared, so a record learned here is known there too)."""

    def __init__(self, rt: NodeRuntime, backbones: dict[str, ModelRecord],
                 adapters: dict[str, ModelRecord]) -> None:
        self.rt, self.backbones, self.adapters = rt, backbones, adapters
        self.records: deque[PreloadRecord] = deque(maxlen=HISTORY_LEN)
        # The placer's latest pre-loading plan for this node and when it came (monotonic).
        self.cluster: tuple[float, PreloadPlan] | None = None
        self.watch = PressureWatch()  # when the node last offloaded adapters (no pre-loads then)

    def known(self) -> tuple[list[Preloadable], list[Preloadable]]:
        """The torch-engine backbones this node has been asked for, and the adapters of any
        backbone it has been asked for."""
        backbones = [preloadable(r) for r in self.backbones.values() if r.engine == "torch"]
        adapters = [preloadable(r) for r in self.adapters.values()
                    if r.base_model in self.backbones]
        return backbones, adapters

    def ready_instances(self) -> dict[str, str]:
        """Backbone -> a ready instance of it here (with its engine), that adapters can join."""
        return ready_backbones(self.rt.sched.node,
                               lambda iid: self.rt.engines.get(iid) is not None)

    def plan(self, now: float) -> NodePreload:
        sched, loader = self.rt.sched, self.rt.loader
        backbones, adapters = self.known()
        dram = loader.settings.dram_cache_bytes if loader is not None else 0
        return node_preload(sched.node, backbones, adapters, sched.rate, self.rt.base_perf, now,
                            dram, self.ready_instances(), sched.config.watermark)

    async def _record(self, name: str) -> ModelRecord | None:
        try:
            return await ModelRegistry(self.rt.redis).get(name)
        except Exception as exc:  # Redis blip: this round plans without it
            log.warning("could not read %r's record for pre-loading: %r", name, exc)
            return None

    async def placer_plan(self, sent: PreloadPlan) -> NodePreload:
        """The placer's plan for this node, as far as this node can carry it out now
        (`accept_cluster_plan`): the records it names are read first, and the ones it keeps are
        learned (a backbone's name for the tiers report too)."""
        records: dict[str, ModelRecord] = {}
        for name in sent.checkpoints:
            record = self.backbones.get(name) or await self._record(name)
            if record is not None and record.engine == "torch":
                records[name] = record
        ready = set(self.ready_instances().values())
        for iid, name in sent.adapters:
            if iid in ready and name not in records:
                record = self.adapters.get(name) or await self._record(name)
                if record is not None:
                    records[name] = record
        offered = NodePreload(tuple(sent.checkpoints), tuple((i, n) for i, n in sent.adapters))
        chosen = accept_cluster_plan(offered, self.rt.sched.node, ready,
                                     {n: preloadable(r) for n, r in records.items()})
        for name in chosen.checkpoints:
            self.backbones[name] = records[name]
            self.rt.model_names.learn(records[name])
        for _, name in chosen.adapters:
            self.adapters[name] = records[name]
        return chosen

    async def choose(self, now: float) -> tuple[NodePreload, str]:
        """The placer's fresh plan if there is one, else this node's own."""
        if self.cluster is not None:
            received, sent = self.cluster
            if plan_fresh(received, sent.valid_s, time.monotonic()):
                return await self.placer_plan(sent), "placer"
        return self.plan(now), "node"

    async def once(self) -> PreloadRecord:
        rt = self.rt
        now = time.time()
        chosen, source = await self.choose(now)
        attached = []
        sizes = {name: self.adapters[name].weight_bytes for _, name in chosen.adapters}
        rt.refresh_storage()  # the I/O queue an adapter's load would wait behind, as it is now
        for iid, name in adapters_to_attach(chosen, rt.sched.node, sizes,
                                            rt.sched.config.watermark, now, self.watch):
            spec = AdapterSpec(name, sizes[name])
            rt.start_ops(rt.sched.preload_adapter(iid, spec, now))
            inst = rt.sched.node.instance(iid)
            if inst is not None and name in inst.adapters:  # attached now (its load may be parked)
                attached.append(name)
                self.watch.attached(iid, name)
        read = []
        loader = rt.loader
        steps = () if loader is None else checkpoint_steps(
            chosen.checkpoints, lambda name: loader.tier_of(self.backbones[name].path),
            bool(loader.pending))
        for name, reads in steps:  # least valuable first: the most valuable ends most recent
            if rt.stopping:
                break
            if reads:
                read.append(name)
            # a read into the DRAM tier, or a hit that only touches it
            await asyncio.to_thread(loader.host_checkpoint, self.backbones[name].path)
        if read or attached:
            rt.refresh_storage()
            log.info("pre-loaded %s", ", ".join([*(f"{n} (DRAM tier)" for n in read),
                                                 *(f"{n} (adapter)" for n in attached)]))
        return PreloadRecord(now, chosen, tuple(read), tuple(attached), source)

    def _on_plan(self, msg) -> None:
        try:
            sent = wire.decode(PreloadPlan, msg.data)
        except wire.WireError as exc:
            log.warning("dropping an undecodable pre-loading plan: %s", exc)
            return
        if sent.node_id == self.rt.s.node_id:
            self.cluster = (time.monotonic(), sent)

    async def run(self) -> None:
        """Take the placer's plans as they come; re-plan every `preload_interval_s`. A failure
        costs one round, never the loop."""
        async def on_plan(msg) -> None:
            self._on_plan(msg)

        await self.rt.nc.subscribe(preload_subject(self.rt.s.node_id), cb=on_plan)
        while not self.rt.stopping:
            await asyncio.sleep(self.rt.s.preload_interval_s)
            try:
                self.records.append(await self.once())
                self.rt.trouble("pre-loading", None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.rt.trouble("pre-loading", exc)


def preloadable(record: ModelRecord) -> Preloadable:
    return Preloadable(record.name, record.weight_bytes, record.base_model)

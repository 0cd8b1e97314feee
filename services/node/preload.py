"""Artifact pre-loading on a node (ServerlessLoRA §4.1), a plug-in of the node worker.

Every `SLINFER_PRELOAD_INTERVAL_S` the node re-plans from the invocation rates its own
admissions show (`NodeScheduler.rate`: a request through an adapter counts for the adapter and
its backbone) with `shared.core.lora.plan_node_preload`, then:

- keeps the planned backbones' checkpoints in its loader's DRAM tier: a missing one is read into
  it (one at a time, and only while no cold start waits for the node's I/O), and the planned
  ones are touched least valuable first, so the tier's LRU gives up what the plan left out
  before any of them; the next cold start of a planned backbone is a DRAM-tier load;
- attaches the planned adapters to a ready instance of their backbone before any request asks
  for them (the core's `preload_adapter`: their own LOAD op, within the node's free budget), so
  the next request through one starts without the adapter's load.

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
from shared.core.lora import Artifact, NodePreload, plan_node_preload
from shared.core.node_scheduler import ADAPTER_LOAD_BYTES_PER_S
from shared.core.types import AdapterSpec, InstanceStatus
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

    def artifacts(self, now: float) -> tuple[list[Artifact], list[Artifact]]:
        """The backbones and adapters this node has been asked for, with their rates here."""
        sched, hardware = self.rt.sched, self.rt.sched.node.hardware
        backbones = []
        for name, record in self.backbones.items():
            profile = self.rt.base_perf.get(name, hardware)
            if record.engine != "torch" or profile is None:
                continue
            # The time a pre-loaded checkpoint saves: its cold load as profiled (from the registry).
            backbones.append(Artifact(name, record.weight_bytes, profile.load_s,
                                      sched.rate(name, now)))
        adapters = [Artifact(name, rec.weight_bytes, rec.weight_bytes / ADAPTER_LOAD_BYTES_PER_S,
                             sched.rate(name, now), rec.base_model)
                    for name, rec in self.adapters.items() if rec.base_model in self.backbones]
        return backbones, adapters

    def ready_instances(self) -> dict[str, str]:
        """Backbone -> a ready instance of it here (with its engine), that adapters can join."""
        instances: dict[str, str] = {}
        for inst in sorted(self.rt.sched.node.instances, key=lambda i: i.instance_id):
            if inst.status is InstanceStatus.READY and \
                    self.rt.engines.get(inst.instance_id) is not None:
                instances.setdefault(inst.model.name, inst.instance_id)
        return instances

    def plan(self, now: float) -> NodePreload:
        sched = self.rt.sched
        backbones, adapters = self.artifacts(now)
        instances = self.ready_instances()
        attached = {i.instance_id: set(i.adapters) for i in sched.node.instances}
        loader = self.rt.loader
        dram = loader.settings.dram_cache_bytes if loader is not None else 0
        return plan_node_preload(backbones, adapters, dram, instances, attached,
                                 sched.ledger.capacity - sched.ledger.budget)

    async def _record(self, name: str) -> ModelRecord | None:
        try:
            return await ModelRegistry(self.rt.redis).get(name)
        except Exception as exc:  # Redis blip: this round plans without it
            log.warning("could not read %r's record for pre-loading: %r", name, exc)
            return None

    async def placer_plan(self, sent: PreloadPlan) -> NodePreload:
        """The placer's plan for this node, as far as this node can carry it out now: torch-engine
        backbones (their records learned), adapters of a backbone with a ready instance here."""
        checkpoints = []
        for name in sent.checkpoints:
            record = self.backbones.get(name) or await self._record(name)
            if record is None or record.base_model is not None or record.engine != "torch":
                continue
            self.backbones[name] = record
            self.rt.model_names.learn(record)
            checkpoints.append(name)
        ready = set(self.ready_instances().values())
        adapters = []
        for iid, name in sent.adapters:
            inst = self.rt.sched.node.instance(iid)
            if iid not in ready or inst is None:
                continue
            record = self.adapters.get(name) or await self._record(name)
            if record is None or record.base_model != inst.model.name:
                continue
            self.adapters[name] = record
            adapters.append((iid, name))
        return NodePreload(tuple(checkpoints), tuple(adapters))

    async def choose(self, now: float) -> tuple[NodePreload, str]:
        """The placer's fresh plan if there is one, else this node's own."""
        if self.cluster is not None:
            received, sent = self.cluster
            if time.monotonic() - received <= sent.valid_s:
                return await self.placer_plan(sent), "placer"
        return self.plan(now), "node"

    async def once(self) -> PreloadRecord:
        rt = self.rt
        now = time.time()
        chosen, source = await self.choose(now)
        attached = []
        for iid, name in chosen.adapters:
            spec = AdapterSpec(name, self.adapters[name].weight_bytes)
            rt.start_ops(rt.sched.preload_adapter(iid, spec, now))
            inst = rt.sched.node.instance(iid)
            if inst is not None and name in inst.adapters:  # attached now (its load may be parked)
                attached.append(name)
        read = []
        loader = rt.loader
        for name in chosen.checkpoints:  # least valuable first: the most valuable ends most recent
            if loader is None or rt.stopping:
                break
            path = self.backbones[name].path
            tier = loader.tier_of(path)
            if tier is None:
                continue  # no converted checkpoint to read (yet)
            if tier != "dram":
                if read or loader.pending:
                    continue  # one read per re-plan, and never ahead of a cold start's load
                read.append(name)
            await asyncio.to_thread(loader.host_checkpoint, path)  # a hit only touches it
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

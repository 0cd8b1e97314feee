"""Artifact pre-loading on a node (ServerlessLoRA §4.1), carried out by the node worker.

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

Rates fall while nothing calls an artifact, so a cooled backbone's checkpoint is the first the
tier evicts once a hotter one is planned, and dynamic offloading (§4.3) takes pre-loaded adapters
back first under memory pressure. Only torch-engine backbones are planned (the engines that load
through the node's loader and serve adapters).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.core.lora import Artifact, NodePreload, plan_node_preload
from shared.core.node_scheduler import ADAPTER_LOAD_BYTES_PER_S
from shared.core.types import AdapterSpec, InstanceStatus

if TYPE_CHECKING:
    from services.node.worker import NodeWorker

log = logging.getLogger("slinfer.node.preload")


@dataclass(frozen=True)
class PreloadRecord:
    """One re-plan and what it started (observability, tests)."""

    at: float
    plan: NodePreload
    read: tuple[str, ...]  # backbones read into the DRAM tier now
    attached: tuple[str, ...]  # adapters whose LOAD op started now


def artifacts(worker: NodeWorker, now: float) -> tuple[list[Artifact], list[Artifact]]:
    """The backbones and adapters this node has been asked for, with their rates here."""
    sched, hardware = worker.sched, worker.sched.node.hardware
    backbones = []
    for name, record in worker.backbones.items():
        profile = worker.base_perf.get(name, hardware)
        if record.engine != "torch" or profile is None:
            continue
        # The time a pre-loaded checkpoint saves: its cold load as profiled (from the registry).
        backbones.append(Artifact(name, record.weight_bytes, profile.load_s, sched.rate(name, now)))
    adapters = [Artifact(name, rec.weight_bytes, rec.weight_bytes / ADAPTER_LOAD_BYTES_PER_S,
                         sched.rate(name, now), rec.base_model)
                for name, rec in worker.adapter_records.items() if rec.base_model in worker.backbones]
    return backbones, adapters


def plan(worker: NodeWorker, now: float) -> NodePreload:
    sched = worker.sched
    backbones, adapters = artifacts(worker, now)
    instances: dict[str, str] = {}
    for inst in sorted(sched.node.instances, key=lambda i: i.instance_id):
        if inst.status is InstanceStatus.READY and worker.engines.get(inst.instance_id) is not None:
            instances.setdefault(inst.model.name, inst.instance_id)
    attached = {i.instance_id: set(i.adapters) for i in sched.node.instances}
    dram = worker.loader.settings.dram_cache_bytes if worker.loader is not None else 0
    return plan_node_preload(backbones, adapters, dram, instances, attached,
                             sched.ledger.capacity - sched.ledger.budget)


async def preload_once(worker: NodeWorker) -> PreloadRecord:
    now = time.time()
    chosen = plan(worker, now)
    attached = []
    for iid, name in chosen.adapters:
        spec = AdapterSpec(name, worker.adapter_records[name].weight_bytes)
        worker._start_ops(worker.sched.preload_adapter(iid, spec, now))
        inst = worker.sched.node.instance(iid)
        if inst is not None and name in inst.adapters:  # attached now (its load may be parked)
            attached.append(name)
    read = []
    loader = worker.loader
    for name in chosen.checkpoints:  # least valuable first: the most valuable ends most recent
        if loader is None or worker._stopping:
            break
        path = worker.backbones[name].path
        tier = loader.tier_of(path)
        if tier is None:
            continue  # no converted checkpoint to read (yet)
        if tier != "dram":
            if read or loader.pending:
                continue  # one read per re-plan, and never ahead of a cold start's load
            read.append(name)
        await asyncio.to_thread(loader.host_checkpoint, path)  # a hit only touches it
    if read or attached:
        worker._refresh_storage()
        log.info("pre-loaded %s", ", ".join([*(f"{n} (DRAM tier)" for n in read),
                                             *(f"{n} (adapter)" for n in attached)]))
    return PreloadRecord(now, chosen, tuple(read), tuple(attached))


async def preload_loop(worker: NodeWorker) -> None:
    """Re-plan every `preload_interval_s`; a failure costs one round, never the loop."""
    while not worker._stopping:
        await asyncio.sleep(worker.s.preload_interval_s)
        try:
            worker.preloads.append(await preload_once(worker))
            worker._trouble("pre-loading", None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            worker._trouble("pre-loading", exc)

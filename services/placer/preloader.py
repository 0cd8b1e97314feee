"""The placer's Pre-Loading Scheduler (ServerlessLoRA §3, §4.1): every request passes through
the placer, so it sees each backbone's and adapter's invocation rate across the cluster. Every
`interval_s` it plans with `shared.core.lora.plan_cluster_preload` which node's DRAM tier keeps
each called backbone's checkpoint and which node attaches each called adapter to a ready
instance of its backbone, and sends each node its part (`PreloadPlan`, fire and forget).

A node carries out the plan it received while it is fresh (`valid_s`) and plans from its own
admissions when none is (a placer that stopped, a lost message): services/node/preload.py.
"""

from __future__ import annotations

import logging
import time
from services.placer.port import PlacerPort
from shared import wire
from shared.cluster import read_nodes
from shared.core.lora import Artifact, CallRates, plan_cluster_preload
from shared.core.perf_model import PerfModel
from shared.core.node_scheduler import ADAPTER_LOAD_BYTES_PER_S
from shared.core.types import NodeView
from shared.schemas import InferenceRequest, ModelRecord, PreloadPlan
from shared.subjects import preload_subject

log = logging.getLogger("slinfer.placer.preload")
VALID_INTERVALS = 3  # a node follows a plan for this many intervals (two may be lost)


class ClusterPreloader:
    def __init__(self, port: PlacerPort, interval_s: float) -> None:
        self.p = port
        self.interval_s = interval_s
        self.rates = CallRates()
        self.sent: dict[str, PreloadPlan] = {}  # node -> the last plan sent to it (tests, logs)
        self._last = 0.0
        self._failing = False

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def note(self, req: InferenceRequest, now: float) -> None:
        """A new request (not a redelivery, nor a resumed copy): one call of its model and adapter."""
        if self.enabled and not req.resumed_token_ids:
            self.rates.note(req.model, req.adapter, now)

    async def turn(self) -> None:
        """Plan and send if `interval_s` passed; a failure is logged, never the placer's turn's."""
        if not self.enabled or time.monotonic() - self._last < self.interval_s:
            return
        self._last = time.monotonic()
        try:
            await self._plan_and_send()
        except Exception as exc:  # pre-loading must not stop placement
            if not self._failing:
                log.warning("cluster pre-loading failed (%r); nodes plan alone", exc)
            self._failing = True
        else:
            self._failing = False

    async def _plan_and_send(self) -> None:
        called = self.rates.called()
        if not called:
            return
        now = time.time()
        nodes = [n for n in await read_nodes(self.p.redis) if not n.draining]
        records = {r.name: r for r in await self.p.registry.list()}
        backbones, adapters = artifacts(called, records, self.rates, nodes, self.p.perf, now)
        plans = plan_cluster_preload(nodes, backbones, adapters)
        valid_s = VALID_INTERVALS * self.interval_s
        for node_id, chosen in plans.items():
            plan = PreloadPlan(node_id, now, valid_s, list(chosen.checkpoints),
                               [list(pair) for pair in chosen.adapters])
            await self.p.nc.publish(preload_subject(node_id), wire.encode(plan))
            self.sent[node_id] = plan


def artifacts(called: list[str], records: dict[str, ModelRecord], rates: CallRates,
              nodes: list[NodeView], perf: PerfModel, now: float) -> tuple[list[Artifact], list[Artifact]]:
    """The called torch-engine backbones and their called adapters, with cluster-wide rates.
    A backbone is worth its profiled cold load (the time a DRAM-tier copy saves, as the nodes
    weigh it); an adapter its bytes at the engine's adapter load rate."""
    kinds = sorted({n.hardware for n in nodes}, key=lambda h: h.value)
    backbones, adapters = [], []
    for name in called:
        record = records.get(name)
        if record is None or record.engine != "torch":
            continue
        if record.base_model is None:
            load_s = max((p.load_s for k in kinds if (p := perf.get(name, k)) is not None),
                         default=0.0)
            backbones.append(Artifact(name, record.weight_bytes, load_s, rates.rate(name, now)))
        elif record.base_model in records:
            adapters.append(Artifact(name, record.weight_bytes,
                                     record.weight_bytes / ADAPTER_LOAD_BYTES_PER_S,
                                     rates.rate(name, now), record.base_model))
    return backbones, adapters

"""The placer's Pre-Loading Scheduler (ServerlessLoRA §3, §4.1): every request passes through
the placer, so it sees each backbone's and adapter's invocation rate across the cluster. Every
`interval_s` it plans (`shared.core.preload.cluster_preload`, the function the simulator's
placer calls too) which node's DRAM tier keeps each called backbone's checkpoint and which node
attaches each called adapter to a ready instance of its backbone, and sends each node its part
(`PreloadPlan`, fire and forget). This file keeps the I/O: the registry, the nodes' views, NATS.

A node carries out the plan it received while it is fresh (`valid_s`) and plans from its own
admissions when none is (a placer that stopped, a lost message): services/node/preload.py.
"""

from __future__ import annotations

import logging
import time
from services.placer.periodic import Periodic
from services.placer.port import PlacerPort
from shared import wire
from shared.core.lora import CallRates
from shared.core.preload import Preloadable, cluster_preload, plan_valid_s
from shared.schemas import InferenceRequest, ModelRecord, PreloadPlan
from shared.subjects import preload_subject

log = logging.getLogger("slinfer.placer.preload")


class ClusterPreloader:
    def __init__(self, port: PlacerPort, interval_s: float) -> None:
        self.p = port
        self.interval_s = interval_s
        self.rates = CallRates()
        self.sent: dict[str, PreloadPlan] = {}  # node -> the last plan sent to it (tests, logs)
        self._periodic = Periodic(self._plan_and_send, interval_s, log,
                                  "cluster pre-loading failed (%r); nodes plan alone")

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def note(self, req: InferenceRequest, now: float) -> None:
        """A new request (not a redelivery, nor a resumed copy): one call of its model and adapter."""
        if self.enabled and not req.resumed_token_ids:
            self.rates.note(req.model, req.adapter, now)

    async def turn(self) -> None:
        """Plan and send if `interval_s` passed (`Periodic`)."""
        await self._periodic.turn()

    async def _plan_and_send(self) -> None:
        called = self.rates.called()
        if not called:
            return
        now = time.time()
        nodes, records = await self.p.read_turn()
        known = preloadables({r.name: r for r in records})
        plans = cluster_preload(called, known, self.rates, nodes, self.p.perf, now,
                                self.p.s.core.watermark)
        valid_s = plan_valid_s(self.interval_s)
        for node_id, chosen in plans.items():
            plan = PreloadPlan(node_id, now, valid_s, list(chosen.checkpoints),
                               [list(pair) for pair in chosen.adapters])
            await self.p.nc.publish(preload_subject(node_id), wire.encode(plan))
            self.sent[node_id] = plan


def preloadables(records: dict[str, ModelRecord]) -> dict[str, Preloadable]:
    """The registered artifacts the cluster's plan may cover: torch-engine backbones (the engine
    that loads through the node's loader and serves adapters) and their adapters."""
    return {name: Preloadable(name, r.weight_bytes, r.base_model) for name, r in records.items()
            if r.engine == "torch" and (r.base_model is None or r.base_model in records)}

"""Pinning (a model's `min_instances`): the placer keeps that many instances of it warm.

Every `interval_s` it counts each pinned model's instances in the cluster view
(`shared.core.keepalive.pin_shortfall`) and, for a model short of its minimum, publishes a
warm-up request (`shared.cluster.warm_up_request`) on the request stream: it is placed like any
request (the same core evaluation, memory ledger and node re-check), and the instance it starts
is pinned by its node from its admission on, so never reclaimed as idle. One start per model at a
time: a lease in Redis (`pin_lease_key`) keeps placers sharing the cluster from each starting
one, and lasts until the started instance shows in the nodes' views (or the lease runs out).
"""

from __future__ import annotations

import logging
import time
import uuid

from services.placer.periodic import Periodic
from services.placer.port import PlacerPort
from shared import wire
from shared.bus import publish_retrying
from shared.cluster import PIN_ID_PREFIX, warm_up_request
from shared.core.keepalive import pin_shortfall
from shared.schemas import ModelRecord
from shared.subjects import REQUEST_SUBJECT, pin_lease_key

log = logging.getLogger("slinfer.placer.pinning")
# A start not seen in the views by then (refused, failed, held while the model profiles) is
# tried again; its warm-up request gives up by then too, so two are never both pending.
LEASE_S = 15


class PinKeeper:
    def __init__(self, port: PlacerPort, interval_s: float) -> None:
        self.p = port
        self.interval_s = interval_s
        self.started: list[str] = []  # models a warm-up was sent for (tests, logs)
        self._periodic = Periodic(self._check, interval_s, log, "pinning check failed (%r); retrying")

    async def turn(self) -> None:
        """Check and start if `interval_s` passed (`Periodic`)."""
        await self._periodic.turn()

    async def _check(self) -> None:
        nodes, records = await self.p.read_turn()
        pinned = {r.name: r for r in records if r.min_instances > 0 and r.base_model is None}
        if not pinned:
            return
        short = pin_shortfall({n: r.min_instances for n, r in pinned.items()}, nodes)
        for name in pinned:
            if name not in short:
                await self.p.redis.delete(pin_lease_key(name))  # its start is in the views
                continue
            if not await self.p.redis.set(pin_lease_key(name), self.p.s.name, nx=True, ex=LEASE_S):
                continue  # a start of it is under way (this placer's or another's)
            await self._start(pinned[name], short[name])

    async def _start(self, record: ModelRecord, lacking: int) -> None:
        now = time.time()
        req = warm_up_request(record, f"{PIN_ID_PREFIX}{uuid.uuid4().hex}", now, timeout_s=LEASE_S)
        await publish_retrying(self.p.nc.jetstream(), REQUEST_SUBJECT, wire.encode(req),
                               {"Nats-Msg-Id": req.request_id})
        self.started.append(record.name)
        log.info("model %s is pinned and lacks %d instance(s): warm-up %s sent",
                 record.name, lacking, req.request_id)

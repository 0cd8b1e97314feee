"""The placer's part of λScale's scale-out (§4.2, §5): the new instances admitted in a turn that
receive their model by multicast join one multicast per (model, sources), started after the
turn and run on their own; a node whose copy does not arrive is told to load from its tiers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque

from nats.aio.client import Client as NATS

from services.placer.multicast import multicast
from shared.cluster import model_spec
from shared.core.startup import StartupChoice, StartupMethod, with_helper_stages
from shared.core.types import NodeView
from shared.schemas import ModelRecord
from shared.subjects import multicast_node_subject

log = logging.getLogger("slinfer.placer")
MULTICAST_TIMEOUT_S = 600.0  # one multicast's bound (its incomplete nodes then load from storage)

Batch = tuple[str, tuple[str, ...]]  # (model path, sources)


class ScaleOut:
    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._batches: dict[Batch, list[str]] = {}  # this turn's joins: -> destination nodes
        # ... those with a destination serving through a pipeline meanwhile: the model's head
        # goes first (execute-while-load, λScale §4.3).
        self._head_first: set[Batch] = set()
        self.running: set[asyncio.Task] = set()  # multicasts under way
        self.reports: deque = deque(maxlen=256)  # MulticastReport, newest last

    def join(self, record: ModelRecord, startup: StartupChoice, node_id: str,
             nodes: list[NodeView]) -> list[NodeView]:
        """A node admitted a new instance that receives `record` by `startup`: it joins this
        turn's multicast of the model from those sources (`start`). Returns the views with a
        pipeline helper's stage reserved."""
        if startup.method is StartupMethod.TIER:
            return nodes
        dests = self._batches.setdefault((record.path, startup.sources), [])
        if node_id not in dests:
            dests.append(node_id)
        if startup.pipeline is not None:
            self._head_first.add((record.path, startup.sources))
            nodes = with_helper_stages(nodes, model_spec(record), startup)
        return nodes

    def start(self) -> None:
        """One multicast per model (and set of sources) to the nodes that joined this turn
        (λScale §4.2: the binomial pipeline, k-way with several sources)."""
        batches, self._batches = self._batches, {}
        head_first, self._head_first = self._head_first, set()
        for (path, sources), dests in batches.items():
            task = asyncio.create_task(
                self.multicast(path, list(sources), dests, (path, sources) in head_first),
                name=f"multicast-{path}")
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def multicast(self, path: str, sources: list[str], dests: list[str],
                        head_first: bool = False) -> None:
        try:
            report = await multicast(self.nc, path, sources, dests, timeout_s=MULTICAST_TIMEOUT_S,
                                     head_first=head_first)
        except Exception as exc:  # no source could offer it: every destination reads its tiers
            log.warning("multicast of %s from %s to %s failed: %r", path, sources, dests, exc)
            await self._abandon(path, dests)
            return
        self.reports.append(report)
        log.info("multicast of %s from %s to %s: %.2f s%s", path, ",".join(report.sources),
                 ",".join(dests), report.seconds,
                 f"; failed {report.failed}" if not report.ok else "")
        await self._abandon(path, list(report.failed))

    async def _abandon(self, path: str, nodes: list[str]) -> None:
        """Nodes the model will not reach by this multicast: their loads stop waiting for it
        (an endpoint that took part knows already; one that never heard of it learns here)."""
        for node in nodes:
            try:
                await self.nc.publish(multicast_node_subject(node), json.dumps(
                    {"op": "abandon", "model_path": path}).encode())
            except Exception as exc:  # NATS down: the node gives up waiting on its own
                log.warning("could not tell %s that %s is not coming: %r", node, path, exc)

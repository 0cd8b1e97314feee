"""The warm fast path: a request for a model with an instance that takes requests goes from the
gateway straight to that instance's node, as the ADMIT a placer would send, instead of through
the request stream and a placer's decision. That is two hops and a decision less on a warm
request's path (bench/BENCHMARKS.md, "The request path": ~3 ms of ~11 on the 2-core box).

The view this picks with may be stale; safety comes from the node, which re-checks every
admission on its own state with the policy core and refuses what would break an SLO. The choice
is `shared.core.fast_path.warm_route` (the instance `place` would try first). What follows from
the node's answer:

- admitted: the request runs there; the node tells the placers (`DirectAdmission`), so their
  arrival histories (pre-warming, pre-loading, burst detection) count it.
- refused: the request goes to the placers like any other (one hop of ~1 ms lost), and its model
  is left to them for `hold_s`: a full instance would refuse the next ones too, and requests a
  placer queued for the model should get the room that frees up first.
- no answer in `timeout_s` (a lost reply, a node too busy to answer, or cut off): the node may
  have admitted it, so it goes to the placers with `asked_node`, and they ask that node before
  they place it anywhere else (the path a lost admission reply takes between placer and node).
  The node is left out of direct admissions for `hold_s`, whatever the model.
- no node listens on the subject (it is gone): to the placers at once.

Only a first attempt takes the fast path: a resumed request, or one handed back with a target,
goes to the placers, who know why it moved.

The view is every node's snapshot from Redis, read in the background every `refresh_s` (never
on a request's path), and each reply's fresher view of its node.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from shared import telemetry as tm
from shared import wire
from shared.cluster import decode_reply, read_nodes
from shared.core.fast_path import WarmRoute, warm_route
from shared.core.types import NodeView
from shared.schemas import CommandKind, InferenceRequest, NodeCommand
from shared.subjects import node_command_subject

log = logging.getLogger("slinfer.gateway")


@dataclass(frozen=True)
class DirectConfig:
    enabled: bool = True
    refresh_s: float = 0.25  # how often the cluster view is read from Redis
    # How long the node may take to answer. It answers in ~1 ms when its event loop is free; a
    # loop held up longer than this is asked again by the placer (STATUS) before anything else.
    timeout_s: float = 0.5
    # After a refusal or a silence, the model goes to the placers this long (and after a
    # silence, anything that node serves).
    hold_s: float = 1.0


class Outcome(enum.Enum):
    ADMITTED = "admitted"
    REFUSED = "refused"  # or no node listens: the placers place it
    SILENT = "silent"  # no answer: the node may run it (the placers ask it first)


class DirectRoutes:
    """Collaborators: the gateway's NATS client, Redis (the nodes' snapshots) and a meter (each
    direct admission counted by outcome; None: counted only here)."""

    def __init__(self, nc: NATS, redis: Redis, config: DirectConfig = DirectConfig(),
                 meter=None) -> None:
        self._nc, self._redis, self.config = nc, redis, config
        self._counter = None if meter is None else meter.create_counter(
            tm.GATEWAY_DIRECT_ADMISSIONS, unit="{request}",
            description="Warm requests the gateway sent straight to a node, by outcome")
        self._views: dict[str, NodeView] = {}
        self._held: dict[str, float] = {}  # model -> until when (monotonic) it goes to placers
        self._silent: dict[str, float] = {}  # node -> until when (monotonic) it is left out
        self._task: asyncio.Task | None = None
        self.counts: dict[Outcome, int] = {o: 0 for o in Outcome}

    async def start(self) -> None:
        if self.config.enabled:
            await self.refresh()
            self._task = asyncio.create_task(self._refresh_loop(), name="direct-routes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self) -> None:
        """Read every node's snapshot (Redis down: the last view stays; the nodes re-check)."""
        try:
            nodes = await read_nodes(self._redis)
        except Exception as exc:
            log.debug("cluster view not refreshed: %r", exc)
            return
        self._views = {n.node_id: n for n in nodes}

    def see(self, view: NodeView) -> None:
        """A fresher view of one node (its answer's)."""
        self._views[view.node_id] = view

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            await self.refresh()

    def pick(self, request: InferenceRequest, now: float) -> WarmRoute | None:
        """Where `request` goes directly; None: to the placers (`now`: monotonic)."""
        if not self.config.enabled or request.attempt or request.resumed_token_ids \
                or request.target_node is not None:
            return None
        if self._held.get(request.model, 0.0) > now:
            return None
        nodes = [v for v in self._views.values() if self._silent.get(v.node_id, 0.0) <= now]
        return warm_route(nodes, request.model, request.adapter)

    async def admit(self, request: InferenceRequest, route: WarmRoute,
                    headers: dict[str, str] | None) -> Outcome:
        """Send the node the ADMIT; what its answer means for the request (module docstring)."""
        cmd = NodeCommand(CommandKind.ADMIT, request=request, instance_id=route.instance_id,
                          direct=True)
        try:
            msg = await self._nc.request(node_command_subject(route.node_id), wire.encode(cmd),
                                         timeout=self.config.timeout_s, headers=headers)
            reply = decode_reply(msg.data, time.time())
        except nats.errors.NoRespondersError:
            self._views.pop(route.node_id, None)  # gone: its snapshot expires soon anyway
            return self._count(Outcome.REFUSED, request)
        except Exception as exc:  # a timeout, NATS going down, an odd answer: it may run it
            log.info("node %s did not answer the direct admission of %s: %r", route.node_id,
                     request.request_id, exc)
            self._silent[route.node_id] = time.monotonic() + self.config.hold_s
            return self._count(Outcome.SILENT, request)
        if reply.node is not None:
            self.see(reply.node)
        return self._count(Outcome.ADMITTED if reply.accepted else Outcome.REFUSED, request)

    def _count(self, outcome: Outcome, request: InferenceRequest) -> Outcome:
        self.counts[outcome] += 1
        if self._counter is not None:
            self._counter.add(1, {"outcome": outcome.value})
        if outcome is not Outcome.ADMITTED:
            self._held[request.model] = time.monotonic() + self.config.hold_s
        return outcome

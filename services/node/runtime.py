"""The node's runtime: what every part of the node worker shares and nothing more. The policy
core (`NodeScheduler`), the engines and the models they run, the checkpoint loader and the
multicast endpoint, the iteration lock, starting memory ops, spawning tasks, the node's view, and
the outbox for every NATS message. The parts (services/node/*.py) and the plug-ins (λScale
pipelines, CoCoServe layer moves, LoRA pre-loading) get this object and what else they need,
never the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from services.node.engines.base import Engine, has_adapter
from services.node.observe import NodeObserver
from services.node.outbox import Outbox
from services.node.settings import NodeSettings
from services.node.tiers import ModelNames, storage_view
from shared.core.calibration import Calibrator
from shared.core.memory import MemOp
from shared.core.node_scheduler import NodeScheduler, new_node
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, InstanceStatus, NodeView, PipelineMode
from shared.schemas import ModelRecord

if TYPE_CHECKING:
    from services.node.loader import CheckpointLoader
    from services.node.multicast import MulticastEndpoint

log = logging.getLogger("slinfer.node")


@dataclass(frozen=True)
class Arrival:
    """A model the placer is multicasting to this node (λScale §5), until a load took it."""

    model_path: str
    expected_at: float  # wall clock: when the core expects it in the DRAM tier
    since: float  # monotonic: when the node was told (an outcome before this is another transfer)
    pipeline: PipelineMode | None = None  # a new instance serves through it meanwhile (λScale)


class NodeRuntime:
    def __init__(self, settings: NodeSettings, nc: NATS, redis: Redis, obs: NodeObserver) -> None:
        self.s = settings
        self.nc, self.js, self.redis = nc, nc.jetstream(), redis
        self.obs = obs
        self.outbox = Outbox(nc, settings.node_id, obs)
        self.sched: NodeScheduler = new_node(settings.node_id, Hardware(settings.hardware),
                                             settings.memory_bytes, PerfModel(),
                                             config=settings.core,
                                             matrix_accel=settings.matrix_accel)
        node = self.sched.node  # what the placer and the admin API see of this node's hardware
        node.hardware_name, node.cores = settings.hardware_name, settings.cores
        node.accel_flags = list(settings.accel_flags)
        self.engines: dict[str, Engine] = {}
        self.records: dict[str, ModelRecord] = {}  # instance id -> the model it runs
        # The measured profiles as stored; sched.perf is the same with the online calibration.
        self.base_perf = PerfModel()
        self.calibrator = Calibrator()
        # The node's checkpoint loader (made in start(): it measures memory bandwidth): every
        # engine loads through it, so an unloaded model's checkpoint stays in its DRAM tier.
        self.loader: CheckpointLoader | None = None
        self.multicast: MulticastEndpoint | None = None  # sends and receives models (λScale)
        self.model_names = ModelNames()  # the loader's model directories -> registered names
        self.arriving: dict[str, Arrival] = {}  # model name -> its multicast to this node
        # Held by the token loop across choosing and running an iteration: a live migration
        # stops a request, or computes a migrating request's KV, between two iterations.
        self.iter_lock = asyncio.Lock()
        self.wake = asyncio.Event()  # something for the token loop to do
        self.stopping = False
        self.draining = False  # an operator drains this node: no new work, requests move off
        # Instances whose engine is changing its layers now: their memory ops wait (an engine's
        # K/V pool must not be resized while its layers' K/V moves).
        self.moving: set[str] = set()
        self.background: set[asyncio.Task] = set()
        self._outage: dict[str, bool] = {}  # what is failing now (logged once per outage)
        self._launch: Callable[[MemOp], None] | None = None

    # --- tasks and memory ops -------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.background.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self.background.discard)
        return task

    def bind_memops(self, launch: Callable[[MemOp], None]) -> None:
        """The memory-op executor (services/node/memops.py) that `start_ops` hands ops to."""
        self._launch = launch

    def start_ops(self, ops: Iterable[MemOp]) -> None:
        """Execute the memory ops the core issued (each in its own task)."""
        for op in ops:
            self._launch(op)

    def trouble(self, what: str, exc: BaseException | None) -> None:
        """Log a failing dependency once when it starts failing and once when it works again."""
        if exc is not None and not self._outage.get(what):
            log.warning("%s failing: %r; retrying", what, exc)
        elif exc is None and self._outage.get(what):
            log.info("%s works again", what)
        self._outage[what] = exc is not None

    # --- instances --------------------------------------------------------------------------------
    def loaded(self, instance_id: str) -> bool:
        """The engine is usable only once its LOAD completion came back through the stream: the
        load thread publishes the engine object a little earlier than that."""
        inst = self.sched.node.instance(instance_id)
        return instance_id in self.engines and inst is not None and \
            inst.status in (InstanceStatus.READY, InstanceStatus.HANDOVER)

    def adapter_ready(self, instance_id: str, adapter: str | None) -> bool:
        return has_adapter(self.engines.get(instance_id), adapter)

    async def changing(self, iid: str, change: Callable[..., object], *args) -> Exception | None:
        """Run an engine's layer change between two iterations, with no memory op of the
        instance running meanwhile; the exception it raised, if any (a running memory op:
        a RuntimeError starting with "busy")."""
        async with self.iter_lock:
            if any(op.instance_id == iid for op in self.sched.ledger.running()):
                return RuntimeError("busy: a memory op of the instance is running")
            self.moving.add(iid)
            try:
                await asyncio.to_thread(change, *args)
            except Exception as exc:  # the engine changed nothing it could not keep
                return exc
            finally:
                self.moving.discard(iid)
        return None

    async def unmoved(self, instance_id: str) -> None:
        """(Before a memory op runs) Wait while the instance's layers are moving."""
        while instance_id in self.moving:
            await asyncio.sleep(0.005)

    # --- the node's view ----------------------------------------------------------------------
    def multicast_link(self) -> float:
        """The link the core plans multicasts to and from this node with: measured on received
        blocks, else declared; 0 without an endpoint or a DRAM tier to hold a model in."""
        if self.multicast is None or self.s.loader.dram_cache_bytes <= 0:
            return 0.0
        return self.multicast.link_bytes_per_s() or self.s.multicast_link_bytes_per_s

    def refresh_storage(self) -> None:
        """The loader's tiers into the node's view: the core's cold starts on this node and the
        placers' (through the published view) take q + n/b from them."""
        if self.loader is not None:
            now = time.time()
            self.sched.node.storage = replace(
                storage_view(self.loader.tiers_report(), self.model_names.names),
                arriving={m: max(0.0, a.expected_at - now) for m, a in self.arriving.items()},
                pipelines={m: a.pipeline for m, a in self.arriving.items() if a.pipeline},
                multicast_bytes_per_s=self.multicast_link())

    def view(self) -> NodeView:
        self.refresh_storage()
        view = self.sched.view()
        view.heartbeat = time.time()
        view.draining = self.draining
        return view

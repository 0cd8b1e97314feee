"""The node worker: owns engine instances on one CPU socket or GPU and runs them at token
granularity under the policy core's `NodeScheduler`.

This is the node's composition root: it builds the runtime (services/node/runtime.py: the core,
engines, loader, iteration lock, memory ops, tasks, the view, the outbox) and the parts, each in
its own file with one job, and wires them to NATS subjects and tasks:

- command intake (`intake.py`): one dispatch table from command kind to handler, one error
  wrapper; admission (`admission.py`); live migration's source (`migration_source.py`) and
  destination (`migration_destination.py`);
- the token loop (`token_loop.py`: step -> run -> postprocess) over the request book (`book.py`,
  with its pure rules) and what happens to a request (`lifecycle.py`);
- memory-op execution (`memops.py`, by op kind, engines from an injectable factory), whose
  completions come back through the JetStream reservation-station stream;
- cluster sync (`cluster_sync.py`: heartbeat, registry, profiles, calibration), LoRA adapters
  (`adapters.py`), and the plug-ins: λScale pipelines (`pipeline_mode.py`), CoCoServe layer moves
  (`layer_moves.py`), LoRA pre-loading (`preload.py`), the multicast endpoint (`multicast.py`).

Faults: a Redis or NATS error never stops the token loop or the heartbeat (each catches, logs once
per outage, and goes on; the next heartbeat re-publishes the node's view, also into an emptied
Redis). The memory-op consumer is an ordered consumer that re-creates itself after a NATS restart,
and a completion that cannot be published is applied here directly. The node remembers the
requests it recently finished or handed back (`RequestBook.recent`), so a gateway that missed a
final message can ask for it (STATUS) and a redelivered admission of a finished request is not
run twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy
from redis.asyncio import Redis

from services.node.adapters import Adapters
from services.node.admission import Admission
from services.node.book import Incoming, Live, RequestBook
from services.node.cluster_sync import ClusterSync
from services.node.engines.base import Engine
from services.node.intake import CommandIntake
from services.node.layer_moves import LAYER_KINDS, LayerMoves
from services.node.lifecycle import RequestLifecycle
from services.node.load_failure import LoadFailures
from services.node.load_record import LoadRecord
from services.node.memops import EngineFactory, MemOps
from services.node.migration_destination import MigrationDestination
from services.node.migration_source import MigrationSource
from services.node.observe import NodeObserver
from services.node.pipeline_mode import PipelineStarts
from services.node.preload import PreloadRecord, Preloader
from services.node.runtime import Arrival, NodeRuntime
from services.node.settings import NodeSettings
from services.node.token_loop import IterationRecord, TokenLoop
from shared import telemetry as tm
from shared.bus import START_RETRY_S, ensure_streams, retrying
from shared.cluster import publish_node, remove_calibration, remove_node
from shared.core.calibration import Calibrator
from shared.core.migration import MigrationLog, MigrationPolicy
from shared.core.node_scheduler import NodeScheduler
from shared.schemas import CommandKind, ModelRecord, NodeReply
from shared.subjects import CANCEL_SUBJECT, memop_subject, node_command_subject
from shared.tasks import cancel_and_wait

log = logging.getLogger("slinfer.node")
STOP_HAND_BACK_S = 5.0  # a stopping node retries handing a request back this long (an election)
MEMOP_HEARTBEAT_S = 1.0  # the memory-op consumer's idle heartbeat: re-created ~2 s after a restart


def warm_imports() -> None:
    import services.node.engines.torch_engine  # noqa: F401  (torch, transformers)
    import transformers.models.llama.modeling_llama  # noqa: F401


class NodeWorker:
    def __init__(self, settings: NodeSettings, nc: NATS, redis: Redis,
                 telemetry: tm.Telemetry | None = None,
                 engine_factory: EngineFactory | None = None) -> None:
        # Spans of requests, commands and memory ops; gauges for /metrics and OTLP.
        obs = NodeObserver(telemetry or tm.local("node"), settings.node_id, settings.hardware)
        self.rt = rt = NodeRuntime(settings, nc, redis, obs)
        self.book = book = RequestBook()
        self.requests = requests = RequestLifecycle(rt, book)
        failures = LoadFailures(rt, requests)  # a failed load told by its cause
        self.adapters = adapters = Adapters(rt, book, requests, failures)
        self.pipelines = PipelineStarts(rt)  # execute-while-load (λScale)
        self.layers = LayerMoves(rt, self.pipelines)  # CoCoServe: layers hosted here or moved
        self.memops = memops = MemOps(rt, book, requests, adapters, self.layers, self.pipelines,
                                      failures, engine_factory)
        self.sync = sync = ClusterSync(rt, self.layers.tend, self._sample)
        self.source = source = MigrationSource(rt, book, requests, sync.publish_view)
        self.destination = dest = MigrationDestination(rt, book, requests, adapters, memops, sync,
                                                       source.policy)
        self.admission = admission = Admission(rt, book, requests, adapters, memops, sync, source)
        self.token_loop = TokenLoop(rt, book, requests, sync)
        self.preloader = Preloader(rt, sync.backbones, adapters.records)
        self.intake = CommandIntake(
            rt, book,
            handlers={CommandKind.ADMIT: admission.admit,
                      CommandKind.START_INSTANCE: admission.start_instance,
                      CommandKind.PREEMPT_ADMIT: admission.preempt_admit,
                      CommandKind.MIGRATE: source.start_migrations,
                      CommandKind.DRAIN: source.start_drain,
                      CommandKind.UNLOAD_MODEL: memops.unload_model},
            spawned={**dest.handlers, **{kind: self.layers.handle for kind in LAYER_KINDS}},
            cleanups={kind: dest.cleanup for kind in dest.handlers},
            with_instance=LAYER_KINDS)
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        rt, s = self.rt, self.rt.s
        # Import the engine stack now, not inside the first cold start (it takes seconds).
        await asyncio.to_thread(warm_imports)
        rt.loader = await asyncio.to_thread(self._new_loader)
        self.pipelines.start()
        self.layers.start()
        await self._start_multicast()
        await ensure_streams(rt.js, s.stream_replicas)
        await self.sync.load_profiles()
        await self.sync.read_registry()
        await rt.nc.subscribe(node_command_subject(s.node_id), cb=self.intake.on_command)
        await rt.nc.subscribe(CANCEL_SUBJECT, cb=self.intake.on_cancel)
        # The reservation station's input: this node's memory-op completions, from the stream.
        # An ordered consumer: it lives in the server's memory, and the client re-creates it from
        # the last sequence it saw when its heartbeats stop (a nats-server restart).
        await retrying(lambda: rt.js.subscribe(
            memop_subject(s.node_id), cb=self.memops.on_done, deliver_policy=DeliverPolicy.NEW,
            ordered_consumer=True, idle_heartbeat=MEMOP_HEARTBEAT_S), "the memory-op stream",
            within_s=START_RETRY_S)  # a cluster that is still electing answers late
        await publish_node(rt.redis, rt.view(), ttl_s=s.heartbeat_s * 12)
        await self.sync.join_profiling()
        self._sample()
        await rt.obs.start(s.metrics_port, s.hosts.bind)
        self._tasks = [asyncio.create_task(self.token_loop.run(), name="token-loop"),
                       asyncio.create_task(self.sync.heartbeat(), name="heartbeat")]
        if s.preload_interval_s > 0:
            self._tasks.append(asyncio.create_task(self.preloader.run(), name="preload"))
        for task in self._tasks:
            task.add_done_callback(self._task_ended)
        log.info("node %s (%s, %s) ready: %.1f GiB, matrix accel %s", s.node_id, s.hardware,
                 s.hardware_name, s.memory_bytes / 2**30, s.matrix_accel)

    async def stop(self) -> None:
        rt = self.rt
        rt.stopping = rt.outbox.closed = True
        rt.wake.set()
        # Migrations and a drain too; cancelled again until they end (shared.tasks).
        await cancel_and_wait(*self._tasks, *rt.background, retry_s=1.0, give_up_s=10.0)
        for live in list(self.book.live.values()):  # they resume elsewhere, from their tokens
            await self.requests.leave(live, within_s=STOP_HAND_BACK_S)
        await rt.obs.close()
        if rt.multicast is not None:
            await rt.multicast.stop()
        await self.layers.close()
        if rt.loader is not None:  # loads still running in threads fail; the node is going
            await asyncio.to_thread(rt.loader.close)
        try:
            await remove_node(rt.redis, rt.s.node_id)
            await remove_calibration(rt.redis, rt.s.node_id)
        except Exception as exc:  # Redis down: the snapshot expires on its own
            log.warning("could not remove node %s from Redis: %r", rt.s.node_id, exc)

    def _task_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self.rt.stopping:
            log.critical("node task %s died", task.get_name(), exc_info=task.exception())

    def _sample(self) -> None:
        self.rt.obs.sample(self.rt.sched, len(self.book.live), self.token_loop.iterations)

    def _new_loader(self):
        from services.node.loader import CheckpointLoader

        return CheckpointLoader(self.rt.s.loader)

    async def _start_multicast(self) -> None:
        """The node's multicast endpoint (services/node/multicast.py) on the node's NATS
        connection and loader: it sends what the DRAM tier holds and receives into it."""
        s = self.rt.s
        if not s.multicast:
            return
        from services.node.multicast import MulticastEndpoint

        endpoint = MulticastEndpoint(self.rt.nc, s.node_id, self.rt.loader, s.multicast_host,
                                     s.multicast_port, advertise_host=s.multicast_advertise_host,
                                     rate_bytes_per_s=s.multicast_rate_bytes_per_s)
        await endpoint.start()
        self.rt.multicast = endpoint
        log.info("node %s: multicast endpoint at %s:%d", s.node_id, *endpoint.address)

    # --- what tests, benchmarks and the admin view read (the parts own it) --------------------
    def status(self, request_id: str, attempt: int = 0) -> NodeReply:
        return self.book.status(request_id, attempt)

    async def migrate_out(self, rid: str, node_id: str, instance_id: str | None) -> MigrationLog:
        return await self.source.migrate_out(rid, node_id, instance_id)

    @property
    def s(self) -> NodeSettings:
        return self.rt.s

    @property
    def sched(self) -> NodeScheduler:
        return self.rt.sched

    @property
    def engines(self) -> dict[str, Engine]:
        return self.rt.engines

    @property
    def records(self) -> dict[str, ModelRecord]:
        return self.rt.records

    @property
    def loader(self):
        return self.rt.loader

    @property
    def multicast(self):
        return self.rt.multicast

    @property
    def arriving(self) -> dict[str, Arrival]:
        return self.rt.arriving

    @property
    def calibrator(self) -> Calibrator:
        return self.rt.calibrator

    @property
    def obs(self) -> NodeObserver:
        return self.rt.obs

    @property
    def draining(self) -> bool:
        return self.rt.draining

    @property
    def stopped(self) -> bool:
        """stop() was called."""
        return self.rt.stopping

    @property
    def live(self) -> dict[str, Live]:
        return self.book.live

    @property
    def incoming(self) -> dict[str, Incoming]:
        return self.book.incoming

    @property
    def history(self) -> deque[IterationRecord]:
        return self.token_loop.history

    @property
    def iterations(self) -> int:
        return self.token_loop.iterations

    @property
    def loads(self) -> deque[LoadRecord]:
        return self.memops.loads

    @property
    def migrations(self) -> deque[MigrationLog]:
        return self.source.migrations

    @property
    def migration_policy(self) -> MigrationPolicy:
        return self.source.policy

    @property
    def preloads(self) -> deque[PreloadRecord]:
        return self.preloader.records

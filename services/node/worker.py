"""The node worker: owns engine instances on one CPU socket or GPU and runs them at token
granularity under the policy core's `NodeScheduler`.

Handlers only decode, call the core, and encode; the token loop executes the core's `StepPlan`;
memory operations run in threads and report completion through the JetStream reservation-station
stream, whose consumer feeds them back to the core (which releases parked scale-ups).

Faults: a Redis or NATS error never stops the token loop or the heartbeat (each catches, logs once
per outage, and goes on; the next heartbeat re-publishes the node's view, also into an emptied
Redis). The memory-op consumer is an ordered consumer that re-creates itself after a NATS restart,
and a completion that cannot be published is applied here directly. The node remembers the
requests it recently finished or handed back (`recent`), so a gateway that missed a final message
can ask for it (STATUS) and a redelivered admission of a finished request is not run twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from redis.asyncio import Redis

from services.node.engines import KVCacheFull, SamplingParams, create_engine, resolve_engine
from services.node.engines.base import Engine
from services.node.layer_moves import LAYER_KINDS, LayerMoves
from services.node.observe import NodeObserver
from services.node.pipeline_mode import PipelineStarts
from services.node.preload import PreloadRecord, preload_loop
from shared.schemas import PreloadPlan
from services.node.settings import NodeSettings
from services.node.tiers import ModelNames, model_key, storage_view
from shared import telemetry as tm
from shared import wire
from shared.bus import ensure_streams
from shared.core.migration import (MigrationLog, MigrationPolicy, Next, choose_destination,
                                   engine_refusal, next_step)
from shared.cluster import (load_perf, model_spec, publish_node, read_nodes, remove_calibration,
                            remove_node, request_view, save_calibration)
from shared.core.calibration import DECODE, PREFILL, Calibrator
from shared.core.evaluate import load_seconds
from shared.core.iteration import IterationKind, predict_seconds
from shared.core.memory import MemOp, MemOpKind
from shared.core.node_scheduler import AdmitResult, Eviction, NodeScheduler, StepPlan, new_node
from shared.core.perf_model import PerfModel
from shared.core.types import (AdapterSpec, Hardware, InstanceStatus, PipelineMode, RequestView,
                               adapter_owner)
from shared.model_state import profile_joining_kind
from shared.registry import ModelRegistry
from shared.schemas import (CancelNotice, CommandKind, FinishReason, InferenceRequest,
                            MemOpCompletion, MigrationTarget, ModelRecord, NodeCommand, NodeReply,
                            RequestState, TokenMessage)
from shared.subjects import (CANCEL_SUBJECT, REQUEST_SUBJECT, memop_subject,
                             node_command_subject, token_subject)

if TYPE_CHECKING:
    from services.node.loader import CheckpointLoader
    from services.node.multicast import MulticastEndpoint

log = logging.getLogger("slinfer.node")
HISTORY_LEN = 4096
RECENT_LEN = 4096  # finished or handed-back requests remembered for STATUS and redeliveries
REDIS_TIMEOUT_S = 5.0  # one heartbeat's Redis work; a hung Redis must not hang the heartbeat
MEMOP_HEARTBEAT_S = 1.0  # the memory-op consumer's idle heartbeat: re-created ~2 s after a restart
# A load waiting for its model to arrive by multicast gives up (and reads its tiers) after
# this many times the expected arrival, and never sooner than ARRIVAL_MIN_WAIT_S.
ARRIVAL_PATIENCE = 3.0
ARRIVAL_MIN_WAIT_S = 30.0


@dataclass(frozen=True)
class Arrival:
    """A model the placer is multicasting to this node (λScale §5), until a load took it."""

    model_path: str
    expected_at: float  # wall clock: when the core expects it in the DRAM tier
    since: float  # monotonic: when the node was told (an outcome before this is another transfer)
    pipeline: PipelineMode | None = None  # a new instance serves through it meanwhile (λScale)


@dataclass(frozen=True)
class IterationRecord:
    """One executed iteration, kept in a bounded history (tests, debugging, metrics)."""

    started: float
    finished: float
    instance_id: str
    kind: IterationKind
    request_ids: tuple[str, ...]
    considered: tuple[tuple[str, float], ...]  # runnable instances and their least headroom


@dataclass
class Live:
    """A request this node owns."""

    request: InferenceRequest
    instance_id: str
    output: list[int] = field(default_factory=list)  # resumed tokens + tokens generated here
    cancelled: bool = False
    in_engine: bool = False  # added to its engine (once the instance's load completed)
    # The engine refused it (add_request raised): the token loop fails it with this error. It
    # was admitted, so it ends with an error final, never also a refusal; others are unharmed.
    error: str | None = None

    @property
    def all_tokens(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output]


@dataclass
class Incoming:
    """A request migrating here (live migration, destination side) before its commit."""

    request: InferenceRequest
    instance_id: str
    # Its place in the core, held out of the instance's batches until the commit (the core
    # admitted it, so its memory stays counted, but nothing here may decode it yet).
    view: RequestView
    known: list[int]  # output tokens whose KV this node has computed
    pending: int | None = None  # the token the last prefill/extend sampled (next after `known`)
    cancelled: bool = False

    @property
    def all_tokens(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.known]


@dataclass(frozen=True)
class Past:
    """A request that was live here and is not any more."""

    attempt: int
    state: RequestState  # FINISHED or MOVED
    tokens: int  # its output length when it left (resumed tokens included)
    final: TokenMessage | None = None  # FINISHED: the final message sent


@dataclass
class LoadRecord:
    """One instance's load: what the core expected when it admitted the cold start, and what
    the engine and the node's checkpoint loader then did (tests, debugging, the admin view)."""

    instance_id: str
    model: str
    admitted_at: float
    # The tier the node's StorageView said holds the checkpoint (None: the node reported no
    # tiers then) and the core's load time from it: n/b + the engine's start-up, or the
    # profile's measured load_s (no tiers, or a tier with no bandwidth figure).
    expected_tier: str | None
    expected_s: float
    tier: str | None = None  # the loader's tier that served it (None: not through the loader)
    seconds: float | None = None  # the engine's whole load (None: not done)
    loader_seconds: float | None = None  # the loader's part of it
    bytes: int = 0  # checkpoint bytes the loader moved
    ok: bool | None = None  # None while loading


MIGRATION_KINDS = frozenset({CommandKind.MIGRATE_BEGIN, CommandKind.MIGRATE_EXTEND,
                             CommandKind.MIGRATE_COMMIT, CommandKind.MIGRATE_ABORT})


def sampling_params(req: InferenceRequest, output_len: int) -> SamplingParams:
    """The engine's parameters for a request that already has `output_len` output tokens
    (resumed or migrated: they count toward min_tokens)."""
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                          seed=req.seed, eos_token_ids=tuple(req.eos_token_ids), top_k=req.top_k,
                          repetition_penalty=req.repetition_penalty,
                          min_tokens=max(0, req.min_tokens - output_len), ignore_eos=req.ignore_eos,
                          adapter=req.adapter)


def warm_imports() -> None:
    import services.node.engines.torch_engine  # noqa: F401  (torch, transformers)
    import transformers.models.llama.modeling_llama  # noqa: F401


class NodeWorker:
    def __init__(self, settings: NodeSettings, nc: NATS, redis: Redis,
                 telemetry: tm.Telemetry | None = None) -> None:
        self.s = settings
        self.nc, self.js, self.redis = nc, nc.jetstream(), redis
        self.sched: NodeScheduler = new_node(settings.node_id, Hardware(settings.hardware),
                                             settings.memory_bytes, PerfModel(), config=settings.core,
                                             matrix_accel=settings.matrix_accel)
        node = self.sched.node  # what the placer and the admin API see of this node's hardware
        node.hardware_name, node.cores = settings.hardware_name, settings.cores
        node.accel_flags = list(settings.accel_flags)
        self.engines: dict[str, Engine] = {}
        # The measured profiles as stored; sched.perf is the same with the online calibration.
        self.base_perf = PerfModel()
        self.calibrator = Calibrator()
        self._published_seen: dict[str, dict[str, float]] = {}  # model -> `seen` as published
        self.records: dict[str, ModelRecord] = {}
        self.adapter_records: dict[str, ModelRecord] = {}  # LoRA (issue 12): adapters by id
        # Backbones (models that are not adapters) this node was asked for, by name, while the
        # registry holds them: what pre-loading plans over (services/node/preload.py).
        self.backbones: dict[str, ModelRecord] = {}
        self.preloads: deque[PreloadRecord] = deque(maxlen=HISTORY_LEN)
        # The placer's latest pre-loading plan for this node and when it came (monotonic).
        self.cluster_preload: tuple[float, PreloadPlan] | None = None
        self.live: dict[str, Live] = {}
        self.ops: dict[int, MemOp] = {}
        self.wake = asyncio.Event()
        self.iterations = 0
        self.history: deque[IterationRecord] = deque(maxlen=HISTORY_LEN)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._born = time.time()  # memory-op completions from an earlier life of this node id are ignored
        self.recent: OrderedDict[str, Past] = OrderedDict()  # request id -> what became of it
        self._outage: dict[str, bool] = {}  # what is failing now (logged once per outage)
        # Spans of requests, commands and memory ops; gauges for /metrics and OTLP.
        self.obs = NodeObserver(telemetry or tm.local("node"), settings.node_id, settings.hardware)
        # Held by the token loop across choosing and running an iteration: a live migration
        # stops a request, or computes a migrating request's KV, between two iterations.
        self._iter_lock = asyncio.Lock()
        self.draining = False  # an operator drains this node: no new work, requests move off
        self.migration_policy = MigrationPolicy()
        self.incoming: dict[str, Incoming] = {}  # live migrations to this node, before commit
        self.migrating: set[str] = set()  # requests this node is migrating away now
        self.migrations: deque[MigrationLog] = deque(maxlen=HISTORY_LEN)  # as source, ended
        self._background: set[asyncio.Task] = set()
        self._held: dict[str, RequestView | None] = {}  # stopped for a commit, not yet answered
        # The node's checkpoint loader (made in start(): it measures memory bandwidth): every
        # engine loads through it, so an unloaded model's checkpoint stays in its DRAM tier.
        self.loader: CheckpointLoader | None = None
        self.model_names = ModelNames()  # the loader's model directories -> registered names
        self.loads: deque[LoadRecord] = deque(maxlen=HISTORY_LEN)
        self._loading: dict[str, LoadRecord] = {}  # instance id -> its load, until it ends
        self._joined = False  # queued the profiling jobs this node's hardware kind lacks
        self.multicast: MulticastEndpoint | None = None  # sends and receives models (λScale)
        self.arriving: dict[str, Arrival] = {}  # model name -> its multicast to this node
        self.pipelines = PipelineStarts(self)  # execute-while-load (services/node/pipeline_mode.py)
        self.layers = LayerMoves(self)  # CoCoServe: layers hosted here, own layers moved

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        # Import the engine stack now, not inside the first cold start (it takes seconds).
        await asyncio.to_thread(warm_imports)
        self.loader = await asyncio.to_thread(self._new_loader)
        self.pipelines.start()
        self.layers.start()
        await self._start_multicast()
        await ensure_streams(self.js)
        await self._load_profiles()
        await self._read_registry()
        await self.nc.subscribe(node_command_subject(self.s.node_id), cb=self._on_command)
        await self.nc.subscribe(CANCEL_SUBJECT, cb=self._on_cancel)
        # The reservation station's input: this node's memory-op completions, from the stream.
        # An ordered consumer: it lives in the server's memory, and the client re-creates it from
        # the last sequence it saw when its heartbeats stop (a nats-server restart).
        await self.js.subscribe(memop_subject(self.s.node_id), cb=self._on_memop_done,
                                deliver_policy=DeliverPolicy.NEW, ordered_consumer=True,
                                idle_heartbeat=MEMOP_HEARTBEAT_S)
        await publish_node(self.redis, self._view(), ttl_s=self.s.heartbeat_s * 12)
        await self._join_profiling()
        await self.obs.start(self, self.s.metrics_port)
        self._tasks = [asyncio.create_task(self._token_loop(), name="token-loop"),
                       asyncio.create_task(self._heartbeat(), name="heartbeat")]
        if self.s.preload_interval_s > 0:
            self._tasks.append(asyncio.create_task(preload_loop(self), name="preload"))
        for task in self._tasks:
            task.add_done_callback(self._task_ended)
        log.info("node %s (%s, %s) ready: %.1f GiB, matrix accel %s", self.s.node_id,
                 self.s.hardware, self.s.hardware_name, self.s.memory_bytes / 2**30, self.s.matrix_accel)

    async def stop(self) -> None:
        self._stopping = True
        self.wake.set()
        pending = {*self._tasks, *self._background}  # migrations and a drain too
        for _ in range(10):
            if not pending:
                break
            # Cancelled again until they end: Python 3.11's wait_for can swallow a cancellation
            # that arrives as its inner call completes (the heartbeat's Redis write, every beat).
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        for live in list(self.live.values()):
            await self._finish(live, FinishReason.ERROR, "node shutting down")
        await self.obs.close()
        if self.multicast is not None:
            await self.multicast.stop()
        await self.layers.close()
        if self.loader is not None:  # loads still running in threads fail; the node is going
            await asyncio.to_thread(self.loader.close)
        try:
            await remove_node(self.redis, self.s.node_id)
            await remove_calibration(self.redis, self.s.node_id)
        except Exception as exc:  # Redis down: the snapshot expires on its own
            log.warning("could not remove node %s from Redis: %r", self.s.node_id, exc)

    def _task_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self._stopping:
            log.critical("node task %s died", task.get_name(), exc_info=task.exception())

    def _trouble(self, what: str, exc: BaseException | None) -> None:
        """Log a failing dependency once when it starts failing and once when it works again."""
        if exc is not None and not self._outage.get(what):
            log.warning("%s failing: %r; retrying", what, exc)
        elif exc is None and self._outage.get(what):
            log.info("%s works again", what)
        self._outage[what] = exc is not None

    def _new_loader(self) -> CheckpointLoader:
        from services.node.loader import CheckpointLoader

        return CheckpointLoader(self.s.loader)

    async def _start_multicast(self) -> None:
        """The node's multicast endpoint (services/node/multicast.py) on the node's NATS
        connection and loader: it sends what the DRAM tier holds and receives into it."""
        if not self.s.multicast:
            return
        from services.node.multicast import MulticastEndpoint

        endpoint = MulticastEndpoint(self.nc, self.s.node_id, self.loader, self.s.multicast_host,
                                     self.s.multicast_port,
                                     advertise_host=self.s.multicast_advertise_host,
                                     rate_bytes_per_s=self.s.multicast_rate_bytes_per_s)
        await endpoint.start()
        self.multicast = endpoint
        log.info("node %s: multicast endpoint at %s:%d", self.s.node_id, *endpoint.address)

    def _multicast_link(self) -> float:
        """The link the core plans multicasts to and from this node with: measured on received
        blocks, else declared; 0 without an endpoint or a DRAM tier to hold a model in."""
        if self.multicast is None or self.s.loader.dram_cache_bytes <= 0:
            return 0.0
        return self.multicast.link_bytes_per_s() or self.s.multicast_link_bytes_per_s

    async def _heartbeat(self) -> None:
        """Publish the node's view; pick up new profiles (and the registry's model names) every
        few seconds. A Redis error costs a beat, never the loop: once Redis answers again
        (restarted, even empty) the next beat puts the node back in the cluster view."""
        last_perf = time.monotonic()
        while not self._stopping:
            try:
                if time.monotonic() - last_perf > self.s.profile_refresh_s:
                    await asyncio.wait_for(self._load_profiles(), REDIS_TIMEOUT_S)
                    await asyncio.wait_for(self._read_registry(), REDIS_TIMEOUT_S)
                    if not self._joined:
                        await asyncio.wait_for(self._join_profiling(), REDIS_TIMEOUT_S)
                    last_perf = time.monotonic()
                await asyncio.wait_for(publish_node(self.redis, self._view(),
                                                    ttl_s=self.s.heartbeat_s * 12), REDIS_TIMEOUT_S)
                await self._confirm_calibrations()
                await asyncio.wait_for(self.layers.tend(), REDIS_TIMEOUT_S)
                self._trouble("heartbeat (Redis)", None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._trouble("heartbeat (Redis)", exc)
            self.obs.sample(self)
            await asyncio.sleep(self.s.heartbeat_s)

    async def _confirm_calibrations(self) -> None:
        """Republish a correction whose model ran since it was last published, with when: the
        placers hold a confirmed correction and fade one that nothing has run to confirm (see
        shared.core.calibration). One write per corrected, running model per beat."""
        if not self.s.calibrate:
            return
        for model in self.calibrator.models():
            if self.calibrator.corrected(model) and \
                    self.calibrator.seen(model) != self._published_seen.get(model):
                await asyncio.wait_for(self._publish_calibration(model, quiet=True), REDIS_TIMEOUT_S)

    async def _load_profiles(self) -> None:
        base = await load_perf(self.redis, calibrate=False)
        perf = await load_perf(self.redis, config=self.calibrator.config)
        if not perf.profiles and self.sched.perf.profiles:
            # Redis came back empty: decide with the profiles we had until they are restored.
            return
        self.base_perf, self.sched.perf = base, perf

    async def _read_registry(self) -> None:
        """The registry's names of model directories, for the tiers report. A checkpoint the
        local disk tier kept from an earlier run is known by its key only: those keys are
        computed (file metadata) when the disk tier holds such a checkpoint."""
        records = await ModelRegistry(self.redis).list()
        registered = {r.name: r for r in records}
        self.backbones = {n: registered[n] for n in self.backbones if n in registered}
        loader = self.loader
        stray = False
        if loader is not None:
            paths = {model_key(r.path) for r in records}
            stray = any(model_key(m.model_path) not in paths
                        for t in loader.tiers_report().tiers if t.name == "disk" for m in t.models)
        await asyncio.to_thread(self.model_names.set_registry, records,
                                loader.key_of if stray and loader is not None else None)

    async def _join_profiling(self) -> None:
        """This node's hardware kind joins the cluster: the models servable elsewhere with no
        profile of this kind get a profiling job (`shared.model_state.profile_joining_kind`;
        another node of the kind that did it first leaves nothing to do). Retried by the
        heartbeat until it went through once."""
        try:
            records = await ModelRegistry(self.redis).list()
            queued = await profile_joining_kind(self.js, self.redis, self.s.hardware, records)
        except Exception as exc:
            log.warning("could not check which models lack a %s profile (%r); retrying",
                        self.s.hardware, exc)
            return
        self._joined = True
        if queued:
            log.info("node %s: %s has no %s profile yet; profiling queued", self.s.node_id,
                     ", ".join(queued), self.s.hardware)

    def _refresh_storage(self) -> None:
        """The loader's tiers into the node's view: the core's cold starts on this node and the
        placers' (through the published view) take q + n/b from them."""
        if self.loader is not None:
            now = time.time()
            self.sched.node.storage = replace(
                storage_view(self.loader.tiers_report(), self.model_names.names),
                arriving={m: max(0.0, a.expected_at - now) for m, a in self.arriving.items()},
                pipelines={m: a.pipeline for m, a in self.arriving.items() if a.pipeline},
                multicast_bytes_per_s=self._multicast_link())

    def _view(self):
        self._refresh_storage()
        view = self.sched.view()
        view.heartbeat = time.time()
        view.draining = self.draining
        return view

    # --- commands (placer -> node) -----------------------------------------------------------
    async def _on_command(self, msg: Msg) -> None:
        try:
            cmd: NodeCommand | None = wire.decode(NodeCommand, msg.data)
        except wire.WireError as exc:
            cmd, bad = None, exc
        if cmd is not None and cmd.kind is CommandKind.STATUS:  # gateways poll it: no span
            await self._respond(msg, self.status(cmd.request_id or "", cmd.attempt))
            return
        if cmd is not None and cmd.kind in MIGRATION_KINDS:
            # A round may wait for a load and a long prefill: answered from its own task, so
            # this subscription goes on taking the placer's commands meanwhile.
            self._spawn(self._migration_command(msg, cmd), f"{cmd.kind.value}-{cmd.request_id}")
            return
        if cmd is not None and cmd.kind in LAYER_KINDS:  # CoCoServe (services/node/layer_moves.py)
            self.layers.command(msg, cmd)
            return
        with self.obs.command(msg.headers) as command:  # child of the placer's decision
            kind = "unknown"
            try:
                if cmd is None:
                    raise bad
                kind = cmd.kind.value
                if cmd.kind is CommandKind.MIGRATE:
                    reply = self._start_migrations(cmd)
                elif cmd.kind is CommandKind.DRAIN:
                    reply = self._start_drain()
                elif self.draining:
                    reply = NodeReply(False, "draining")
                elif cmd.kind is CommandKind.ADMIT:
                    reply = await self._admit(cmd)
                elif cmd.kind is CommandKind.START_INSTANCE:
                    reply = await self._start_instance(cmd)
                else:
                    reply = await self._preempt_admit(cmd)
            except wire.WireError as exc:
                reply = NodeReply(False, f"bad_command: {exc}")
            except Exception as exc:  # one bad command must not take the node down
                with self.obs.use_command(command):  # the log line carries the trace
                    log.exception("command failed")
                reply = NodeReply(False, f"error: {exc}")
            await self._respond(msg, replace(reply, node=self._view()))
            self.obs.command_result(command, kind, reply.accepted, reply.reason, reply.instance_id)
            if reply.accepted and reply.reason == "admitted" and cmd is not None and cmd.request \
                    and cmd.kind is not CommandKind.START_INSTANCE:  # its request is a stand-in
                await self._announce(cmd.request)

    async def _respond(self, msg: Msg, reply: NodeReply) -> None:
        try:
            await msg.respond(wire.encode(reply))
        except Exception as exc:  # NATS gone: the asker times out and asks again
            log.warning("could not answer a command: %r", exc)

    def status(self, request_id: str, attempt: int = 0) -> NodeReply:
        """STATUS: what this node knows of the request (its attempt `attempt` or a later one)."""
        live = self.live.get(request_id)
        if live is not None and live.request.attempt >= attempt:
            return NodeReply(True, RequestState.RUNNING.value, live.instance_id,
                             generated=len(live.output))
        past = self.recent.get(request_id)
        if past is not None and past.attempt >= attempt:
            return NodeReply(True, past.state.value, final=past.final, generated=past.tokens)
        return NodeReply(True, RequestState.UNKNOWN.value)

    def _remember(self, live: Live, state: RequestState, final: TokenMessage | None = None) -> None:
        request = live.request
        self.recent[request.request_id] = Past(request.attempt, state, len(live.output), final)
        self.recent.move_to_end(request.request_id)
        while len(self.recent) > RECENT_LEN:
            self.recent.popitem(last=False)

    async def _announce(self, req: InferenceRequest) -> None:
        """An empty token message that tells the gateway which node holds the request now (its
        watchdog asks that node if the stream goes quiet). No trace headers: those ride the
        request's token messages as `observe` counts them."""
        await self._publish(TokenMessage(req.request_id, len(req.resumed_token_ids), [],
                                         node_id=self.s.node_id, attempt=req.attempt),
                            headers=False)

    async def _admit(self, cmd: NodeCommand) -> NodeReply:
        checked = await self._admission_inputs(cmd)
        if isinstance(checked, NodeReply):
            return checked
        req, record = checked
        adapter = await self._adapter_spec(req, record)  # LoRA (issue 12)
        if isinstance(adapter, NodeReply):
            return adapter
        expected = self._expect_arrival(cmd, record)
        result = self.sched.admit(request_view(req), cmd.instance_id, model_spec(record), time.time(),
                                  adapter)
        if expected and not result.admission.ok:
            self.arriving.pop(record.name, None)  # refused: the placer sends it no multicast
        return self._commit(req, record, result, cold=cmd.instance_id is None)

    async def _start_instance(self, cmd: NodeCommand) -> NodeReply:
        """START_INSTANCE (burst scale-out): a new instance with no request yet, checked and
        sized by the core as one for the stand-in request would be; its load starts now (waiting
        for the multicast the placer announced, if any), and later ADMITs join it."""
        if cmd.request is None or cmd.model is None or cmd.instance_id is not None:
            return NodeReply(False, "bad_command: start_instance needs a request and a model")
        record = cmd.model
        await self._learn_model(record)
        expected = self._expect_arrival(cmd, record)
        result = self.sched.start_instance(request_view(cmd.request), model_spec(record), time.time())
        if expected and not result.admission.ok:
            self.arriving.pop(record.name, None)  # refused: the placer sends it no multicast
        if result.admission.ok:
            self._expect_load(result.instance_id, record)
            self.records[result.instance_id] = record
        self._start_ops(result.start_ops)
        self.wake.set()
        return NodeReply(result.admission.ok, result.admission.reason.value, result.instance_id)

    def _expect_arrival(self, cmd: NodeCommand, record: ModelRecord) -> bool:
        """A new instance whose model the placer multicasts here (λScale §5): the core's load
        estimate counts the arrival (`StorageView.arriving`), and the load waits for it. True
        when this command announced it (a refusal withdraws it)."""
        if cmd.multicast_s is None or cmd.instance_id is not None or self.multicast is None \
                or record.name in self.arriving:
            return False
        self.arriving[record.name] = Arrival(record.path, time.time() + max(0.0, cmd.multicast_s),
                                             time.monotonic(), cmd.pipeline)
        self._refresh_storage()
        return True

    async def _preempt_admit(self, cmd: NodeCommand) -> NodeReply:
        """§VIII-A: the core re-checks the admission without the victims first; a refusal leaves
        them untouched. Their requests go back to the request stream, each with the destination
        the plan validated, before the reply (so a placer that dies now loses none of them)."""
        checked = await self._admission_inputs(cmd)
        if isinstance(checked, NodeReply):
            return checked
        req, record = checked
        adapter = await self._adapter_spec(req, record)  # LoRA (issue 12)
        if isinstance(adapter, NodeReply):
            return adapter
        if cmd.handover_s is not None:
            return self._preempt_live(cmd, req, record, adapter)
        expected = self._expect_arrival(cmd, record)
        targets = {m.request_id: m for m in cmd.migrations}
        moved = []
        # Between two iterations: the victims' engines are unloaded by the ops this starts, and
        # an engine freed under its running iteration fails it.
        async with self._iter_lock:
            result = self.sched.preempt_and_admit(cmd.preempt_instance_ids, request_view(req),
                                                  cmd.instance_id, model_spec(record), time.time(),
                                                  adapter)
            if expected and not result.admission.ok:
                self.arriving.pop(record.name, None)
            for view in result.evicted:
                resumed = self._take_back(view.request_id, view.grace_s)
                if resumed is None:
                    continue
                if (target := targets.get(view.request_id)) is not None:
                    resumed = replace(resumed, target_node=target.node_id,
                                      target_instance=target.instance_id)
                moved.append(resumed)
            reply = self._commit(req, record, result, cold=cmd.instance_id is None)
        for resumed in moved:  # before the reply: a placer that dies now loses none of them
            await self._requeue(resumed)
        return replace(reply, evicted=moved)

    def _preempt_live(self, cmd: NodeCommand, req: InferenceRequest, record: ModelRecord,
                      adapter: AdapterSpec | None) -> NodeReply:
        """Preemption by live migration: the core re-checks the admission with the victims'
        work on the node until the plan's handover and the newcomer's instance waiting for it.
        The victims run on; their requests move live (`_hand_over`), then they are unloaded,
        and only then does the newcomer's memory (held in the reservation station) grow."""
        result = self.sched.preempt_and_admit(cmd.preempt_instance_ids, request_view(req),
                                              cmd.instance_id, model_spec(record), time.time(),
                                              adapter, handover_s=cmd.handover_s)
        reply = self._commit(req, record, result, cold=cmd.instance_id is None)
        if not result.admission.ok:
            return reply
        moving = [r.request_id for r in result.migrating]
        targets = {m.request_id: m for m in cmd.migrations}
        self._spawn(self._hand_over(list(cmd.preempt_instance_ids), moving, targets),
                    f"handover-{req.request_id}")
        return replace(reply, migrating=moving)

    async def _hand_over(self, victims: list[str], moving: list[str],
                         targets: dict[str, MigrationTarget]) -> None:
        """Source side of a live preemption: every displaced request migrates at once to where
        the plan validated it (each destination recomputes its migrants in turn); then the
        victims are unloaded. A request whose migration was refused or failed goes stop-and-
        resume: back to the request stream with its tokens and the plan's destination."""
        moves = [self.migrate_out(rid, targets[rid].node_id, targets[rid].instance_id or None)
                 for rid in moving if rid in targets]
        for outcome in await asyncio.gather(*moves, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.warning("a live preemption's migration failed: %r", outcome)
        async with self._iter_lock:  # between two iterations: no victim is running one
            now = time.time()
            requeue = []
            for victim in victims:
                left, ops = self.sched.finish_handover(victim, now)
                for view in left:
                    resumed = self._take_back(view.request_id, view.grace_s)
                    if resumed is not None and (target := targets.get(view.request_id)) is not None:
                        resumed = replace(resumed, target_node=target.node_id,
                                          target_instance=target.instance_id)
                    if resumed is not None:
                        requeue.append(resumed)
                self._start_ops(ops)
        for resumed in requeue:
            log.info("live preemption: %s moves stop-and-resume", resumed.request_id)
            await self._requeue(resumed)
        self.wake.set()

    async def _admission_inputs(self, cmd: NodeCommand) -> tuple[InferenceRequest, ModelRecord] | NodeReply:
        """The request and model record an admission needs, or the reply that refuses it."""
        req = cmd.request
        if req is None:
            return NodeReply(False, "bad_command: admit without a request")
        live = self.live.get(req.request_id)
        if live is not None and live.request.attempt < req.attempt:
            self._drop_stale(live)  # the gateway resumed it elsewhere meanwhile: an orphan
        elif live is not None:  # a redelivered admission: already ours
            return NodeReply(True, "admitted", live.instance_id)
        moving = self.incoming.get(req.request_id)
        if (moving is not None and moving.request.attempt >= req.attempt) or (
                live is None and req.request_id in self.migrating):
            # A redelivered admission of a request migrating to or from here: the migration owns
            # it (it commits here, or stays where it runs); a second copy must not start.
            return NodeReply(True, "migrating")
        past = self.recent.get(req.request_id)
        if past is not None and past.attempt >= req.attempt:
            # Finished or handed back from here, and the placer's ack was lost so the stream
            # redelivered the admission: do not run it twice. (A handed-back request that comes
            # back with at least the tokens it left with is its requeued copy: that one runs.)
            if past.state is RequestState.FINISHED:
                if past.final is not None:  # in case the gateway missed it too
                    await self._publish(past.final, headers=False)
                return NodeReply(True, "already_finished")
            if len(req.resumed_token_ids) < past.tokens:
                return NodeReply(True, "already_moved")
        record = cmd.model if cmd.instance_id is None else self.records.get(cmd.instance_id)
        if record is None:
            return NodeReply(False, "instance_gone" if cmd.instance_id else "bad_command: no model")
        await self._learn_model(record)
        return req, record

    async def _learn_model(self, record: ModelRecord) -> None:
        """Before the core decides on `record`: its profile, its name and its tiers are known."""
        if self.sched.perf.get(record.name, self.sched.node.hardware) is None:
            # A profile stored after this node last read them (the profiler reports `ready` as
            # soon as it stored it): read them again once before the core may say no_profile.
            await self._load_profiles()
        self.model_names.learn(record)
        if record.base_model is None:
            self.backbones[record.name] = record
        self._refresh_storage()

    # --- LoRA adapters (issue 12; ServerlessLoRA §4.4) -----------------------------------------
    # A request for an adapter comes with `model` = its backbone and `adapter` = the adapter's
    # registry id. It is admitted to a backbone instance; where that instance lacks the adapter,
    # the core holds the adapter's bytes and issues a LOAD memory op for it (its key names the
    # instance and the adapter), executed here like any other memory op: the request joins the
    # engine once the adapter is loaded. Instance unloads take their adapters with them.
    async def _adapter_spec(self, req: InferenceRequest,
                            record: ModelRecord) -> AdapterSpec | None | NodeReply:
        if req.adapter is None:
            return None
        adapter = self.adapter_records.get(req.adapter)
        if adapter is None:
            try:
                adapter = await ModelRegistry(self.redis).get(req.adapter)
            except Exception as exc:  # Redis blip: the placer asks again
                return NodeReply(False, f"error: reading the adapter's record: {exc!r}")
        if adapter is None or adapter.base_model != record.name:
            return NodeReply(False, f"bad_command: {req.adapter!r} is not a LoRA adapter of "
                                    f"{record.name!r}")
        self.adapter_records[req.adapter] = adapter
        return AdapterSpec(adapter.name, adapter.weight_bytes)

    def _run_adapter_op(self, op: MemOp, instance_id: str, name: str) -> None:
        """An adapter's memory op, on a worker thread: load it into (or drop it from) the
        instance's engine. A load waits for the engine, whose own load may be running."""
        if op.kind is MemOpKind.UNLOAD:
            engine = self.engines.get(instance_id)
            if engine is not None and hasattr(engine, "unload_adapter"):
                engine.unload_adapter(name)
            return
        while (engine := self.engines.get(instance_id)) is None:
            if self.sched.node.instance(instance_id) is None or self._stopping:
                return  # the instance is gone (its load failed or was cancelled)
            time.sleep(0.005)
        if not hasattr(engine, "load_adapter"):
            raise RuntimeError(f"the {engine.name} engine does not serve LoRA adapters")
        engine.load_adapter(name, self.adapter_records[name].path)

    async def _after_adapter(self, instance_id: str, name: str, done: MemOpCompletion) -> None:
        """An adapter's load completed: its waiting requests join the engine, or fail with it."""
        waiting = [lv for lv in self.live.values() if lv.instance_id == instance_id
                   and lv.request.adapter == name and not lv.in_engine]
        if done.ok:
            if self._loaded(instance_id):  # else the instance's own load completion adds them
                for live in waiting:
                    self._engine_add(live)
            return
        for live in waiting:
            await self._finish(live, FinishReason.ERROR, f"LoRA adapter failed to load: {done.error}")
        self._start_ops(self.sched.detach_adapter(instance_id, name, time.time()))

    def _adapter_ready(self, instance_id: str, adapter: str | None) -> bool:
        engine = self.engines.get(instance_id)
        return adapter is None or (engine is not None and adapter in getattr(engine, "adapters", {}))
    # --- end LoRA ----------------------------------------------------------------------------

    def _commit(self, req: InferenceRequest, record: ModelRecord, result: AdmitResult,
                cold: bool) -> NodeReply:
        """Carry out what the core admitted: the request becomes ours, its memory ops start."""
        if result.admission.ok and cold:
            self._expect_load(result.instance_id, record)
        self._start_ops(result.start_ops)
        if not result.admission.ok:
            return NodeReply(False, result.admission.reason.value)
        iid = result.instance_id
        self.records[iid] = record
        req = replace(req, grace_s=result.admission.grace_s, target_node=None, target_instance=None)
        self.live[req.request_id] = Live(req, iid, output=list(req.resumed_token_ids))
        self.recent.pop(req.request_id, None)
        self.obs.admitted(req, iid, cold=cold)
        if self._loaded(iid):
            self._engine_add(self.live[req.request_id])
        self.wake.set()
        return NodeReply(True, result.admission.reason.value, iid)

    def _take_back(self, request_id: str, grace_s: float) -> InferenceRequest | None:
        """Remove a request from this node, returning it with its tokens so far and its grace
        (to resume elsewhere)."""
        live = self.live.pop(request_id, None)
        if live is None:
            return None
        engine = self.engines.get(live.instance_id)
        if engine is not None:
            engine.release(request_id)
        # Its trace goes with it (in the body: it travels on the request stream again).
        trace_context = self.obs.headers(request_id) or live.request.trace_context
        self.obs.ended(request_id, "handed_back", len(live.output) - len(live.request.resumed_token_ids))
        self._remember(live, RequestState.MOVED)
        return replace(live.request, resumed_token_ids=list(live.output), trace_context=trace_context,
                       grace_s=grace_s)

    def _drop_stale(self, live: Live) -> None:
        """Forget an attempt the gateway no longer reads (no final message: nobody listens)."""
        rid = live.request.request_id
        self.live.pop(rid, None)
        engine = self.engines.get(live.instance_id)
        if engine is not None:
            engine.release(rid)
        self._start_ops(self.sched.cancel(rid, time.time()))
        self.obs.ended(rid, "cancelled", len(live.output) - len(live.request.resumed_token_ids),
                       "superseded by a later attempt")

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            notice = wire.decode(CancelNotice, msg.data)
        except wire.WireError:
            return
        incoming = self.incoming.get(notice.request_id)
        if incoming is not None and (notice.below_attempt is None
                                     or incoming.request.attempt < notice.below_attempt):
            incoming.cancelled = True  # its commit is refused; the source drops it too
        live = self.live.get(notice.request_id)
        if live is None:
            return
        if notice.below_attempt is not None and live.request.attempt >= notice.below_attempt:
            return  # only older attempts are cancelled: this one is current
        live.cancelled = True  # the token loop drops it at its next turn
        self.wake.set()

    # --- live migration (services/node/migration.py has the protocol) -------------------------
    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._background.discard)

    async def _ask(self, node_id: str, cmd: NodeCommand, timeout: float) -> NodeReply | None:
        """A command to another node; None if it did not answer in time."""
        try:
            msg = await self.nc.request(node_command_subject(node_id), wire.encode(cmd), timeout=timeout)
            return wire.decode(NodeReply, msg.data)
        except Exception as exc:
            log.warning("%s to %s: no answer (%r)", cmd.kind.value, node_id, exc)
            return None

    def _start_migrations(self, cmd: NodeCommand) -> NodeReply:
        """MIGRATE: move these requests live, each in its own task (the reply does not wait)."""
        started = [m for m in cmd.migrations
                   if m.request_id in self.live and m.request_id not in self.migrating]
        for m in started:
            self._spawn(self.migrate_out(m.request_id, m.node_id, m.instance_id or None),
                        f"migrate-{m.request_id}")
        return NodeReply(bool(started), "migrating" if started else "not_here")

    def _start_drain(self) -> NodeReply:
        if not self.draining:
            self.draining = True
            self._spawn(self._drain(), "drain")
        return NodeReply(True, "draining", generated=len(self.live))

    async def _drain(self) -> None:
        """Move every request off, one at a time, each to the best node the cluster view shows
        now. A request no node takes stays here and finishes here: nothing is lost."""
        await publish_node(self.redis, self._view(), ttl_s=self.s.heartbeat_s * 12)
        for rid in list(self.live):
            live = self.live.get(rid)
            if live is None or rid in self.migrating:
                continue
            try:
                nodes = await read_nodes(self.redis)
            except Exception as exc:
                log.warning("drain: cluster view unavailable (%r); %s stays here", exc, rid)
                continue
            dest = choose_destination(nodes, live.request.model, self.s.node_id)
            if dest is not None:
                await self.migrate_out(rid, *dest)
        log.info("node %s drained: %d requests still finishing here", self.s.node_id, len(self.live))

    async def migrate_out(self, rid: str, node_id: str, instance_id: str | None) -> MigrationLog:
        """Source side: BEGIN, catch-up rounds while this node keeps decoding, then COMMIT.
        Until the destination accepts the commit the request stays ours."""
        record = MigrationLog(rid, self.s.node_id, node_id, time.time())
        live = self.live.get(rid)
        if live is None or rid in self.migrating or node_id == self.s.node_id:
            record.reason = "not_here" if live is None else "busy_or_self"
            return record
        refusal = engine_refusal(resolve_engine(self.records[live.instance_id].engine, self.s.device))
        if refusal is not None:
            record.reason = f"refused: {refusal}"
            self.migrations.append(record)
            return record
        self.migrating.add(rid)
        try:
            record.reason = await self._migrate_rounds(live, node_id, instance_id, record)
        except Exception as exc:  # ours still: it runs on here
            log.exception("migration of %s to %s failed", rid, node_id)
            record.reason = f"error: {exc}"
            if self.live.get(rid) is None and not record.ok and rid in self._held:
                self._unhold(live, self._held.pop(rid))
        finally:
            self.migrating.discard(rid)
            self.migrations.append(record)
        with self.obs.use(rid):
            log.info("migration of %s to %s: %s (%d rounds, %.3f s)", rid, node_id, record.reason,
                     len(record.rounds), record.total_s)
        return record

    async def _migrate_rounds(self, live: Live, node_id: str, instance_id: str | None,
                              record: MigrationLog) -> str:
        policy, rid = self.migration_policy, live.request.request_id
        sent = len(live.output)
        begin = replace(live.request, resumed_token_ids=list(live.output),
                        trace_context=self.obs.headers(rid) or live.request.trace_context)
        record.context_tokens = len(live.all_tokens)
        reply = await self._ask(node_id, NodeCommand(
            CommandKind.MIGRATE_BEGIN, request=begin, instance_id=instance_id,
            model=self.records[live.instance_id]), policy.begin_timeout_s)
        record.begin_s = time.time() - record.started
        if reply is None or not reply.accepted:
            await self._ask(node_id, NodeCommand(CommandKind.MIGRATE_ABORT, request_id=rid), 5)
            return f"refused: {reply.reason if reply else 'no answer'}"
        while True:
            ended = self.live.get(rid) is not live or live.cancelled
            step = next_step(policy, len(record.rounds), len(live.output) - sent, ended)
            if step is Next.ABORT:
                await self._ask(node_id, NodeCommand(CommandKind.MIGRATE_ABORT, request_id=rid), 5)
                return "ended before the commit"
            if step is Next.COMMIT:
                break
            delta, t = live.output[sent:], time.time()
            reply = await self._ask(node_id, NodeCommand(CommandKind.MIGRATE_EXTEND, request_id=rid,
                                                         tokens=delta, seq=sent), policy.round_timeout_s)
            if reply is None or not reply.accepted:
                await self._ask(node_id, NodeCommand(CommandKind.MIGRATE_ABORT, request_id=rid), 5)
                return f"round refused: {reply.reason if reply else 'no answer'}"
            record.rounds.append((len(delta), time.time() - t))
            sent += len(delta)
        return await self._commit_out(live, node_id, sent, record)

    async def _commit_out(self, live: Live, node_id: str, sent: int, record: MigrationLog) -> str:
        rid = live.request.request_id
        async with self._iter_lock:  # between two iterations: the last token is out
            if self.live.get(rid) is not live or live.cancelled:
                await self._ask(node_id, NodeCommand(CommandKind.MIGRATE_ABORT, request_id=rid), 5)
                return "ended before the commit"
            self._held[rid] = self._hold(live)
        record.stopped_at = time.time()
        reply = await self._ask(node_id, NodeCommand(
            CommandKind.MIGRATE_COMMIT, request_id=rid, tokens=live.output[sent:], seq=sent),
            self.migration_policy.round_timeout_s)
        took = reply is not None and reply.accepted
        if reply is None:  # the answer may be what got lost: ask before running it here again
            status = await self._ask(node_id, NodeCommand(CommandKind.STATUS, request_id=rid,
                                                          attempt=live.request.attempt), 5)
            took = status is not None and status.reason == RequestState.RUNNING.value
        view = self._held.pop(rid)
        if not took:
            # A cancel that came while it was held found it nowhere here; B saw it and said so.
            live.cancelled = live.cancelled or (reply is not None and reply.reason == "cancelled")
            self._unhold(live, view)
            await self._ask(node_id, NodeCommand(CommandKind.MIGRATE_ABORT, request_id=rid), 5)
            return f"commit refused: {reply.reason if reply else 'no answer'}"
        record.committed_at, record.ok = time.time(), True
        self._moved_away(live)
        return "moved"

    def _hold(self, live: Live) -> RequestView | None:
        """Stop a request between iterations without forgetting it: out of the core's batches and
        of `live`, its engine state (KV) kept, so a refused commit can put it back as it was."""
        self.live.pop(live.request.request_id, None)
        inst = self.sched.node.instance(live.instance_id)
        view = next((r for r in inst.requests if r.request_id == live.request.request_id), None) \
            if inst is not None else None
        if view is not None:
            inst.requests.remove(view)
        return view

    def _unhold(self, live: Live, view: RequestView | None) -> None:
        inst = self.sched.node.instance(live.instance_id)
        if view is not None and inst is not None:
            inst.requests.append(view)
        self.live[live.request.request_id] = live
        self.wake.set()

    def _moved_away(self, live: Live) -> None:
        rid = live.request.request_id
        engine = self.engines.get(live.instance_id)
        if engine is not None:
            engine.release(rid)
        self.obs.ended(rid, "migrated", len(live.output) - len(live.request.resumed_token_ids))
        self._remember(live, RequestState.MOVED)
        self.wake.set()

    async def _migration_command(self, msg: Msg, cmd: NodeCommand) -> None:
        """Destination side of a migration round; any failure refuses (the source keeps it)."""
        handlers = {CommandKind.MIGRATE_BEGIN: self._migrate_begin,
                    CommandKind.MIGRATE_EXTEND: self._migrate_extend,
                    CommandKind.MIGRATE_COMMIT: self._migrate_commit,
                    CommandKind.MIGRATE_ABORT: self._migrate_abort}
        rid = cmd.request.request_id if cmd.request else cmd.request_id or ""
        try:
            reply = await handlers[cmd.kind](cmd)
        except Exception as exc:
            with self.obs.use(rid):
                log.exception("%s of %s failed", cmd.kind.value, rid)
            self._drop_incoming(rid)
            reply = NodeReply(False, f"error: {exc}")
        await self._respond(msg, replace(reply, node=self._view()))

    async def _migrate_begin(self, cmd: NodeCommand) -> NodeReply:
        req = cmd.request
        if req is None:
            return NodeReply(False, "bad_command: migrate_begin without a request")
        rid = req.request_id
        if self.draining:
            return NodeReply(False, "draining")
        if rid in self.live or rid in self.incoming:
            return NodeReply(False, "already_here")
        record = cmd.model if cmd.instance_id is None else self.records.get(cmd.instance_id)
        if record is None:
            return NodeReply(False, "instance_gone" if cmd.instance_id else "bad_command: no model")
        refusal = engine_refusal(resolve_engine(record.engine, self.s.device))
        if refusal is not None:
            return NodeReply(False, f"engine: {refusal}")
        if self.sched.perf.get(record.name, self.sched.node.hardware) is None:
            await self._load_profiles()
        self.model_names.learn(record)
        self._refresh_storage()
        adapter = await self._adapter_spec(req, record)  # LoRA (issue 12)
        if isinstance(adapter, NodeReply):
            return adapter
        result = self.sched.admit(request_view(req), cmd.instance_id, model_spec(record), time.time(),
                                  adapter)
        if result.admission.ok and cmd.instance_id is None:
            self._expect_load(result.instance_id, record)
        self._start_ops(result.start_ops)
        if not result.admission.ok:
            return NodeReply(False, result.admission.reason.value)
        iid = result.instance_id
        self.records[iid] = record
        inst = self.sched.node.instance(iid)
        view = next(r for r in inst.requests if r.request_id == rid)
        inst.requests.remove(view)  # admitted (memory counted), but not to be batched yet
        incoming = Incoming(replace(req, grace_s=result.admission.grace_s, target_node=None,
                                    target_instance=None), iid, view, list(req.resumed_token_ids))
        self.incoming[rid] = incoming
        if not await self._until_loaded(iid, self.migration_policy.begin_timeout_s, req.adapter):
            self._drop_incoming(rid)
            return NodeReply(False, "load_failed")
        async with self._iter_lock:
            engine = self.engines[iid]
            engine.add_request(rid, incoming.all_tokens, sampling_params(req, len(incoming.known)))
            incoming.pending = (await asyncio.to_thread(engine.prefill, rid)).tokens[rid]
        return NodeReply(True, "prefilled", iid, generated=len(incoming.known))

    async def _until_loaded(self, iid: str, timeout: float, adapter: str | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while not self._loaded(iid) or not self._adapter_ready(iid, adapter):
            if self.sched.node.instance(iid) is None or time.monotonic() > deadline:
                return False  # its load failed (the instance is gone) or takes too long
            await asyncio.sleep(0.01)
        return True

    async def _catch_up(self, rid: str, tokens: list[int], seq: int) -> Incoming | NodeReply:
        """Compute the KV of the source's tokens `tokens` (output index `seq` on)."""
        incoming = self.incoming.get(rid)
        if incoming is None or incoming.pending is None:
            return NodeReply(False, "not_migrating")
        if seq != len(incoming.known):
            return NodeReply(False, f"out_of_step: have {len(incoming.known)} tokens, got seq {seq}")
        if not tokens:
            return incoming
        async with self._iter_lock:  # one pass over the new tokens only (LIVE_ENGINES extend)
            step = await asyncio.to_thread(self.engines[incoming.instance_id].extend, rid, tokens)
        incoming.known.extend(tokens)
        incoming.pending = step.tokens[rid]
        return incoming

    async def _migrate_extend(self, cmd: NodeCommand) -> NodeReply:
        done = await self._catch_up(cmd.request_id or "", cmd.tokens, cmd.seq)
        if isinstance(done, NodeReply):
            return done
        return NodeReply(True, "extended", done.instance_id, generated=len(done.known))

    async def _migrate_commit(self, cmd: NodeCommand) -> NodeReply:
        """Take the request over: the source has stopped it. The token sampled after the last
        delta is the next output token, streamed with the next sequence number."""
        rid = cmd.request_id or ""
        done = await self._catch_up(rid, cmd.tokens, cmd.seq)
        if isinstance(done, NodeReply):
            return done
        inst = self.sched.node.instance(done.instance_id)
        if done.cancelled or inst is None or self.draining:
            self._drop_incoming(rid)
            return NodeReply(False, "cancelled" if done.cancelled else "draining" if self.draining
                             else "instance_gone")
        del self.incoming[rid]
        output = list(done.known)
        req = replace(done.request, resumed_token_ids=output)
        done.view.generated, done.view.prefilled = len(output) + 1, True  # + the token below
        inst.requests.append(done.view)
        inst.last_active = time.time()
        live = Live(req, done.instance_id, output=list(output), in_engine=True)
        self.live[rid] = live
        self.recent.pop(rid, None)
        self.obs.admitted(req, done.instance_id, cold=False)
        await self._emit(live, done.pending)
        self.wake.set()
        return NodeReply(True, "admitted", done.instance_id, generated=len(output))

    async def _migrate_abort(self, cmd: NodeCommand) -> NodeReply:
        self._drop_incoming(cmd.request_id or "")
        return NodeReply(True, "aborted")

    def _drop_incoming(self, rid: str) -> None:
        incoming = self.incoming.pop(rid, None)
        if incoming is None:
            return
        engine = self.engines.get(incoming.instance_id)
        if engine is not None:
            engine.release(rid)

    # --- memory operations -------------------------------------------------------------------
    def _start_ops(self, ops) -> None:
        for op in ops:
            self.ops[op.op_id] = op
            asyncio.create_task(self._execute(op), name=f"memop-{op.op_id}")

    async def _execute(self, op: MemOp) -> None:
        await self.layers.before_op(op.instance_id)  # not while its layers move (CoCoServe)
        started = time.time()
        error = None
        try:
            await asyncio.to_thread(self._run_op, op)
        except Exception as exc:
            log.exception("memory op %s failed", op)
            error = str(exc)
        done = MemOpCompletion(self.s.node_id, op.op_id, op.instance_id, op.kind, op.bytes_before,
                               op.bytes_after, started, time.time(), parked_s=started - op.issued_at,
                               ok=error is None, error=error)
        self.obs.memop_done(op, done)
        try:
            await self.js.publish(memop_subject(self.s.node_id), wire.encode(done))
        except Exception as exc:
            # NATS is down: the reservation station must not wait forever for this completion
            # (the instance would stay LOADING). Apply it here; the stream misses this one record.
            log.warning("memory-op completion %s not published (%r): applied locally", op.op_id, exc)
            await self._memop_done(done)

    def _expect_load(self, instance_id: str, record: ModelRecord) -> None:
        """A cold start admitted: what the core expects of its load, from the view it decided
        on (before its LOAD op starts, so the loader's queue is the loads ahead of it)."""
        storage = self.sched.node.storage
        profile = self.sched.perf.get(record.name, self.sched.node.hardware)
        expected = load_seconds(self.sched.node, model_spec(record), profile) if profile else 0.0
        tier = storage.holds.get(record.name, "registry") if storage else None
        if storage is not None and record.name in storage.arriving and tier != "dram":
            tier = "multicast"  # then its DRAM tier
        load = LoadRecord(instance_id, record.name, time.time(), tier, expected)
        self._loading[instance_id] = load
        self.loads.append(load)

    def _run_op(self, op: MemOp) -> None:
        if (owner := adapter_owner(op.instance_id)) is not None:  # LoRA (issue 12)
            self._run_adapter_op(op, *owner)
            return
        if self.layers.owns_op(op.instance_id):  # a hosted stage's bytes (CoCoServe)
            self.layers.run_op(op.kind.value, op.instance_id)
            return
        record = self.records[op.instance_id]
        inst = self.sched.node.instance(op.instance_id)  # a split instance holds its share
        kv_bytes = max(0, op.bytes_after - (inst.model.weight_bytes if inst else record.weight_bytes))
        if op.kind is MemOpKind.LOAD:
            load = self._loading.pop(op.instance_id, None)
            started = time.perf_counter()
            try:  # λScale: serve through a pipeline while the model arrives, if so planned
                engine = self.pipelines.load(op.instance_id, record, kv_bytes)
                if engine is None:
                    self._await_arrival(record)
                    engine = create_engine(record.engine, record.path, device=self.s.device,
                                           kv_capacity_bytes=kv_bytes, loader=self.loader)
                    started = time.perf_counter()
                    engine.load()
            except BaseException:
                if load is not None:
                    load.ok, load.seconds = False, time.perf_counter() - started
                    self.obs.load_done(load)
                raise
            if load is not None:
                info = getattr(engine, "load_info", {}) or {}
                load.seconds, load.ok = time.perf_counter() - started, True
                load.tier, load.loader_seconds = info.get("tier"), info.get("loader_seconds")
                load.bytes = int(info.get("bytes", 0) or 0)
                self.obs.load_done(load)
            self.engines[op.instance_id] = engine
        elif op.kind is MemOpKind.SCALE:  # (a pipelined engine's pool is its layers' share)
            self.engines[op.instance_id].resize_kv(self.pipelines.kv_share(op.instance_id, kv_bytes))
        else:
            self.pipelines.unloaded(op.instance_id)
            engine = self.engines.pop(op.instance_id, None)
            if engine is not None:
                engine.unload()

    def _await_arrival(self, record: ModelRecord) -> None:
        """(Load thread) A model on its way here by multicast: wait until it is in the DRAM tier,
        or its transfer ended without it, or it is long overdue; then the load reads the
        fastest tier that holds it (the DRAM tier, or the storage tiers as a fallback)."""
        arrival = self.arriving.get(record.name)
        if arrival is None or self.multicast is None:
            return
        expected = max(0.0, arrival.expected_at - time.time())
        outcome = self.multicast.wait_for_model(
            arrival.model_path, arrival.since,
            max(ARRIVAL_MIN_WAIT_S, ARRIVAL_PATIENCE * (time.monotonic() - arrival.since + expected)))
        if self.arriving.get(record.name) is arrival:
            del self.arriving[record.name]
        if not outcome:
            log.warning("node %s: %s did not arrive by multicast (%s); loading it from the tiers",
                        self.s.node_id, record.name, "transfer failed" if outcome is False
                        else "no transfer ended in time")

    async def _on_memop_done(self, msg: Msg) -> None:
        try:
            done = wire.decode(MemOpCompletion, msg.data)
        except wire.WireError:
            return
        await self._memop_done(done)

    async def _memop_done(self, done: MemOpCompletion) -> None:
        if done.started < self._born:
            return  # a completion from an earlier life of this node id (op ids start again)
        op = self.ops.get(done.op_id)
        if op is None or op.instance_id != done.instance_id:
            return  # already applied (published and applied locally), or not ours
        del self.ops[done.op_id]
        released = self.sched.memop_done(op, time.time())
        if (owner := adapter_owner(op.instance_id)) is not None:  # LoRA (issue 12)
            if op.kind is MemOpKind.LOAD:
                await self._after_adapter(*owner, done)
        elif op.kind is MemOpKind.LOAD:
            await self._after_load(op.instance_id, done)
        if op.kind is MemOpKind.UNLOAD and not self.sched.node.instance(op.instance_id):
            self.records.pop(op.instance_id, None)
            self._loading.pop(op.instance_id, None)  # unloaded before its load ran
        self._start_ops(released)
        self.wake.set()

    async def _after_load(self, instance_id: str, done: MemOpCompletion) -> None:
        waiting = [lv for lv in self.live.values() if lv.instance_id == instance_id]
        if not done.ok:
            for live in waiting:
                await self._finish(live, FinishReason.ERROR, f"model failed to load: {done.error}")
            self._start_ops(self.sched.preempt([instance_id], time.time())[1])
            return
        for live in waiting:
            self._engine_add(live)

    def _loaded(self, instance_id: str) -> bool:
        """The engine is usable only once its LOAD completion came back through the stream: the
        load thread publishes the engine object a little earlier than that."""
        inst = self.sched.node.instance(instance_id)
        return instance_id in self.engines and inst is not None and \
            inst.status in (InstanceStatus.READY, InstanceStatus.HANDOVER)

    def _engine_add(self, live: Live) -> None:
        if live.in_engine or live.error is not None:
            return
        req = live.request
        if not self._adapter_ready(live.instance_id, req.adapter):
            return  # LoRA (issue 12): its adapter's load completion adds it
        try:
            self.engines[live.instance_id].add_request(req.request_id, live.all_tokens,
                                                       sampling_params(req, len(live.output)))
        except Exception as exc:  # e.g. a token id outside the vocabulary
            live.error = f"engine rejected the request: {exc}"
            self.wake.set()
            return
        live.in_engine = True

    # --- the token loop ----------------------------------------------------------------------
    async def _token_loop(self) -> None:
        while not self._stopping:
            try:
                await self._turn()
                self._trouble("token loop", None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never silently stop generating for everyone
                log.exception("token loop turn failed")
                self._trouble("token loop", exc)
                await asyncio.sleep(0.1)

    async def _turn(self) -> None:
        """One turn of the token loop: drop cancelled requests, start memory ops, run at most
        one iteration (or wait for something to do)."""
        await self._drop_cancelled()
        async with self._iter_lock:
            now = time.time()
            self._start_ops(self.sched.reclaim_idle(now))
            plan = self.sched.step(now)
            self._start_ops(plan.start_ops)
            for ev in plan.evictions:
                await self._reschedule(ev)
            if plan.iteration is not None:
                await self._run_iteration(plan)
                return
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=max(0.05, self.s.core.keep_alive_s / 4))
        except TimeoutError:
            pass

    async def _run_iteration(self, plan: StepPlan) -> None:
        choice = plan.iteration
        engine = self.engines[choice.instance_id]
        model = self.records[choice.instance_id].name
        base_s = self._base_prediction(plan, model)
        if self.obs.tracing:
            first = self.live.get(choice.request_ids[0])
            self.obs.iteration_started(choice, len(first.all_tokens) if first else 0)
        try:
            started = time.perf_counter()
            if choice.kind is IterationKind.PREFILL:
                result = await asyncio.to_thread(engine.prefill, choice.request_ids[0])
            else:
                result = await asyncio.to_thread(engine.decode, list(choice.request_ids))
            elapsed = time.perf_counter() - started
        except KVCacheFull:
            for rid in choice.request_ids:
                self.obs.event(rid, "kv_cache_full", **{"slinfer.instance_id": choice.instance_id})
            eviction = self.sched.evict_for_memory(choice.instance_id, time.time())
            if eviction is not None:
                await self._reschedule(eviction)
            return
        except Exception as exc:
            log.exception("iteration failed on %s", choice.instance_id)
            self.sched.abort_iteration(time.time())
            for rid in choice.request_ids:
                if rid in self.live:
                    await self._finish(self.live[rid], FinishReason.ERROR, f"engine error: {exc}")
            return
        self.iterations += 1
        self._calibrate(model, plan, base_s, elapsed)
        now = time.time()
        self.history.append(IterationRecord(now - elapsed, now, choice.instance_id, choice.kind,
                                            choice.request_ids, plan.considered))
        prefill_s = elapsed if choice.kind is IterationKind.PREFILL else None
        if prefill_s is not None:
            self.obs.prefill_done(choice.request_ids[0], prefill_s)
        finished: set[str] = set()
        for rid, token in result.tokens.items():
            live = self.live.get(rid)
            if live is not None and await self._emit(live, token, prefill_s, count_in_core=False):
                finished.add(rid)
        self._start_ops(self.sched.finish_iteration(choice, time.time(), finished))

    async def _emit(self, live: Live, token: int, prefill_s: float | None = None,
                    count_in_core: bool = True) -> bool:
        """A new output token: streamed, or the final message if it ends the request (True)."""
        live.output.append(token)
        reason = self._finish_reason(live, token)
        if reason is None:
            await self._publish(TokenMessage(live.request.request_id, len(live.output) - 1, [token],
                                             node_id=self.s.node_id, prefill_s=prefill_s,
                                             attempt=live.request.attempt))
            return False
        await self._finish(live, reason, count_in_core=count_in_core, prefill_s=prefill_s)
        return True

    def _base_prediction(self, plan: StepPlan, model: str) -> float:
        """What the measured profile, uncorrected, says this iteration takes (calibration input)."""
        profile = self.base_perf.get(model, self.sched.node.hardware)
        inst = self.sched.node.instance(plan.iteration.instance_id)
        return predict_seconds(plan.iteration, inst, profile) if profile and inst else 0.0

    def _calibrate(self, model: str, plan: StepPlan, base_s: float, elapsed: float) -> None:
        """Online calibration: every iteration's actual time against the prediction the node
        decided with is exported; a drifting model's profile is corrected and published."""
        kind = PREFILL if plan.iteration.kind is IterationKind.PREFILL else DECODE
        if plan.predicted_s > 0:
            self.obs.prediction(model, kind, plan.iteration.request_ids, plan.predicted_s, elapsed)
        if self.calibrator.observe(model, kind, base_s, elapsed, time.time()) and self.s.calibrate:
            asyncio.create_task(self._publish_calibration(model), name=f"calibrate-{model}")

    async def _publish_calibration(self, model: str, quiet: bool = False) -> None:
        factors, seen = self.calibrator.factors(model), self.calibrator.seen(model)
        if not quiet:
            log.info("calibrated %s on %s: prefill x%.3f, decode x%.3f", model, self.s.node_id,
                     factors[PREFILL], factors[DECODE])
        try:
            await save_calibration(self.redis, self.s.node_id, model, self.s.hardware, factors, seen)
            self._published_seen[model] = seen
            if not quiet:  # a new factor: decide with it at once (a confirmation changes nothing)
                await self._load_profiles()
        except Exception:  # a Redis blip: the next correction publishes again
            log.exception("publishing the calibration of %s failed", model)

    def _finish_reason(self, live: Live, token: int) -> FinishReason | None:
        if live.cancelled:
            return FinishReason.CANCELLED
        if token in live.request.eos_token_ids:
            return FinishReason.STOP
        max_context = self.records[live.instance_id].max_context
        if len(live.output) >= live.request.max_tokens or len(live.all_tokens) >= max_context:
            return FinishReason.LENGTH
        return None

    async def _finish(self, live: Live, reason: FinishReason, error: str | None = None,
                      count_in_core: bool = True, prefill_s: float | None = None) -> None:
        """Send the final message (whole output, so the gateway can fill gaps) and forget it."""
        self.live.pop(live.request.request_id, None)
        engine = self.engines.get(live.instance_id)
        if engine is not None:
            engine.release(live.request.request_id)
        if count_in_core:
            self._start_ops(self.sched.cancel(live.request.request_id, time.time()))
        last = live.output[-1:] if reason is not FinishReason.CANCELLED else []
        final = TokenMessage(
            live.request.request_id, max(0, len(live.output) - len(last)), last, finished=True,
            finish_reason=reason, output_token_ids=list(live.output),
            prompt_tokens=len(live.request.prompt_token_ids), error=error, node_id=self.s.node_id,
            prefill_s=prefill_s, attempt=live.request.attempt)
        self._remember(live, RequestState.FINISHED, final)
        await self._publish(final)
        self.obs.ended(live.request.request_id, reason.value,
                       len(live.output) - len(live.request.resumed_token_ids), error)

    async def _drop_cancelled(self) -> None:
        for live in [lv for lv in self.live.values() if lv.cancelled]:
            await self._finish(live, FinishReason.CANCELLED)
        for live in [lv for lv in self.live.values() if lv.error is not None]:
            await self._finish(live, FinishReason.ERROR, live.error)
        now = time.time()
        for live in [lv for lv in self.live.values() if 0 < lv.request.deadline < now]:
            # The gateway stopped waiting (it timed out, or it died with the client's connection):
            # an orphan must not run on to max_tokens.
            await self._finish(live, FinishReason.CANCELLED, "deadline passed: nobody waits for it")

    async def _reschedule(self, eviction: Eviction) -> None:
        """An evicted request goes back to the placers with its tokens (token-based migration)."""
        rid = eviction.request.request_id
        with self.obs.use(rid):
            log.info("evicting %s from %s for rescheduling", rid, eviction.instance_id)
        resumed = self._take_back(rid, eviction.request.grace_s)
        if resumed is not None:
            await self._requeue(resumed)

    async def _requeue(self, resumed: InferenceRequest) -> None:
        """Back to the placers through the durable request stream, with its tokens so far. If
        the stream cannot take it now (NATS down), retried in the background until the request's
        deadline: the request left this node and must not be lost."""
        try:
            await self._publish_request(resumed)
        except Exception as exc:
            log.warning("requeue of %s failed (%r); retrying", resumed.request_id, exc)
            asyncio.create_task(self._requeue_later(resumed), name=f"requeue-{resumed.request_id}")

    async def _publish_request(self, resumed: InferenceRequest) -> None:
        msg_id = f"{resumed.request_id}:resume:{resumed.attempt}:{len(resumed.resumed_token_ids)}"
        await self.js.publish(REQUEST_SUBJECT, wire.encode(resumed),  # stays in the request's trace
                              headers={**resumed.trace_context, "Nats-Msg-Id": msg_id}, timeout=5)

    async def _requeue_later(self, resumed: InferenceRequest) -> None:
        delay = 0.25
        while not self._stopping:
            await asyncio.sleep(delay)
            if resumed.deadline and time.time() > resumed.deadline:
                log.warning("gave up requeueing %s: its deadline passed", resumed.request_id)
                return
            try:
                await self._publish_request(resumed)
                return
            except Exception:
                delay = min(2.0, delay * 2)

    async def _publish(self, message: TokenMessage, headers: bool = True) -> None:
        """Best effort (core NATS): a message lost while NATS is down is recovered by the
        gateway from the final message, or by asking this node (STATUS)."""
        try:
            await self.nc.publish(token_subject(message.request_id), wire.encode(message),
                                  headers=self.obs.message_headers(message.request_id, message.finished)
                                  if headers else None)
        except Exception as exc:
            log.warning("token message for %s not sent: %r", message.request_id, exc)


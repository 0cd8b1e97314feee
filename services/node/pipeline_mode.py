"""λScale's execute-while-load on a node worker (§4.3-4.4): a new instance whose model arrives
by multicast serves through an execution pipeline before its copy is whole, then switches to
local execution.

The placer chose the startup (`shared.core.startup`, PIPELINE) and sent it with the ADMIT
(`NodeCommand.pipeline`); the core's view of the instance carries it (`InstanceView.pipeline`:
validated with the pipeline's hops). Its helpers are of two kinds:

- a *DRAM holder* (`PipelineMode.ranges == ()`): a node holding the model in its DRAM tier
  runs every layer this node lacks, serving them from its DRAM tier's copy;
- *receivers* of the same multicast (λScale Algorithm 2, `ranges` non-empty): the k-way
  orders give them different parts of the model first, so each range of `ranges` runs on the
  receiver named there, served from the blocks of its own arriving copy.

The instance's LOAD op (a worker thread) then:

1. waits until the multicast under way (sent head-first) has brought this node the head's
   blocks and those of the layers it runs itself (`MulticastEndpoint.wait_blocks`, the layers a
   node can run from its blocks being `stages.holding_of`): for a DRAM holder, one layer (the
   first its sub-group's order brings: with k >= 2 sources not always layer 0), the holder then
   hosting each run of layers this node lacks; for receivers, until this node and the receivers
   `mode.helpers` names cover every layer between them, asking those what they hold (their
   endpoints' `holding`) as blocks arrive. The ranges are then cut from what each holds
   (`pipeline_stages`, this node the head), not taken from the plan's `ranges`: the core
   plans over an idealised layout (`pipeline.model_layout`: equal layers, blocks cut evenly),
   while the checkpoint's blocks end where its tensors do, and one converted before the run
   order (`loader/convert.py`) holds its layers in name order (0, 1, 10, 11, 2, ...); the view
   then names the ranges and hops really run;
2. asks each helper to host its range (HOST_LAYERS: the helper holds its bytes in its ledger and
   builds the stage, `services/node/stage_host.py`; a receiver first waits, bounded, for its own
   blocks of the range: `host_from_own_copy`);
3. builds the engine with the head and its own layers from the blocks already here (views of
   the multicast's buffers: no copy) and the ranges remote: the instance serves.

Then, once the whole model is here (`wait_for_model`), between two iterations (the token loop's
lock) the engine takes every remote range back with the K/V of every request in flight
(`take_layers`: the stage's K/V comes over, so greedy output does not change), the helpers are
told to release their stages, and the core's view of the instance says it runs alone.

Anything that keeps the pipeline from forming (no transfer came, a helper refused, a stage or
the engine failed to build) falls back to the ordinary path: the load waits for the whole copy
(the stages already hosted are released). A pipeline whose copy never completes keeps serving
through its helpers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from services.node.runtime import NodeRuntime
from services.node.engines.weights import held_tensors, holding_of
from shared.core.pipeline import Holding, StageRange, pipeline_stages, transfer_hops
from shared.core.types import HostedRange, PipelineMode
from shared.schemas import CommandKind, ModelRecord, NodeCommand, NodeReply
from shared.subjects import multicast_node_subject

log = logging.getLogger("slinfer.node.pipeline")
# A pipeline waits for its first blocks at most this many times the time its whole copy should
# take (and never less than FORM_MIN_WAIT_S); then the load waits for the whole copy instead.
FORM_PATIENCE = 4.0
FORM_MIN_WAIT_S = 30.0
HELPER_TIMEOUT_S = 120.0  # HOST_LAYERS: the helper builds the stage before it answers
# A receiver asked to host a range waits this long for its own blocks of it (the plan expects
# them about when the head holds its own layers: the k-way orders are known to both).
OWN_COPY_WAIT_S = 60.0
COVER_POLL_S = 0.1  # a receiver heading a pipeline asks the others what they hold this often
SWITCH_TRIES = 200  # the switch waits for a running memory op of the instance this often


@dataclass
class RemoteStage:
    """Layers [start, end) of a pipelined instance, run by a stage on `helper`."""

    helper: str
    start: int
    end: int
    address: str = ""  # the stage's host:port once hosted

    def layers(self) -> frozenset[int]:
        return frozenset(range(self.start, self.end))


@dataclass
class Pipelined:
    """An instance serving through a pipeline: `stages` run on their helpers, the rest here."""

    instance_id: str
    record: ModelRecord
    layers: int
    stages: list[RemoteStage]
    host: object | None  # the multicast's buffers (HostCheckpoint) the local layers view; None
    # once the pipeline is over
    events: dict[str, float] = field(default_factory=dict)  # what happened when (time.time())

    @property
    def local(self) -> frozenset[int]:
        """The decoder layers this node runs itself."""
        remote = frozenset().union(*(s.layers() for s in self.stages))
        return frozenset(range(self.layers)) - remote

    @property
    def helpers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.helper for s in self.stages))


class PipelineStarts:
    """The node's part of execute-while-load (module doc)."""

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self.serving: dict[str, Pipelined] = {}  # instance id -> its pipeline, until the switch
        self.history: list[Pipelined] = []  # every pipeline formed here (tests, benchmarks)
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """(The worker's event loop) The loop the load threads hand their calls to."""
        self.loop = asyncio.get_running_loop()

    # -- the LOAD op (a worker thread) ----------------------------------------------------------

    def load(self, instance_id: str, record: ModelRecord, kv_bytes: int):
        """The instance's engine serving through a pipeline, or None (load it the ordinary way)."""
        inst = self.rt.sched.node.instance(instance_id)
        mode = inst.pipeline if inst is not None else None
        if mode is None or self.rt.multicast is None or not mode.helpers or record.layers < 2 \
                or self.loop is None:
            return None
        try:
            return self._form(instance_id, record, kv_bytes, mode)
        except Exception as exc:  # the ordinary load still works: the copy is on its way
            log.warning("node %s: %s cannot serve through a pipeline (%r); waiting for its copy",
                        self.rt.s.node_id, instance_id, exc)
            self._run_alone(instance_id)
            return None

    def _form(self, instance_id: str, record: ModelRecord, kv_bytes: int, mode: PipelineMode):
        started = time.time()
        # `until`: when the copy should be whole
        deadline = started + max(FORM_MIN_WAIT_S, FORM_PATIENCE * (mode.until - started))
        found = self._cover(record, mode, deadline)
        if found is None:
            raise RuntimeError("no blocks of it arrived in time")
        host, remote = found
        blocks_at = time.time()
        if not remote:
            self._run_alone(instance_id)  # the whole copy (or every layer) came first: load it
            return None
        layers = record.layers
        pipe = Pipelined(instance_id, record, layers, remote, host, {"admitted": started,
                                                                    "blocks": blocks_at})
        try:
            for stage in remote:
                stage.address = self._host(stage, instance_id, record, kv_bytes, mode)
            pipe.events["hosted"] = time.time()
            engine = self._engine(record, kv_bytes, pipe,
                                  held_tensors(host, Holding("", pipe.local, True)))
        except BaseException:
            self._release(pipe)
            raise
        pipe.events["serving"] = time.time()
        self._in_view(instance_id, pipe)
        with self._lock:
            self.serving[instance_id] = pipe
            self.history.append(pipe)
        log.info("node %s: %s serves through a pipeline: %d layers here, %s", self.rt.s.node_id,
                 instance_id, len(pipe.local),
                 ", ".join(f"{s.start}-{s.end - 1} on {s.helper}" for s in remote))
        # One parseable line of the formation's timings (bench/scaleout.py --ewl reads it: the
        # core's `pipeline_setup_s` + engine start is what blocks -> serving took here).
        log.info("pipeline timings %s", json.dumps({
            "instance": instance_id, "node": self.rt.s.node_id, "local_layers": len(pipe.local),
            "remote": [[s.helper, s.start, s.end] for s in remote],
            "receivers": bool(mode.ranges),
            "wait_blocks_s": round(blocks_at - started, 4),
            "host_stage_s": round(pipe.events["hosted"] - blocks_at, 4),
            "head_engine_s": round(pipe.events["serving"] - pipe.events["hosted"], 4)}))
        self._call(self._switch_when_whole(pipe))
        return engine

    def _cover(self, record: ModelRecord, mode: PipelineMode, deadline: float):
        """Once this node holds the head and a layer, and its helpers hold every layer it lacks
        between them: the multicast's buffers and the stages of the runs they host ([] : the
        copy is whole; None: no cover by `deadline`).

        - A DRAM holder (`mode.ranges == ()`) holds every layer: the cover exists at once, the
          holder hosting each run this node lacks. The layer here is the first of its
          sub-group's order, with k >= 2 sources not always layer 0 (the core's estimate counts
          on it: `startup.plan_pipeline`).
        - Receivers (`mode.helpers`, hosting for each other) are asked what they hold as blocks
          arrive (polled): the ranges come from what each holds *now*, since the checkpoint's
          real blocks, not the core's idealised layout, decide who holds which layers first."""
        everything = Holding(mode.helpers[0], frozenset(range(record.layers)), True)
        while True:
            got = self.rt.multicast.wait_blocks(record.path, _heads, deadline - time.time())
            if got is None:
                return None
            manifest, host, have = got
            if len(have) == len(manifest.blocks):
                return host, []
            others = [self._holding(h, record) for h in mode.helpers] if mode.ranges \
                else [everything]
            runs = _remote_runs(manifest, have, self.rt.s.node_id, others, record.layers)
            if runs is not None:
                return host, runs
            if time.time() > deadline:
                return None
            time.sleep(COVER_POLL_S)

    def _holding(self, node: str, record: ModelRecord) -> Holding:
        """What another receiver can run of the model now (its endpoint's `holding`)."""
        try:
            data = self._call(self.rt.outbox.query(
                multicast_node_subject(node),
                json.dumps({"op": "holding", "model_path": record.path}).encode(), timeout=5.0),
                wait_s=6.0)
            body = json.loads(data)
        except Exception as exc:  # it may come back at the next poll
            log.debug("receiver %s did not say what it holds: %r", node, exc)
            return Holding(node, frozenset(), False)
        if body.get("whole"):
            return Holding(node, frozenset(range(record.layers)), True)
        return Holding(node, frozenset(body.get("layers", ())), bool(body.get("head")))

    def _in_view(self, instance_id: str, pipe: Pipelined) -> None:
        """The core's view of the instance names its stages (the helpers keep them while an
        instance's view uses them) and the hops it really pays (the core validates its requests
        with them); for receivers, the ranges they really run."""
        inst = self.rt.sched.node.instance(instance_id)
        if inst is None or inst.pipeline is None:
            return
        me = self.rt.s.node_id
        runs = [StageRange(s.helper, s.start, s.end) for s in pipe.stages]
        runs += [StageRange(me, i, i + 1) for i in sorted(pipe.local)]
        mode = replace(inst.pipeline, stages=tuple(s.address for s in pipe.stages),
                       hops=transfer_hops(sorted(runs, key=lambda r: r.start), me))
        if mode.ranges:
            mode = replace(mode, helpers=pipe.helpers, ranges=tuple(
                HostedRange(s.helper, s.start, s.end) for s in pipe.stages))
        self.rt.sched.set_pipeline(instance_id, mode)

    def _host(self, stage: RemoteStage, instance_id: str, record: ModelRecord, kv_bytes: int,
              mode: PipelineMode) -> str:
        """HOST_LAYERS on the stage's helper: its address. A DRAM holder holds the range's
        weights and K/V; a receiver (`mode.ranges`, sent along so it knows it hosts from its own
        copy) the K/V only: its own instance's bytes count the weights (as the core's
        `startup.hosted_layer_bytes`)."""
        layers = record.layers
        count = stage.end - stage.start
        kv = int(kv_bytes * count / layers)
        weights = 0 if mode.ranges else (record.weight_bytes - record.head_bytes) * count // layers
        cmd = NodeCommand(CommandKind.HOST_LAYERS, instance_id=instance_id, model=record,
                          layer_start=stage.start, layer_end=stage.end,
                          stage_node=self.rt.s.node_id, stage_bytes=max(1, weights + kv),
                          # its share of the helper's compute (`cost.pipeline_helper_loads`)
                          stage_load=count / max(1, layers),
                          pipeline=mode if mode.ranges else None)
        reply = self._call(self._ask(stage.helper, cmd), wait_s=HELPER_TIMEOUT_S + 5)
        if not reply.accepted or not reply.stage_address:
            raise RuntimeError(f"helper {stage.helper} refused layers {stage.start}:{stage.end}: "
                               f"{reply.reason}")
        return reply.stage_address

    def _engine(self, record: ModelRecord, kv_bytes: int, pipe: Pipelined, weights):
        from services.node.engines.torch_engine import TorchEngine

        # The pool of the local layers only, in as many blocks as the whole instance's: the
        # stages mirror it, and the switch adds the other layers' pools (the ledger's kv_bytes).
        engine = TorchEngine(record.path, device=self.rt.s.device,
                             kv_capacity_bytes=kv_bytes * len(pipe.local) // record.layers,
                             loader=self.rt.loader, remote_layers=[s.address for s in pipe.stages],
                             weights=weights)
        engine.load()
        engine.load_info["tier"] = "pipeline"  # the node's LoadRecord says how it started
        return engine

    # -- a receiver hosting for another receiver (HOST_LAYERS with `ranges`) ----------------------

    async def host_from_own_copy(self, cmd: NodeCommand) -> tuple[dict | None, str | None]:
        """(The worker's event loop) The tensors of layers [start, end) of `cmd.model` from this
        node's own copy: views of the blocks of its multicast under way once they cover the
        range (waited for up to OWN_COPY_WAIT_S), or None when its DRAM tier holds the whole
        copy already (the stage host views that). The second item: why it cannot (or None)."""
        path = cmd.model.path
        if self._in_dram(path):
            return None, None
        if self.rt.multicast is None:
            return None, "not_here: no multicast endpoint to receive the model by"
        want = frozenset(range(cmd.layer_start, cmd.layer_end))
        got = await asyncio.to_thread(
            self.rt.multicast.wait_blocks, path,
            lambda m, have: want <= holding_of(m.index, list(m.blocks), set(have)).layers,
            OWN_COPY_WAIT_S)
        if got is None:  # no transfer under way: it may have completed meanwhile
            return (None, None) if self._in_dram(path) else \
                (None, f"not_here: layers {cmd.layer_start}:{cmd.layer_end} did not arrive")
        _, host, _ = got
        return held_tensors(host, Holding("", want, False)), None

    def _in_dram(self, path: str) -> bool:
        try:
            return self.rt.loader is not None and self.rt.loader.tier_of(path) == "dram"
        except Exception:  # noqa: BLE001 - not a converted checkpoint here
            return False

    # -- the switch (the worker's event loop) ---------------------------------------------------

    async def _switch_when_whole(self, pipe: Pipelined) -> None:
        """Wait for the transfer to end (also when the instance went first: the node's view
        says the model is arriving until then), then switch if the copy is whole."""
        arrival = self.rt.arriving.get(pipe.record.name)
        since = arrival.since if arrival is not None else 0.0
        whole = None
        while whole is None and not self.rt.stopping:
            whole = await asyncio.to_thread(self.rt.multicast.wait_for_model, pipe.record.path,
                                            since, 5.0)
        if arrival is not None and self.rt.arriving.get(pipe.record.name) is arrival:
            self.rt.arriving.pop(pipe.record.name, None)  # the transfer is over
        if not whole:
            if whole is False and pipe.instance_id in self.serving:
                log.warning("node %s: %s's copy did not arrive whole; it goes on serving "
                            "through its pipeline", self.rt.s.node_id, pipe.instance_id)
            return
        pipe.events["whole"] = time.time()
        if pipe.instance_id not in self.serving:
            return  # unloaded before its copy was whole: its stages were released then
        try:
            await self._switch(pipe)
        except Exception as exc:
            log.warning("node %s: %s's switch to local execution failed (%r); it goes on "
                        "serving through its pipeline", self.rt.s.node_id, pipe.instance_id, exc)

    async def _switch(self, pipe: Pipelined) -> None:
        """Take every remote range back between two iterations with no memory op of the
        instance running (`NodeRuntime.changing`: a K/V resize waits meanwhile, and then sizes
        the pool of every layer); retried while one runs."""
        rest = Holding("", frozenset(range(pipe.layers)) - pipe.local, False)
        tensors = held_tensors(pipe.host, rest)

        def take() -> None:
            engine = self.rt.engines.get(pipe.instance_id)
            if engine is None or pipe.instance_id not in self.serving:
                raise LookupError("unloaded")
            for stage in pipe.stages:  # each stage whole (stages.Split.take)
                engine.take_layers(stage.start, stage.end, tensors)
            with self._lock:
                self.serving.pop(pipe.instance_id, None)

        for _ in range(SWITCH_TRIES):
            error = await self.rt.changing(pipe.instance_id, take)
            if not (isinstance(error, RuntimeError) and str(error).startswith("busy")):
                break
            await asyncio.sleep(0.05)
        if isinstance(error, LookupError):
            return
        if error is not None:
            raise error
        self._run_alone(pipe.instance_id)
        pipe.events["switched"] = time.time()
        log.info("node %s: %s runs alone now (layers %s taken back from %s)", self.rt.s.node_id,
                 pipe.instance_id, ", ".join(f"{s.start}-{s.end - 1}" for s in pipe.stages),
                 ",".join(pipe.helpers))
        log.info("pipeline timings %s", json.dumps({
            "instance": pipe.instance_id, "node": self.rt.s.node_id,
            "switch_s": round(pipe.events["switched"] - pipe.events["whole"], 4)}))
        await self._release_async(pipe)

    def kv_share(self, instance_id: str, kv_bytes: int) -> int:
        """The K/V bytes of the layers the instance runs here (all of them once it switched):
        its pool keeps as many blocks as the whole instance's `kv_bytes` would have."""
        pipe = self.serving.get(instance_id)
        return kv_bytes if pipe is None else kv_bytes * len(pipe.local) // pipe.layers

    # -- unload -----------------------------------------------------------------------------------

    def unloaded(self, instance_id: str) -> None:
        """(Any thread) The instance is gone: its helpers' stages go too."""
        with self._lock:
            pipe = self.serving.pop(instance_id, None)
        if pipe is not None:
            self._call(self._release_async(pipe))

    # -- helpers ----------------------------------------------------------------------------------

    def _run_alone(self, instance_id: str) -> None:
        """The core's view: the instance runs all its layers here (validated without hops)."""
        self.rt.sched.set_pipeline(instance_id, None)

    def _release(self, pipe: Pipelined) -> None:
        self._call(self._release_async(pipe), wait_s=30.0)

    async def _release_async(self, pipe: Pipelined) -> None:
        # The pipeline is over (switched, unloaded or never served): its record in `history`
        # must not keep the copy's buffers from the loader's pool.
        pipe.host = None
        await asyncio.gather(*(self._release_stage(pipe.instance_id, s) for s in pipe.stages))
        pipe.events["released"] = time.time()

    async def _release_stage(self, instance_id: str, stage: RemoteStage) -> None:
        cmd = NodeCommand(CommandKind.RELEASE_LAYERS, instance_id=instance_id,
                          layer_start=stage.start, layer_end=stage.end,
                          stage_node=self.rt.s.node_id)
        try:
            reply = await self._ask(stage.helper, cmd)
            if not reply.accepted:
                log.warning("helper %s kept %s's stage %d:%d: %s", stage.helper, instance_id,
                            stage.start, stage.end, reply.reason)
        except Exception as exc:  # its orphan check releases it (stage_host.ORPHAN_GRACE_S)
            log.warning("could not tell helper %s to release %s's stage: %r", stage.helper,
                        instance_id, exc)

    async def _ask(self, node: str, cmd: NodeCommand) -> NodeReply:
        return await self.rt.outbox.command(node, cmd, HELPER_TIMEOUT_S)

    def _call(self, coro, wait_s: float | None = None):
        """Run `coro` on the worker's event loop from a worker thread; wait for its result
        when `wait_s` is given, else let it run on (a task)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(wait_s) if wait_s is not None else future


def _remote_runs(manifest, have, me: str, others: list[Holding],
                 layers: int) -> list[RemoteStage] | None:
    """With the blocks `have`, node `me` heads a pipeline in which `others` run each run of
    layers it lacks (`pipeline_stages`): those runs as stages ([] : it holds every layer; None:
    no cover yet)."""
    mine = holding_of(manifest.index, list(manifest.blocks), set(have), me)
    stages = pipeline_stages([mine, *others], layers, head_node=me)
    if stages is None:
        return None
    return [RemoteStage(s.node, s.start, s.end) for s in stages if s.node != me]


def _heads(manifest, have) -> bool:
    """This node holds the head and at least one layer: it can head a pipeline."""
    holding = holding_of(manifest.index, list(manifest.blocks), set(have))
    return holding.head and bool(holding.layers)

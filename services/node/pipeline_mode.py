"""λScale's execute-while-load on a node worker (§4.3-4.4): a new instance whose model arrives
by multicast serves through an execution pipeline before its copy is whole, then switches to
local execution.

The placer chose the startup (`shared.core.startup`, PIPELINE) and sent it with the ADMIT
(`NodeCommand.pipeline`); the core's view of the instance carries it (`InstanceView.pipeline`:
validated with the pipeline's hops). The instance's LOAD op (a worker thread) then:

1. waits until the multicast under way (sent head-first) has brought this node the head's
   blocks and those of layers 0..p-1 (p >= 1): `MulticastEndpoint.wait_blocks`, the layers a
   node can run from its blocks being `stages.holding_of`;
2. asks the helper (a node holding the model in its DRAM tier) to host layers [p, L) for it
   (HOST_LAYERS: the helper holds their bytes in its ledger and serves them from its DRAM
   tier's copy, `services/node/stage_host.py`);
3. builds the engine with layers [0, p) and the head from the blocks already here (views of the
   multicast's buffers: no copy) and [p, L) remote: the instance serves.

Then, once the whole model is here (`wait_for_model`), between two iterations (the token loop's
lock) the engine takes layers [p, L) with the K/V of every request in flight (`take_layers`:
the stage's K/V comes over, so greedy output does not change), the helper is told to release
the stage, and the core's view of the instance says it runs alone.

Anything that keeps the pipeline from forming (no transfer came, the helper refused, the stage
or the engine failed to build) falls back to the ordinary path: the load waits for the whole
copy. A pipeline whose copy never completes keeps serving through its helper.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from services.node.stages import held_tensors, holding_of
from shared import wire
from shared.core.pipeline import Holding
from shared.core.types import PipelineMode
from shared.schemas import CommandKind, ModelRecord, NodeCommand, NodeReply
from shared.subjects import node_command_subject

if TYPE_CHECKING:
    from services.node.worker import NodeWorker

log = logging.getLogger("slinfer.node.pipeline")
# A pipeline waits for its first blocks at most this many times the time its whole copy should
# take (and never less than FORM_MIN_WAIT_S); then the load waits for the whole copy instead.
FORM_PATIENCE = 4.0
FORM_MIN_WAIT_S = 30.0
HELPER_TIMEOUT_S = 120.0  # HOST_LAYERS: the helper builds the stage before it answers
SWITCH_TRIES = 200  # the switch waits for a running memory op of the instance this often


@dataclass
class Pipelined:
    """An instance serving through a pipeline: layers [split, layers) on `helper`."""

    instance_id: str
    record: ModelRecord
    helper: str
    split: int
    layers: int
    address: str
    host: object | None  # the multicast's buffers (HostCheckpoint) the local layers view; None
    # once the pipeline is over
    events: dict[str, float] = field(default_factory=dict)  # what happened when (time.time())


class PipelineStarts:
    """The node worker's part of execute-while-load (module doc)."""

    def __init__(self, worker: NodeWorker) -> None:
        self.w = worker
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
        inst = self.w.sched.node.instance(instance_id)
        mode = inst.pipeline if inst is not None else None
        if mode is None or self.w.multicast is None or not mode.helpers or record.layers < 2 \
                or self.loop is None:
            return None
        try:
            return self._form(instance_id, record, kv_bytes, mode)
        except Exception as exc:  # the ordinary load still works: the copy is on its way
            log.warning("node %s: %s cannot serve through a pipeline (%r); waiting for its copy",
                        self.w.s.node_id, instance_id, exc)
            self._run_alone(instance_id)
            return None

    def _form(self, instance_id: str, record: ModelRecord, kv_bytes: int, mode: PipelineMode):
        started = time.time()
        got = self.w.multicast.wait_blocks(  # `until`: when the copy should be whole
            record.path, lambda manifest, have: _split(manifest, have) > 0,
            max(FORM_MIN_WAIT_S, FORM_PATIENCE * (mode.until - started)))
        if got is None:
            raise RuntimeError("no blocks of it arrived in time")
        manifest, host, have = got
        blocks_at = time.time()
        if len(have) == len(manifest.blocks):
            self._run_alone(instance_id)  # the whole copy came first: load it as usual
            return None
        layers = record.layers
        split = _split(manifest, have)
        if split >= layers:  # every layer is here already: nothing to run elsewhere
            self._run_alone(instance_id)
            return None
        helper = mode.helpers[0]
        address = self._host(helper, instance_id, record, split, layers, kv_bytes)
        pipe = Pipelined(instance_id, record, helper, split, layers, address, host,
                         {"admitted": started, "blocks": blocks_at, "hosted": time.time()})
        try:
            engine = self._engine(record, kv_bytes, split, address,
                                  held_tensors(host, Holding("", frozenset(range(split)), True)))
        except BaseException:
            self._release(pipe)
            raise
        pipe.events["serving"] = time.time()
        inst = self.w.sched.node.instance(instance_id)
        if inst is not None and inst.pipeline is not None:  # the view names the helper's stage
            inst.pipeline = replace(inst.pipeline, stages=(address,))
        with self._lock:
            self.serving[instance_id] = pipe
            self.history.append(pipe)
        log.info("node %s: %s serves through a pipeline: layers 0-%d here, %d-%d on %s",
                 self.w.s.node_id, instance_id, split - 1, split, layers - 1, helper)
        # One parseable line of the formation's timings (bench/scaleout.py --ewl reads it: the
        # core's `pipeline_setup_s` + engine start is what blocks -> serving took here).
        log.info("pipeline timings %s", json.dumps({
            "instance": instance_id, "node": self.w.s.node_id, "split": split,
            "wait_blocks_s": round(blocks_at - started, 4),
            "host_stage_s": round(pipe.events["hosted"] - blocks_at, 4),
            "head_engine_s": round(pipe.events["serving"] - pipe.events["hosted"], 4)}))
        self._call(self._switch_when_whole(pipe))
        return engine

    def _host(self, helper: str, instance_id: str, record: ModelRecord, split: int, layers: int,
              kv_bytes: int) -> str:
        """HOST_LAYERS on the helper: its stage's address."""
        share = (layers - split) / layers
        weights = (record.weight_bytes - record.head_bytes) * (layers - split) // layers
        cmd = NodeCommand(CommandKind.HOST_LAYERS, instance_id=instance_id, model=record,
                          layer_start=split, layer_end=layers, stage_node=self.w.s.node_id,
                          stage_bytes=weights + int(kv_bytes * share))
        reply = self._call(self._ask(helper, cmd), wait_s=HELPER_TIMEOUT_S + 5)
        if not reply.accepted or not reply.stage_address:
            raise RuntimeError(f"helper {helper} refused layers {split}:{layers}: {reply.reason}")
        return reply.stage_address

    def _engine(self, record: ModelRecord, kv_bytes: int, split: int, address: str, weights):
        from services.node.engines.torch_engine import TorchEngine

        # The pool of the local layers only, in as many blocks as the whole instance's: the
        # stage mirrors it, and the switch adds the other layers' pools (the ledger's kv_bytes).
        engine = TorchEngine(record.path, device=self.w.s.device,
                             kv_capacity_bytes=kv_bytes * split // record.layers,
                             loader=self.w.loader, remote_layers=[address], weights=weights)
        engine.load()
        engine.load_info["tier"] = "pipeline"  # the node's LoadRecord says how it started
        return engine

    # -- the switch (the worker's event loop) ---------------------------------------------------

    async def _switch_when_whole(self, pipe: Pipelined) -> None:
        """Wait for the transfer to end (also when the instance went first: the node's view
        says the model is arriving until then), then switch if the copy is whole."""
        arrival = self.w.arriving.get(pipe.record.name)
        since = arrival.since if arrival is not None else 0.0
        whole = None
        while whole is None and not self.w._stopping:
            whole = await asyncio.to_thread(self.w.multicast.wait_for_model, pipe.record.path,
                                            since, 5.0)
        if arrival is not None and self.w.arriving.get(pipe.record.name) is arrival:
            self.w.arriving.pop(pipe.record.name, None)  # the transfer is over
        if not whole:
            if whole is False and pipe.instance_id in self.serving:
                log.warning("node %s: %s's copy did not arrive whole; it goes on serving "
                            "through its pipeline", self.w.s.node_id, pipe.instance_id)
            return
        pipe.events["whole"] = time.time()
        if pipe.instance_id not in self.serving:
            return  # unloaded before its copy was whole: its stage was released then
        try:
            await self._switch(pipe)
        except Exception as exc:
            log.warning("node %s: %s's switch to local execution failed (%r); it goes on "
                        "serving through its pipeline", self.w.s.node_id, pipe.instance_id, exc)

    async def _switch(self, pipe: Pipelined) -> None:
        """Take the layers back between two iterations with no memory op of the instance
        running (`LayerMoves._changing`: a K/V resize waits meanwhile, and then sizes the
        pool of every layer); retried while one runs."""
        rest = Holding("", frozenset(range(pipe.split, pipe.layers)), False)
        tensors = held_tensors(pipe.host, rest)

        def take() -> None:
            engine = self.w.engines.get(pipe.instance_id)
            if engine is None or pipe.instance_id not in self.serving:
                raise LookupError("unloaded")
            engine.take_layers(pipe.split, pipe.layers, tensors)
            with self._lock:
                self.serving.pop(pipe.instance_id, None)

        for _ in range(SWITCH_TRIES):
            error = await self.w.layers._changing(pipe.instance_id, take)
            if not (isinstance(error, RuntimeError) and str(error).startswith("busy")):
                break
            await asyncio.sleep(0.05)
        if isinstance(error, LookupError):
            return
        if error is not None:
            raise error
        self._run_alone(pipe.instance_id)
        pipe.events["switched"] = time.time()
        log.info("node %s: %s runs alone now (layers %d-%d taken back from %s)",
                 self.w.s.node_id, pipe.instance_id, pipe.split, pipe.layers - 1, pipe.helper)
        log.info("pipeline timings %s", json.dumps({
            "instance": pipe.instance_id, "node": self.w.s.node_id,
            "switch_s": round(pipe.events["switched"] - pipe.events["whole"], 4)}))
        await self._release_async(pipe)

    def kv_share(self, instance_id: str, kv_bytes: int) -> int:
        """The K/V bytes of the layers the instance runs here (all of them once it switched):
        its pool keeps as many blocks as the whole instance's `kv_bytes` would have."""
        pipe = self.serving.get(instance_id)
        return kv_bytes if pipe is None else kv_bytes * pipe.split // pipe.layers

    # -- unload -----------------------------------------------------------------------------------

    def unloaded(self, instance_id: str) -> None:
        """(Any thread) The instance is gone: its helper's stage goes too."""
        with self._lock:
            pipe = self.serving.pop(instance_id, None)
        if pipe is not None:
            self._call(self._release_async(pipe))

    # -- helpers ----------------------------------------------------------------------------------

    def _run_alone(self, instance_id: str) -> None:
        """The core's view: the instance runs all its layers here (validated without hops)."""
        inst = self.w.sched.node.instance(instance_id)
        if inst is not None:
            inst.pipeline = None

    def _release(self, pipe: Pipelined) -> None:
        self._call(self._release_async(pipe), wait_s=30.0)

    async def _release_async(self, pipe: Pipelined) -> None:
        # The pipeline is over (switched, unloaded or never served): its record in `history`
        # must not keep the copy's buffers from the loader's pool.
        pipe.host = None
        cmd = NodeCommand(CommandKind.RELEASE_LAYERS, instance_id=pipe.instance_id,
                          layer_start=pipe.split, layer_end=pipe.layers,
                          stage_node=self.w.s.node_id)
        try:
            reply = await self._ask(pipe.helper, cmd)
            pipe.events["released"] = time.time()
            if not reply.accepted:
                log.warning("helper %s kept %s's stage: %s", pipe.helper, pipe.instance_id,
                            reply.reason)
        except Exception as exc:  # its orphan check releases it (stage_host.ORPHAN_GRACE_S)
            log.warning("could not tell helper %s to release %s's stage: %r", pipe.helper,
                        pipe.instance_id, exc)

    async def _ask(self, node: str, cmd: NodeCommand) -> NodeReply:
        msg = await self.w.nc.request(node_command_subject(node), wire.encode(cmd),
                                      timeout=HELPER_TIMEOUT_S)
        return wire.decode(NodeReply, msg.data)

    def _call(self, coro, wait_s: float | None = None):
        """Run `coro` on the worker's event loop from a worker thread; wait for its result
        when `wait_s` is given, else let it run on (a task)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(wait_s) if wait_s is not None else future


def _split(manifest, have) -> int:
    """p: this node holds the head and layers 0..p-1 whole (0: it cannot head a pipeline yet)."""
    holding = holding_of(manifest.index, list(manifest.blocks), set(have))
    if not holding.head:
        return 0
    p = 0
    while p in holding.layers:
        p += 1
    return p

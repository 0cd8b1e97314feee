"""A node worker hosting decoder layers of another node's instance (CoCoServe's module
migration and replication, λScale's execution pipelines).

Each hosted range is a `LayerStage` served by a `StageServer` from a thread of the node
worker's own process (no extra process: the weights may be views of bytes the node already
holds, its DRAM tier or blocks of a multicast still arriving). It is keyed by
`shared.core.modules.stage_key(instance, start, end)`, the name its bytes carry in the node's
memory ledger: the node worker holds them there (`NodeScheduler.hold`) before the stage is
built, as a LOAD memory op that the reservation station starts once it fits, so the core (and
through the published view, the placers) sees them like an instance's.

Where the weights come from, fastest first:
- `tensors=`: a dict name -> tensor given by the caller (e.g. `weights.held_tensors` of a
  partly received multicast); only the range's tensors are used, no copy on CPU;
- the node's DRAM tier, when it holds the model's converted checkpoint (views, no copy);
- the model's files: the range's tensors only (`weights.read_tensors`).

A hosted range is released on command (`release`), when its owner instance is gone from the
cluster view (`orphans`), or when the node stops (`close`).

API (synchronous: call from a worker thread, the builds read weights):

    host = StageHost(loader, bind_host="127.0.0.1", advertise_host=None)
    host.expect(key, model_path, start, end, owner_instance, owner_node)   # before the hold
    hosted = host.build(key)                       # the LOAD op of the hold: builds and serves
    hosted = host.serve(key, model_path, start, end, owner_instance, owner_node, tensors=...)
    hosted.address, hosted.weight_bytes, hosted.bytes()    # "host:port", weights, + K/V pool
    host.run_op(op.kind.value, op.instance_id)     # the node worker's memory op of a stage key
    host.release(key) / host.release_owner(instance) / host.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shared.core.modules import stage_key

if TYPE_CHECKING:
    import torch

    from services.node.loader import CheckpointLoader
    from services.node.engines.stage_server import StageServer

log = logging.getLogger("slinfer.stage_host")
STAGE_KEY_MARK = "/layers/"
# A hosted range whose owner instance is not in the cluster view is released only after this
# long (the owner's node publishes its view every heartbeat; a new instance may not be in it yet).
ORPHAN_GRACE_S = 30.0


def is_stage_key(key: str) -> bool:
    return STAGE_KEY_MARK in key


def parse_stage_key(key: str) -> tuple[str, int, int]:
    """(owner instance, start, end) of a `stage_key`; ValueError for anything else."""
    iid, sep, rng = key.rpartition(STAGE_KEY_MARK)
    start, colon, end = rng.partition(":")
    if not sep or not colon or not start.isdigit() or not end.isdigit():
        raise ValueError(f"{key!r} is not a stage key")
    return iid, int(start), int(end)


@dataclass(frozen=True)
class StageOrder:
    """What a stage to build is (announced by `expect` before its hold's LOAD op runs)."""

    key: str
    model_path: str
    start: int
    end: int
    owner_instance: str
    owner_node: str
    tensors: Mapping[str, torch.Tensor] | None = None
    # The weights are this node's own copy of the model, which its own instance's bytes count
    # already (a receiver hosting for another receiver, λScale Algorithm 2): the stage's bytes
    # are its K/V pool only.
    own_copy: bool = False


@dataclass
class HostedStage:
    order: StageOrder
    server: StageServer
    address: str  # what the owner's engine connects to (the advertised host)
    weight_bytes: int
    source: str  # tensors | dram | files
    load_s: float
    created: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        return self.order.key

    def bytes(self, copy_counted: bool | None = None) -> int:
        """Its memory now: weights plus the K/V pool the owner sized (it mirrors the owner's).
        A stage on the node's own copy counts no weights while an instance of the node holds
        that copy (`copy_counted`, by default: while it is the node's own copy); once that
        instance is gone the stage's views keep the copy alive, so its weights count again."""
        mem = self.server.stage.memory()
        counted = self.order.own_copy if copy_counted is None else copy_counted
        weights = 0 if counted else self.weight_bytes
        return weights + mem["kv_blocks"] * mem["kv_block_bytes"]


class StageHost:
    """The node's hosted layer ranges, by stage key."""

    def __init__(self, loader: CheckpointLoader | None = None, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, device: str = "cpu") -> None:
        self.loader = loader
        self.bind_host = bind_host
        self.advertise_host = advertise_host or bind_host
        self.device = device
        self.hosted: dict[str, HostedStage] = {}
        self.orders: dict[str, StageOrder] = {}
        self._lock = threading.Lock()

    # -- building ------------------------------------------------------------------------------

    def expect(self, key: str, model_path: str, start: int, end: int, owner_instance: str,
               owner_node: str, tensors: Mapping[str, torch.Tensor] | None = None,
               own_copy: bool = False) -> StageOrder:
        """Announce a stage that `build(key)` makes later (the hold's LOAD op)."""
        if key != stage_key(owner_instance, start, end):
            raise ValueError(f"{key!r} is not the stage key of {owner_instance} {start}:{end}")
        if not 0 <= start < end:
            raise ValueError(f"layers {start}:{end} are not a range")
        order = StageOrder(key, str(model_path), start, end, owner_instance, owner_node, tensors,
                           own_copy)
        with self._lock:
            if key in self.hosted:
                raise ValueError(f"{key} is hosted here already")
            self.orders[key] = order
        return order

    def build(self, key: str) -> HostedStage:
        """Build and serve the stage announced under `key` (idempotent: a built one is kept)."""
        with self._lock:
            if key in self.hosted:
                return self.hosted[key]
            order = self.orders.get(key)
        if order is None:
            raise KeyError(f"no stage {key} was announced here")
        hosted = self._make(order)
        with self._lock:
            if self.orders.pop(key, None) is None:  # released while it was being built
                hosted.server.stop()
                raise RuntimeError(f"stage {key} was released while it was built")
            self.hosted[key] = hosted
        log.info("hosting %s (%s) at %s: %d weight bytes from %s in %.2f s", key,
                 Path(order.model_path).name, hosted.address, hosted.weight_bytes, hosted.source,
                 hosted.load_s)
        return hosted

    def serve(self, key: str, model_path: str, start: int, end: int, owner_instance: str,
              owner_node: str, tensors: Mapping[str, torch.Tensor] | None = None) -> HostedStage:
        """`expect` and `build` in one call (for a caller that accounted the bytes itself)."""
        self.expect(key, model_path, start, end, owner_instance, owner_node, tensors)
        try:
            return self.build(key)
        except BaseException:
            with self._lock:
                self.orders.pop(key, None)
            raise

    def _make(self, order: StageOrder) -> HostedStage:
        from services.node.engines.stage_server import LayerStage, StageServer

        started = time.perf_counter()
        tensors, source = self._weights(order)
        stage = LayerStage(order.model_path, order.start, order.end, device=self.device,
                           tensors=tensors)
        server = StageServer(stage, host=self.bind_host)
        return HostedStage(order, server, f"{self.advertise_host}:{server.port}",
                           stage.weight_bytes, source, time.perf_counter() - started)

    def _weights(self, order: StageOrder) -> tuple[Mapping[str, torch.Tensor] | None, str]:
        """The range's tensors: given, else views of the DRAM tier's copy, else None (the
        stage reads the range's bytes from the model's files)."""
        if order.tensors is not None:
            return order.tensors, "tensors"
        loader = self.loader
        if loader is not None:
            try:
                in_dram = loader.tier_of(order.model_path) == "dram"
            except Exception:  # noqa: BLE001 - no converted checkpoint: read the files
                in_dram = False
            if in_dram:
                import torch

                return loader.host_checkpoint(order.model_path).tensors(torch.device("cpu")), "dram"
        return None, "files"

    def run_op(self, kind: str, key: str) -> None:
        """A memory op of a stage key (worker thread): its hold's LOAD builds the announced
        stage (a later resize of a built one changes nothing here: the owner sizes its pool);
        its UNLOAD releases it."""
        if kind == "unload":
            self.release(key)
        else:
            self.build(key)

    # -- queries -------------------------------------------------------------------------------

    def get(self, key: str) -> HostedStage | None:
        return self.hosted.get(key)

    def owns(self, key: str) -> bool:
        return key in self.hosted or key in self.orders

    def keys(self) -> list[str]:
        with self._lock:
            return sorted({*self.hosted, *self.orders})

    def bytes(self, key: str) -> int:
        hosted = self.hosted.get(key)
        return hosted.bytes() if hosted is not None else 0

    def orphans(self, in_use: Iterable[str], now: float) -> list[str]:
        """Hosted ranges whose address no instance's layout uses (`in_use`: the addresses in
        the cluster view's layouts that name this node), older than the grace: their owner went
        away, dropped them or never attached them, without releasing them."""
        used = set(in_use)
        return [k for k, h in list(self.hosted.items())
                if h.address not in used and now - h.created > ORPHAN_GRACE_S]

    # -- releasing -----------------------------------------------------------------------------

    def release(self, key: str) -> bool:
        """Stop serving the range and drop its weights; False when it was not here."""
        with self._lock:
            hosted = self.hosted.pop(key, None)
            announced = self.orders.pop(key, None)
        if hosted is None:
            return announced is not None
        hosted.server.stop()
        log.info("released %s (%s)", key, hosted.address)
        return True

    def release_owner(self, instance_id: str) -> list[str]:
        keys = [k for k in self.keys() if parse_stage_key(k)[0] == instance_id]
        for key in keys:
            self.release(key)
        return keys

    def close(self) -> None:
        for key in self.keys():
            self.release(key)

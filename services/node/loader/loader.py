"""The node's multi-tier checkpoint loader (ServerlessLLM §4.2): DRAM cache, local disk, registry.

    load(model_path) -> LoadResult(state_dict, tier, seconds, bytes, ...)

A load is served by the fastest tier that holds the model's converted checkpoint:

* **dram**: the node's host-memory pool of checkpoints (LRU, byte budget). A hit builds tensors
  that *view* the pooled memory: on a CPU node the engine computes straight from it, so a hit
  costs no copy at all (`copy=True` gives private tensors: one bulk copy per partition into
  pool buffers); on a CUDA node the pool is pinned and each tensor is one DMA to the device.
* **disk**: a copy of the checkpoint on the node's own disk (LRU, byte budget), made in the
  background after a load from the registry.
* **registry**: the converted checkpoint in the registry's storage (the model's directory,
  `slinfer-checkpoint/`).

Disk and registry reads go through `ParallelReader` (chunked, parallel O_DIRECT) into aligned
buffers of the pool; nothing is copied between the read and the engine. Loads that touch a disk
run one at a time (a single I/O queue per node, as in the paper, so a load's time is predictable
from its size and the tier's bandwidth); DRAM hits do not wait for them. Every load measures its
tier's bandwidth, which `tiers_report()` and `estimate()` (the paper's q + n/b startup time) use.

Pool memory shared with an engine is not freed when the DRAM tier evicts the entry: it lives as
long as the engine's tensors do, and is then returned to the OS. So the DRAM budget bounds what
the cache alone keeps alive; weights in use are the instance's memory, as the node accounts them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint_format import (INDEX_FILE, CheckpointIndex, default_checkpoint_dir, read_index,
                                source_fingerprint)
from .convert import convert_checkpoint
from .direct_io import ParallelReader, ReadJob, memcpy_bytes_per_s, write_direct
from .host_pool import HostBufferPool
from .lru import LRUBytes
from .settings import LoaderSettings

TIERS = ("dram", "disk", "registry")
EWMA_WEIGHT = 0.5  # weight of the newest measurement in a tier's bandwidth estimate


class CheckpointMissing(FileNotFoundError):
    """The model has no converted checkpoint in any tier (and conversion on load is off)."""


@dataclass(frozen=True)
class LoadResult:
    state_dict: dict[str, torch.Tensor]
    tier: str  # "dram" | "disk" | "registry": the tier that served the load
    seconds: float  # wall time of the load (reads, tensor views, device copies)
    bytes: int  # checkpoint bytes the load moved (partition files, padding included)
    key: str  # the checkpoint's identity in the tiers (model name + source fingerprint)
    direct: bool  # read with O_DIRECT (False for DRAM hits and filesystems without it)


@dataclass(frozen=True)
class LoadEstimate:
    """What a load would cost now: ServerlessLLM's startup estimate q + n/b."""

    tier: str  # the tier that would serve it
    bytes: int  # n
    queue_s: float  # q: pending loads ahead of it, each over its own tier's bandwidth
    transfer_s: float  # n / b with b the tier's measured (or initial) bandwidth

    @property
    def total_s(self) -> float:
        return self.queue_s + self.transfer_s


@dataclass(frozen=True)
class TierModel:
    key: str
    model_path: str
    bytes: int


@dataclass(frozen=True)
class TierState:
    name: str
    bytes_per_s: float  # measured on real loads (EWMA), or the initial estimate
    measured_loads: int  # loads that measured it (0: bytes_per_s is the initial estimate)
    capacity_bytes: int | None  # budget (None: not ours to bound, the registry)
    used_bytes: int
    models: tuple[TierModel, ...]


@dataclass(frozen=True)
class TiersReport:
    tiers: tuple[TierState, ...]
    pending: int  # loads queued or running
    pending_bytes: int  # their checkpoint bytes (known once a load has read its index)
    pending_s: float = 0.0  # q of the startup estimate: those bytes over their tiers' bandwidth


@dataclass
class HostCheckpoint:
    """A checkpoint in host memory: one aligned buffer per partition file."""

    index: CheckpointIndex
    buffers: dict[str, torch.Tensor]  # partition file -> uint8 buffer
    model_path: str = ""

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def copied(self, pool: HostBufferPool) -> HostCheckpoint:
        """The same checkpoint in other buffers of the pool (one bulk copy per partition, into
        memory the pool has faulted in before when it can)."""
        buffers = {}
        for name, buffer in self.buffers.items():
            buffers[name] = pool.take(buffer.numel())
            buffers[name].copy_(buffer)
        return HostCheckpoint(self.index, buffers, self.model_path)

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Tensors viewing the buffers (CPU), or copies on `device` (a CUDA device: one DMA
        each from pinned memory)."""
        out = {}
        for entry in self.index.tensors:
            raw = self.buffers[entry.file][entry.offset:entry.offset + entry.size]
            tensor = raw.view(getattr(torch, entry.dtype)).view(entry.shape)
            if device.type != "cpu":
                tensor = tensor.to(device, non_blocking=True)
            out[entry.name] = tensor
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out


@dataclass
class _Meter:
    bytes_per_s: float
    loads: int = 0

    def record(self, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-9)
        self.bytes_per_s = rate if self.loads == 0 else \
            EWMA_WEIGHT * rate + (1 - EWMA_WEIGHT) * self.bytes_per_s
        self.loads += 1


@dataclass
class _Pending:
    tier: str = "registry"
    bytes: int = 0


@dataclass(frozen=True)
class _Located:
    key: str
    model_path: str
    registry_dir: Path  # where the registry's converted checkpoint is (or would be)
    fingerprint: str
    source_dir: Path | None  # the HF directory to convert from (None: model_path is a checkpoint)


class CheckpointLoader:
    """One per node. Thread-safe: the node worker runs loads from worker threads."""

    def __init__(self, settings: LoaderSettings = LoaderSettings()) -> None:
        self.settings = settings
        self._reader = ParallelReader(settings.threads, settings.chunk_bytes)
        self._lock = threading.Lock()  # tiers, meters, pending
        self._io_lock = threading.Lock()  # one disk/registry load at a time
        self._dram: LRUBytes[HostCheckpoint] = LRUBytes(settings.dram_cache_bytes)
        # Buffers are reused within the DRAM budget: cached checkpoints + free buffers <= it.
        self._buffers = HostBufferPool(enabled=settings.dram_cache_bytes > 0)
        self._disk = _DiskTier(settings.disk_cache_dir, settings.disk_cache_bytes) \
            if settings.disk_cache_dir is not None else None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="slinfer-ckpt-copy")
        self._copies: list[Future] = []
        self._registry_models: dict[str, TierModel] = {}
        self._pending: dict[int, _Pending] = {}
        dram_rate = settings.dram_bytes_per_s or memcpy_bytes_per_s(64 << 20)
        self._meters = {"dram": _Meter(dram_rate), "disk": _Meter(settings.disk_bytes_per_s),
                        "registry": _Meter(settings.registry_bytes_per_s)}

    # -- the API the node worker calls ---------------------------------------------------------

    def load(self, model_path: str | Path, device: str | torch.device = "cpu",
             copy: bool = False) -> LoadResult:
        """The model's tensors from the fastest tier that holds its checkpoint."""
        device = torch.device(device)
        ticket = object()
        with self._lock:
            self._pending[id(ticket)] = _Pending()
        try:
            return self._load(self._locate(Path(model_path)), device, copy, id(ticket))
        finally:
            with self._lock:
                self._pending.pop(id(ticket), None)

    def drop(self, model_path: str | Path) -> bool:
        """Take the model out of the DRAM tier (its memory is reused or freed once no engine
        views it); False when it was not there."""
        key = self._locate(Path(model_path)).key
        with self._lock:
            dropped = self._dram.remove(key) is not None
            self._trim_buffers()
        return dropped

    # -- checkpoints that travel between nodes (λScale multicast, services/node/multicast.py) --

    def host_checkpoint(self, model_path: str | Path) -> HostCheckpoint:
        """The model's checkpoint in host memory, to send to other nodes: the DRAM tier's entry,
        else read from disk or the registry (and kept in the DRAM tier when it fits)."""
        located = self._locate(Path(model_path))
        host = self._dram_hit(located.key)
        if host is not None:
            return host
        ticket = object()
        with self._lock:
            self._pending[id(ticket)] = _Pending()
        try:
            with self._io_lock:
                host = self._dram_hit(located.key)
                if host is None:
                    host = self._read_from_storage(located, torch.device("cpu"), id(ticket))[0]
            return host
        finally:
            with self._lock:
                self._pending.pop(id(ticket), None)

    def empty_host_checkpoint(self, index: CheckpointIndex, model_path: str | Path
                              ) -> HostCheckpoint:
        """Buffers of the host pool for a checkpoint that will arrive from another node, one per
        partition of `index` (contents undefined until the sender's bytes are written)."""
        buffers = {p.file: self._buffers.take(p.size) for p in index.partitions}
        return HostCheckpoint(index, buffers, str(model_path))

    def admit_host(self, model_path: str | Path, host: HostCheckpoint) -> bool:
        """Put a checkpoint assembled in host memory (received by multicast, verified by the
        caller) in the DRAM tier, so the next `load(model_path)` is a DRAM hit. Its key is the
        one `load` computes: the model's name and the index's fingerprint of the source (a
        changed source here gives another key, so a stale copy is never served). False when it
        is larger than the DRAM budget."""
        key = _tier_key(Path(model_path), host.index.fingerprint)
        with self._lock:
            if host.nbytes > self._dram.capacity_bytes:
                return False
            self._dram.admit(key, host, host.nbytes)
            self._trim_buffers()
        return True

    def free_buffer_bytes(self) -> int:
        """Host-pool buffers nothing views any more: what the next load or transfer reuses."""
        return self._buffers.free_bytes()

    def _trim_buffers(self) -> None:
        """Free buffers beyond what the DRAM budget leaves after the cached checkpoints."""
        self._buffers.trim(max(0, self._dram.capacity_bytes - self._dram.used_bytes))

    @property
    def pending(self) -> int:
        """Loads queued or running now (the q of the startup estimate counts them)."""
        with self._lock:
            return len(self._pending)

    def has_checkpoint(self, model_path: str | Path) -> bool:
        """A load would succeed without converting (or conversion on load is on)."""
        located = self._locate(Path(model_path))
        return self.settings.convert_on_load or self._tier_of(located) is not None

    def tier_of(self, model_path: str | Path) -> str | None:
        """The tier that would serve the model now (None: no converted checkpoint yet)."""
        return self._tier_of(self._locate(Path(model_path)))

    def estimate(self, model_path: str | Path) -> LoadEstimate:
        """q + n/b for loading the model now: q from the pending loads, n/b from the tier that
        would serve it (the registry when no checkpoint exists yet, as after a conversion)."""
        located = self._locate(Path(model_path))
        tier = self._tier_of(located) or "registry"
        nbytes = self._checkpoint_bytes(located, tier)
        with self._lock:
            queue = self._queue_s()
            rate = self._meters[tier].bytes_per_s
        return LoadEstimate(tier, nbytes, queue, nbytes / rate)

    def key_of(self, model_path: str | Path) -> str:
        """The model's identity in the tiers (`TierModel.key`): how a checkpoint found on the
        local disk at start, whose `model_path` is its copy there, maps back to a model."""
        return self._locate(Path(model_path)).key

    def tiers_report(self) -> TiersReport:
        with self._lock:
            dram = tuple(TierModel(k, v.model_path, n) for k, v, n in self._dram.entries())
            disk = self._disk.models() if self._disk is not None else ()
            states = (
                self._state("dram", self._dram.capacity_bytes, self._dram.used_bytes, dram),
                self._state("disk", self._disk.lru.capacity_bytes if self._disk else 0,
                            self._disk.lru.used_bytes if self._disk else 0, disk),
                self._state("registry", None, sum(m.bytes for m in self._registry_models.values()),
                            tuple(self._registry_models.values())),
            )
            pending = list(self._pending.values())
            queue = self._queue_s()
        return TiersReport(states, len(pending), sum(p.bytes for p in pending), queue)

    def _queue_s(self) -> float:
        """Seconds of the loads queued or running on the I/O queue (call with the lock held)."""
        return sum(p.bytes / self._meters[p.tier].bytes_per_s
                   for p in self._pending.values() if p.tier != "dram")

    def wait_for_copies(self) -> None:
        """Block until the background copies to local disk are done (tests, shutdown)."""
        while True:
            with self._lock:
                copies, self._copies = self._copies, []
            if not copies:
                return
            for future in copies:
                future.result()

    def close(self) -> None:
        self.wait_for_copies()
        self._copier.shutdown(wait=True)
        self._reader.close()

    # -- the load path -------------------------------------------------------------------------

    def _load(self, located: _Located, device: torch.device, copy: bool, ticket: int
              ) -> LoadResult:
        started = time.perf_counter()
        host = self._dram_hit(located.key)
        tier, direct = "dram", False
        if host is None:
            with self._io_lock:  # a single I/O queue: loads from disk run one after another
                host = self._dram_hit(located.key)  # loaded meanwhile by the load we waited on
                if host is None:
                    host, tier, direct = self._read_from_storage(located, device, ticket)
        if copy and device.type == "cpu":
            host = host.copied(self._buffers)
        state = host.tensors(device)
        seconds = time.perf_counter() - started
        with self._lock:
            self._meters[tier].record(host.index.file_bytes, seconds)
        return LoadResult(state, tier, seconds, host.index.file_bytes, located.key, direct)

    def _dram_hit(self, key: str) -> HostCheckpoint | None:
        with self._lock:
            return self._dram.get(key)

    def _read_from_storage(self, located: _Located, device: torch.device, ticket: int
                           ) -> tuple[HostCheckpoint, str, bool]:
        tier, directory = self._disk_or_registry(located)
        index = read_index(directory)
        if index is None or index.fingerprint != located.fingerprint:
            raise CheckpointMissing(f"no complete checkpoint of {located.model_path} in "
                                    f"{directory}")
        with self._lock:
            self._pending[ticket] = _Pending(tier, index.file_bytes)
        pinned = device.type == "cuda"
        buffers = {p.file: self._buffers.take(p.size, pinned=pinned) for p in index.partitions}
        stats = self._reader.read([ReadJob(directory / p.file, p.size, buffers[p.file])
                                   for p in index.partitions])
        host = HostCheckpoint(index, buffers, located.model_path)
        with self._lock:
            if host.nbytes <= self._dram.capacity_bytes:
                self._dram.admit(located.key, host, host.nbytes)
            self._trim_buffers()
            if tier == "registry":
                self._registry_models[located.key] = TierModel(
                    located.key, located.model_path, index.file_bytes)
                if self._disk is not None and located.key not in self._disk.lru:
                    self._copies.append(self._copier.submit(self._copy_to_disk, located.key,
                                                            host))
        return host, tier, stats.direct

    def _copy_to_disk(self, key: str, host: HostCheckpoint) -> None:
        """Background: write a checkpoint read from the registry to the local disk tier. It
        takes the I/O queue like a load (and counts as pending, for the estimate), so loads keep
        the bandwidth they are predicted with and never read a directory being evicted."""
        ticket = object()
        with self._lock:
            self._pending[id(ticket)] = _Pending("disk", host.index.file_bytes)
        try:
            with self._io_lock:
                path = self._disk.write(key, host)
                if path is not None:
                    with self._lock:
                        self._disk.admit(key, host.model_path, host.index.file_bytes)
        finally:
            with self._lock:
                self._pending.pop(id(ticket), None)

    def _disk_or_registry(self, located: _Located) -> tuple[str, Path]:
        if self._disk is not None:
            with self._lock:
                local = self._disk.lookup(located.key)
            if local is not None:
                return "disk", local
        if read_index(located.registry_dir) is None and located.source_dir is not None \
                and self.settings.convert_on_load:
            convert_checkpoint(located.source_dir, located.registry_dir)
        return "registry", located.registry_dir

    # -- helpers -------------------------------------------------------------------------------

    def _locate(self, model_path: Path) -> _Located:
        """The model's checkpoint identity: a converted checkpoint directory itself, or a
        Hugging Face directory whose checkpoint is (or will be) in its `slinfer-checkpoint/`."""
        if (model_path / INDEX_FILE).is_file():
            index = read_index(model_path)
            if index is None:
                raise CheckpointMissing(f"{model_path} holds an incomplete checkpoint")
            return _Located(_tier_key(model_path, index.fingerprint), str(model_path),
                            model_path, index.fingerprint, None)
        if not (model_path / "config.json").is_file():
            raise CheckpointMissing(f"{model_path} is neither a model nor a checkpoint directory")
        fingerprint = source_fingerprint(model_path)
        return _Located(_tier_key(model_path, fingerprint), str(model_path),
                        default_checkpoint_dir(model_path), fingerprint, model_path)

    def _tier_of(self, located: _Located) -> str | None:
        with self._lock:
            if located.key in self._dram:
                return "dram"
            if self._disk is not None and located.key in self._disk.lru:
                return "disk"
        index = read_index(located.registry_dir)
        return "registry" if index is not None and index.fingerprint == located.fingerprint \
            else None

    def _checkpoint_bytes(self, located: _Located, tier: str) -> int:
        with self._lock:
            host = self._dram.get(located.key) if tier == "dram" else None
        if host is not None:
            return host.index.file_bytes
        index = read_index(located.registry_dir)
        if index is not None:
            return index.file_bytes
        if located.source_dir is None:
            return 0
        return sum(p.stat().st_size for p in located.source_dir.glob("*.safetensors"))

    def _state(self, name: str, capacity: int | None, used: int,
               models: tuple[TierModel, ...]) -> TierState:
        meter = self._meters[name]
        return TierState(name, meter.bytes_per_s, meter.loads, capacity, used, models)


def _tier_key(model_path: Path, fingerprint: str) -> str:
    """A checkpoint's identity in the tiers: the model directory's name and its source's
    fingerprint."""
    return f"{model_path.name}-{fingerprint[:16]}"


@dataclass
class _DiskTier:
    """Checkpoints copied to the node's own disk: `root/<key>/` (index written last), an LRU by
    bytes whose recency survives restarts through the index files' mtimes."""

    root: Path
    capacity_bytes: int
    lru: LRUBytes[TierModel] = field(init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lru = LRUBytes(self.capacity_bytes, on_evict=self._delete)
        found = []
        for directory in self.root.iterdir():
            index = read_index(directory) if directory.is_dir() else None
            if index is not None:
                found.append(((directory / INDEX_FILE).stat().st_mtime, directory, index))
        for _, directory, index in sorted(found, key=lambda item: item[0]):
            if index.file_bytes <= self.capacity_bytes:
                self.lru.admit(directory.name, TierModel(directory.name, str(directory),
                                                         index.file_bytes), index.file_bytes)

    def lookup(self, key: str) -> Path | None:
        model = self.lru.get(key)
        if model is None:
            return None
        path = self.root / key
        try:
            os.utime(path / INDEX_FILE)  # recency for the next start
        except OSError:
            self.lru.remove(key)  # deleted behind our back
            return None
        return path

    def models(self) -> tuple[TierModel, ...]:
        return tuple(value for _, value, _ in self.lru.entries())

    def write(self, key: str, host: HostCheckpoint) -> Path | None:
        """Write the checkpoint from memory (aligned buffers: O_DIRECT writes) and rename it into
        place; None when it is larger than the whole budget. Call `admit` after (it makes room,
        so the disk holds up to one checkpoint over the budget meanwhile)."""
        if host.index.file_bytes > self.capacity_bytes:
            return None
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.root))
        try:
            for part in host.index.partitions:
                write_direct(tmp / part.file, host.buffers[part.file], part.size)
            (tmp / INDEX_FILE).write_text(host.index.to_json())
            tmp.chmod(0o755)
            target = self.root / key
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
            return target
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def admit(self, key: str, model_path: str, size: int) -> None:
        self.lru.admit(key, TierModel(key, model_path, size), size)

    def _delete(self, key: str, _model: TierModel) -> None:
        shutil.rmtree(self.root / key, ignore_errors=True)

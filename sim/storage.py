"""Checkpoint tiers of a simulated node (ServerlessLLM §4.2, §6), the same for every system.

A node holds checkpoints in a DRAM cache and on its local disk (each LRU within a byte budget),
and reads the rest from the registry over the network. A load from disk or the registry waits for
the node's earlier disk/registry loads (one I/O queue per node); a DRAM hit does not. After a load
the checkpoint is in both caches. Bandwidths are ASSUMPTIONS of a typical node, not measurements:
DRAM to device 13.48 GB/s (a 7B checkpoint in 1 s: the paper's "1 second to load a 7B model"),
local NVMe 5 GB/s, registry over a 10 Gb/s link 1.25 GB/s.

Storage modes of a run (`SimConfig.storage`):
- "dram": the paper's setting (§IX-A: every checkpoint cached in every node's CPU memory): a cold
  start takes the profile's load time; nodes report no tiers.
- "tiered": the caches above, cold at the start of the run.
- "registry": no caches: every cold start reads the registry (a system without a checkpoint tier).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from shared.core.types import TIERS, StorageView

GB = 1e9


@dataclass(frozen=True)
class TierSpec:
    dram_bytes: int = int(64 * GB)  # checkpoint cache in host memory, per node
    disk_bytes: int = int(1000 * GB)  # checkpoint cache on local NVMe, per node
    bytes_per_s: dict[str, float] = field(default_factory=lambda: {
        "dram": 13.48 * GB, "disk": 5 * GB, "registry": 1.25 * GB})
    caching: bool = True  # False: the "registry" mode, nothing is kept


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.items: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def touch(self, key: str, size: int) -> None:
        if key in self.items:
            self.items.move_to_end(key)
            return
        if size > self.capacity:
            return
        while self.used + size > self.capacity:
            _, freed = self.items.popitem(last=False)
            self.used -= freed
        self.items[key] = size
        self.used += size


class NodeStorage:
    """One node's tiers: where each checkpoint is, and how long a load takes from there."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.dram = _LRU(spec.dram_bytes if spec.caching else 0)
        self.disk = _LRU(spec.disk_bytes if spec.caching else 0)
        self.io_free_at = 0.0  # when the node's disk/registry queue is free

    @property
    def dram_bytes(self) -> int:
        """The DRAM tier's capacity (0 in the "registry" mode)."""
        return self.dram.capacity

    def tier_of(self, model: str) -> str:
        return "dram" if model in self.dram else "disk" if model in self.disk else "registry"

    def view(self, now: float) -> StorageView:
        holds = {m: "dram" for m in self.dram.items}
        holds.update({m: "disk" for m in self.disk.items if m not in holds})
        return StorageView(dict(self.spec.bytes_per_s), holds, max(0.0, self.io_free_at - now),
                           dram_bytes=self.dram_bytes)

    def io_busy(self, now: float) -> bool:
        """A disk or registry load is queued or running (the loader's `pending`)."""
        return self.io_free_at > now

    def touch(self, model: str, nbytes: int) -> None:
        """A DRAM-tier hit that only makes the checkpoint the most recently used."""
        self.dram.touch(model, nbytes)

    def read_ahead(self, model: str, nbytes: int, now: float) -> float:
        """Start reading a checkpoint into the DRAM tier before any cold start asks for it
        (pre-loading, sim/preload.py): it takes the node's I/O queue like a load; the seconds
        until it is read (then `cache` it, as the loader keeps what it read)."""
        tier = self.tier_of(model)
        if tier == "dram":
            return 0.0
        start = max(now, self.io_free_at)
        self.io_free_at = start + nbytes / self.spec.bytes_per_s[tier]
        return self.io_free_at - now

    def estimate(self, model: str, nbytes: int, now: float) -> tuple[str, float]:
        """What `load` would answer now, without starting it (a node choosing between its own
        tier and a multicast, sim/scaleout.py)."""
        tier = self.tier_of(model)
        transfer = nbytes / self.spec.bytes_per_s[tier]
        if tier == "dram":
            return tier, transfer
        return tier, (max(now, self.io_free_at) + transfer) - now

    def load(self, model: str, nbytes: int, now: float) -> tuple[str, float]:
        """Start a load now: (the tier that serves it, seconds until the weights are in)."""
        tier, seconds = self.estimate(model, nbytes, now)
        if tier != "dram":  # the same sum `estimate` took, so the queue's end is exact
            self.io_free_at = max(now, self.io_free_at) + nbytes / self.spec.bytes_per_s[tier]
        self.cache(model, nbytes)
        return tier, seconds

    def cache(self, model: str, nbytes: int) -> None:
        """The checkpoint is in both caches once loaded (also when it came over the network)."""
        self.dram.touch(model, nbytes)
        self.disk.touch(model, nbytes)


assert TIERS == ("dram", "disk", "registry")  # the order `tier_of` prefers

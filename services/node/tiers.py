"""What the node's checkpoint loader holds, as the cluster view carries it (ServerlessLLM §4.2,
§6): the loader's `TiersReport` becomes the `StorageView` of the node's `NodeView`, which the
node's own core and every placer use for a cold start's `q + n/b`.

The loader knows checkpoints by model directory (and by key, for a copy it found on its local
disk at start); the core knows models by registered name. `ModelNames` maps one to the other:
it learns the records the node is asked to serve and the registry's records (read with the
profiles). A directory registered under several names holds all of them; a checkpoint no
registered model points to is left out (nothing can be placed for it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from shared.core.types import TIERS, StorageView
from shared.schemas import ModelRecord

if TYPE_CHECKING:  # the loader imports torch; this module is on the node's import path
    from services.node.loader import TiersReport

# A tier's bandwidth goes into the view once it is worth deciding with. DRAM and disk: always
# (DRAM's initial figure is a memory copy the loader measured at start; a disk tier holds a model
# only after a load wrote it there). The registry: only once a load measured it on this node;
# until then a cold start from it takes the load time its profile measured (the profiler's load
# is a registry load too), not the loader's configured guess.
ALWAYS_REPORTED = frozenset({"dram", "disk"})


def model_key(path: str | Path) -> str:
    """A model directory as a lookup key (no trailing slash, no `.` parts)."""
    return str(Path(path))


class ModelNames:
    """Registered names by model directory and by loader key."""

    def __init__(self) -> None:
        self._learned: dict[str, set[str]] = {}  # records this node was asked to serve
        self._registry: dict[str, set[str]] = {}  # the registry's records, as last read
        self._keys: dict[str, set[str]] = {}  # loader key -> names (registry records)

    def learn(self, record: ModelRecord) -> None:
        self._learned.setdefault(model_key(record.path), set()).add(record.name)

    def set_registry(self, records: Iterable[ModelRecord],
                     key_of: Callable[[str], str] | None = None) -> None:
        """Replace the registry's part (a deleted model leaves it). `key_of(path)` gives a
        directory's loader key; a directory it cannot read is matched by path only. Blocking
        (`key_of` reads file metadata): call it from a thread."""
        by_path: dict[str, set[str]] = {}
        for record in records:
            by_path.setdefault(model_key(record.path), set()).add(record.name)
        keys: dict[str, set[str]] = {}
        if key_of is not None:
            for path, names in by_path.items():
                try:
                    keys.setdefault(key_of(path), set()).update(names)
                except (OSError, ValueError):  # gone, or not a model directory (yet)
                    continue
        self._registry, self._keys = by_path, keys

    def names(self, model_path: str, key: str) -> set[str]:
        path = model_key(model_path)
        return self._learned.get(path, set()) | self._registry.get(path, set()) | \
            self._keys.get(key, set())


def storage_view(report: TiersReport, names: Callable[[str, str], Iterable[str]]) -> StorageView:
    """The cluster view's `StorageView` of a loader report. `holds`: each model's fastest tier
    (the registry included for models this node has read from it); `bytes_per_s`: each tier's
    bandwidth (see ALWAYS_REPORTED); `pending_s`: the loads queued or running (q)."""
    holds: dict[str, str] = {}
    bandwidth: dict[str, float] = {}
    for tier in sorted(report.tiers, key=lambda t: TIERS.index(t.name), reverse=True):
        if tier.name in ALWAYS_REPORTED or tier.measured_loads > 0:
            bandwidth[tier.name] = tier.bytes_per_s
        for model in tier.models:  # slowest tier first: a faster one overwrites
            for name in names(model.model_path, model.key):
                holds[name] = tier.name
    dram = next((t.capacity_bytes or 0 for t in report.tiers if t.name == "dram"), 0)
    return StorageView(bytes_per_s=dict(sorted(bandwidth.items())), holds=dict(sorted(holds.items())),
                       pending_s=report.pending_s, dram_bytes=dram)

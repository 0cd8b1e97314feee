"""The node loader's settings, read once from the environment by the node at start."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.settings import env_bool, env_int, env_str

from .direct_io import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS

GiB = 1 << 30


@dataclass(frozen=True)
class LoaderSettings:
    dram_cache_bytes: int = 0  # DRAM tier budget (0: no checkpoint is kept after its load)
    disk_cache_dir: Path | None = None  # local disk tier (None: off)
    disk_cache_bytes: int = 64 * GiB  # local disk tier budget
    threads: int = DEFAULT_THREADS  # I/O threads of one load
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # bytes per read request
    convert_on_load: bool = False  # convert a model with no checkpoint yet on its first load
    # Bandwidth estimates (bytes/s) until a real load of the tier measured one. DRAM: measured
    # with a memory copy when the loader starts unless set; local disk: a SATA/entry NVMe SSD;
    # registry: a shared store over a 10 Gb/s network.
    dram_bytes_per_s: float | None = None
    disk_bytes_per_s: float = 1.0e9
    registry_bytes_per_s: float = 1.0e9

    def __post_init__(self) -> None:
        if self.dram_cache_bytes < 0 or self.disk_cache_bytes < 0:
            raise ValueError("cache budgets must be >= 0")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LoaderSettings:
        """SLINFER_NODE_DRAM_CACHE_BYTES (default: a quarter of physical memory, at most
        16 GiB), SLINFER_NODE_DISK_CACHE_BYTES (64 GiB; 0 turns the disk tier off),
        SLINFER_NODE_CHECKPOINT_DIR (default $SLINFER_DATA_DIR/checkpoints/$SLINFER_NODE_ID),
        SLINFER_LOADER_THREADS, SLINFER_LOADER_CHUNK_BYTES, SLINFER_CONVERT_ON_LOAD."""
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        disk_bytes = env_int("SLINFER_NODE_DISK_CACHE_BYTES", 64 * GiB, env=env, minimum=0)
        data_dir = Path(env_str("SLINFER_DATA_DIR", ".data", env=env))
        node_id = env_str("SLINFER_NODE_ID", "node-0", env=env)
        disk_dir = Path(env_str("SLINFER_NODE_CHECKPOINT_DIR",
                                str(data_dir / "checkpoints" / node_id), env=env))
        return cls(
            dram_cache_bytes=env_int("SLINFER_NODE_DRAM_CACHE_BYTES",
                                     min(16 * GiB, physical // 4), env=env, minimum=0),
            disk_cache_dir=disk_dir if disk_bytes else None,
            disk_cache_bytes=disk_bytes,
            threads=env_int("SLINFER_LOADER_THREADS", DEFAULT_THREADS, env=env, minimum=1),
            chunk_bytes=env_int("SLINFER_LOADER_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, env=env,
                                minimum=4096),
            convert_on_load=env_bool("SLINFER_CONVERT_ON_LOAD", False, env=env),
        )

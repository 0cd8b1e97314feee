"""Fast multi-tier checkpoint loading for the node (ServerlessLLM §4): the loading-optimized
checkpoint format and its converter, chunked parallel O_DIRECT reads into a host-memory pool, and
the node's loader over its tiers (DRAM cache, local disk, the registry's storage).

The node worker uses `CheckpointLoader(LoaderSettings.from_env())`: `load(model_path)`,
`tiers_report()`, `estimate(model_path)`, `pending`.
"""

from __future__ import annotations

from .checkpoint_format import CheckpointIndex, TensorEntry, default_checkpoint_dir, read_index
from .convert import ConvertResult, convert_checkpoint, verify_checkpoint
from .loader import (TIERS, CheckpointLoader, CheckpointMissing, LoadEstimate, LoadResult,
                     TierModel, TiersReport, TierState)
from .settings import LoaderSettings

__all__ = ["TIERS", "CheckpointIndex", "CheckpointLoader", "CheckpointMissing", "ConvertResult",
           "LoadEstimate", "LoadResult", "LoaderSettings", "TensorEntry", "TierModel",
           "TierState", "TiersReport", "convert_checkpoint", "default_checkpoint_dir",
           "read_index", "verify_checkpoint"]

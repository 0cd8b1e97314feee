"""The record of one instance's load on a node (kept by services/node/memops.py, exported by
services/node/observe.py)."""

from __future__ import annotations

from dataclasses import dataclass


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

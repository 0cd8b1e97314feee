"""Overload, or files that can never load? (issue 24: one error for one cause)

A request whose model or LoRA adapter no node holds yet is dropped (or refused until it fails)
for load before any node has tried its files: the placer's plan, with a profile the node's
online calibration slowed down on a busy box, finds that the adapter's load breaks the TTFT,
and never sends it. Were the files broken, an idle box would answer `model_failed` and a busy
one "overloaded": two answers for one cause. So before the gateway answers such a failure, it
looks at the files itself (`shared.registry.files_problem`, as it does when a tokenizer will
not load); broken files are the answer, whatever the timing.

A model or adapter loaded on some node is not looked at: a load passed its files, and marking
it failed would stop the instances that serve it. A directory found whole is not read again
for `WHOLE_TTL_S`, so a storm of drops reads no files per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.asyncio import Redis

from shared.cluster import read_nodes
from shared.core.types import NodeView
from shared.registry import ModelRegistry, files_problem
from shared.schemas import ModelRecord

WHOLE_TTL_S = 5.0


class FilesCheck:
    """Collaborators: the model registry and Redis (None: no cluster view; every model counts as
    loaded nowhere)."""

    def __init__(self, registry: ModelRegistry, redis: Redis | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry, self._redis, self._clock = registry, redis, clock
        self._whole: dict[str, float] = {}  # path -> when it was last found whole

    async def broken(self, record: ModelRecord) -> tuple[ModelRecord, str] | None:
        """The first of `record` (a model, or an adapter and then its backbone) whose files are
        broken while no node holds it, with the problem; None when there is none."""
        nodes = await read_nodes(self._redis) if self._redis is not None else []
        for candidate in await self._records(record):
            if loaded_somewhere(candidate, nodes):
                continue
            problem = await self._problem(candidate)
            if problem is not None:
                return candidate, problem
        return None

    async def _records(self, record: ModelRecord) -> list[ModelRecord]:
        if record.base_model is None:
            return [record]
        base = await self._registry.get(record.base_model)
        return [record] if base is None else [record, base]

    async def _problem(self, record: ModelRecord) -> str | None:
        now = self._clock()
        if now - self._whole.get(record.path, -WHOLE_TTL_S) < WHOLE_TTL_S:
            return None
        problem = await asyncio.to_thread(files_problem, record.path,
                                          record.base_model is not None)
        if problem is None:
            self._whole[record.path] = now
            if len(self._whole) > 1024:
                self._whole = {p: t for p, t in self._whole.items() if now - t < WHOLE_TTL_S}
        else:
            self._whole.pop(record.path, None)
        return problem


def loaded_somewhere(record: ModelRecord, nodes: list[NodeView]) -> bool:
    """Some node holds an instance of the model (for an adapter: one with it attached)."""
    if record.base_model is None:
        return any(i.model.name == record.name for n in nodes for i in n.instances)
    return any(record.name in i.adapters for n in nodes for i in n.instances)

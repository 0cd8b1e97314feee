"""The gateway's part of a model's lifecycle (`shared.model_state`): registration starts it,
the admin API shows it.

Which hardware kinds a registered model is profiled on: the kinds of the live nodes (the
cluster view in Redis), or, with no node up yet, `GatewaySettings.profile_hardware`
(SLINFER_PROFILE_HARDWARE, default cpu). A kind the model already has a profile for needs no
job (it is `ready` at once: a model re-registered as it was, or one `slinfer up` profiled before
registering it), unless the registration replaced the model with another checkpoint or engine:
then every kind is profiled again (requests use the old profile meanwhile).
"""

from __future__ import annotations

import logging
from typing import Any

from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from shared.cluster import read_nodes
from shared.model_state import (KindStatus, ModelState, ModelStatus, all_statuses,
                                files_failure, forget, get_status, mark_ready, request_profiles,
                                set_hardware_state)
from shared.schemas import ModelRecord
from shared.subjects import PROFILES_HASH, profile_field

log = logging.getLogger("slinfer.gateway")


def kinds_to_profile(present: set[str], default: tuple[str, ...]) -> list[str]:
    return sorted(present) if present else list(default)


def reprofile(record: ModelRecord, previous: ModelRecord | None) -> bool:
    """A replaced model whose weights or engine changed: its profiles are not its own any more."""
    return previous is not None and (previous.path, previous.engine) != (record.path, record.engine)


async def start(nc: NATS, redis: Redis, record: ModelRecord, previous: ModelRecord | None,
                default_kinds: tuple[str, ...]) -> ModelStatus | None:
    """After a registration: a profiling job for every kind without a profile (module doc)."""
    kinds = kinds_to_profile({n.hardware.value for n in await read_nodes(redis)}, default_kinds)
    if record.base_model is not None:
        # A LoRA adapter is not profiled: it runs on instances of its backbone, with the
        # backbone's profile and lifecycle (the placer waits for those).
        await forget(redis, record.name)
        for kind in kinds:
            await mark_ready(redis, record.name, kind,
                             f"LoRA adapter: served by its base model {record.base_model}")
        return await get_status(redis, record.name)
    fresh = reprofile(record, previous)
    profiled = set() if fresh else await _profiled(redis, record.name, kinds)
    await forget(redis, record.name)  # a new registration starts a new lifecycle
    for kind in sorted(profiled):
        await mark_ready(redis, record.name, kind, "profile stored already")
    todo = [k for k in kinds if k not in profiled]
    if todo:
        try:
            await request_profiles(nc.jetstream(), redis, record.name, todo)
        except Exception as exc:  # NATS down: say so in the state; registering again retries
            log.warning("could not queue profiling jobs for %s: %r", record.name, exc)
            for kind in todo:
                await set_hardware_state(redis, record.name, kind, ModelState.FAILED,
                                         f"could not queue the profiling job: {exc!r}; "
                                         "register the model again (replace=true)")
    log.info("lifecycle of %s: profiling on %s, ready on %s", record.name, todo or "nothing",
             sorted(profiled) or "nothing")
    return await get_status(redis, record.name)


async def files_broken(redis: Redis, record: ModelRecord, problem: str,
                       default_kinds: tuple[str, ...]) -> tuple[ModelStatus, list[str]]:
    """The gateway found `record`'s files missing or broken (its tokenizer would not load from
    them): its lifecycle fails on every kind it has (without one, the kinds it would be
    profiled on), as a node's failed load fails it on the node's kind. (status, those kinds)."""
    status = await get_status(redis, record.name)
    kinds = sorted(status.hardware) if status is not None and status.hardware else \
        kinds_to_profile({n.hardware.value for n in await read_nodes(redis)}, default_kinds)
    reason = files_failure(problem, "the gateway")
    for kind in kinds:
        status = await set_hardware_state(redis, record.name, kind, ModelState.FAILED, reason)
    log.error("lifecycle of %s: failed on %s: %s", record.name, kinds, reason)
    assert status is not None, "at least one kind"
    return status, kinds


async def _profiled(redis: Redis, model: str, kinds: list[str]) -> set[str]:
    return {k for k in kinds if await redis.hexists(PROFILES_HASH, profile_field(model, k))}


async def views(redis: Redis, records: list[ModelRecord], operator: bool) -> dict[str, dict]:
    """Each record's lifecycle as the admin API shows it (record name -> view)."""
    statuses = await all_statuses(redis)
    profiled: dict[str, set[str]] = {}
    for key in await redis.hkeys(PROFILES_HASH):
        model, _, kind = (key.decode() if isinstance(key, bytes) else key).rpartition("|")
        profiled.setdefault(model, set()).add(kind)
    return {r.name: view(statuses.get(r.name), profiled.get(r.name, set()),
                         None if operator else r.path) for r in records}


def view(status: ModelStatus | None, profiled: set[str], hide: str | None = None) -> dict[str, Any]:
    """`{"state": ..., "hardware": {kind: {"state", "progress", "reason", "updated"}}}`. A kind
    with a profile but no lifecycle entry (profiled by hand, or before lifecycles existed) is
    ready; a model with neither is `not_profiled`. `hide`: a server path to keep out of reasons
    (a tenant does not see paths)."""
    kinds: dict[str, KindStatus] = {}
    if status is not None:
        kinds = {k: s for k in sorted(set(status.hardware) | set(status.kinds))
                 if (s := status.kind(k)) is not None}
    for kind in profiled - set(kinds):
        kinds[kind] = KindStatus(ModelState.READY, "profile stored", 1.0)
    hardware = {k: _kind_view(s, hide) for k, s in sorted(kinds.items())}
    if not hardware:
        return {"state": "not_profiled", "hardware": {}}
    state = ModelState.READY if any(s.state is ModelState.READY for s in kinds.values()) \
        else (status.state if status is not None else ModelState.READY)
    return {"state": state.value, "hardware": hardware}


def _kind_view(step: KindStatus, hide: str | None) -> dict[str, Any]:
    reason = step.reason.replace(hide, "<model directory>") if hide else step.reason
    return {"state": step.state.value, "progress": round(step.progress, 3), "reason": reason,
            "updated": step.updated}

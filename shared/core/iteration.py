"""Headroom-based token-level scheduling (SLINFER §VI-A, Fig. 14).

Every cycle the node runs exactly one iteration of the instance holding the request with the least
headroom: a prefill of one request, alone, if the instance has one waiting; otherwise one decode
step of its whole batch. The node scheduler and shadow validation both call `choose_iteration` and
`apply_iteration`, so the simulated future is the future the node will execute.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from shared.core.cost import in_blocks
from shared.core.perf_model import Profile
from shared.core.types import InstanceStatus, InstanceView, RequestView


class IterationKind(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class IterationChoice:
    instance_id: str  # the instance that runs this cycle
    kind: IterationKind  # a prefill (one request) or a decode step (the whole batch)
    request_ids: tuple[str, ...]  # requests that get a token from this iteration
    headroom: float  # least headroom on the instance when chosen (seconds; < 0 means late)


def least_headroom(instance: InstanceView, now: float) -> float:
    return min(r.deadline() for r in instance.requests) - now


def runnable(inst: InstanceView, now: float, blocked: Collection[str] = ()) -> bool:
    """Has work and may run an iteration now (loaded, not unloading, no memory op holding it)."""
    return bool(inst.requests) and inst.status is not InstanceStatus.UNLOADING \
        and inst.ready_at <= now and inst.instance_id not in blocked


def choose_iteration(instances: Collection[InstanceView], now: float,
                     blocked: Collection[str] = ()) -> IterationChoice | None:
    best: InstanceView | None = None
    best_key: tuple[float, str] | None = None
    for inst in instances:
        if not runnable(inst, now, blocked):
            continue
        key = (least_headroom(inst, now), inst.instance_id)
        if best_key is None or key < best_key:
            best, best_key = inst, key
    if best is None or best_key is None:
        return None
    waiting = [r for r in best.requests if not r.prefilled]
    if waiting:
        first = min(waiting, key=lambda r: (r.headroom(now), r.request_id))
        return IterationChoice(best.instance_id, IterationKind.PREFILL, (first.request_id,), best_key[0])
    ids = tuple(r.request_id for r in best.requests)
    return IterationChoice(best.instance_id, IterationKind.DECODE, ids, best_key[0])


def decode_shape(requests: Collection[RequestView]) -> tuple[int, float]:
    """(batch size, average context length) - the two axes of the decode table."""
    batch = len(requests)
    return batch, (sum(r.context_len() for r in requests) / batch if batch else 0.0)


def lora_rank(requests: Collection[RequestView]) -> int:
    """The largest adapter rank in a batch (0: no request runs through an adapter)."""
    return max((r.lora_rank for r in requests), default=0)


def distinct_adapters(requests: Iterable[RequestView]) -> int:
    """How many adapters a batch runs through: one segment each in the engine. Requests through
    an adapter the caller did not name count as one adapter together."""
    return len({r.adapter for r in requests if r.lora_rank})


def predict_seconds(choice: IterationChoice, instance: InstanceView, profile: Profile) -> float:
    """The profile's time for the iteration; one through LoRA adapters costs what the profile
    measured for their rank on top (a batch without adapters: the plain table, untouched)."""
    if choice.kind is IterationKind.PREFILL:
        req = next(r for r in instance.requests if r.request_id == choice.request_ids[0])
        return profile.prefill_through(req.context_len(), req.lora_rank)
    batch, avg_len = decode_shape(instance.requests)
    seconds = profile.decode_s(batch, avg_len)
    rank = lora_rank(instance.requests)
    if not rank:
        return seconds
    return seconds * profile.lora_decode_factor(rank, batch, distinct_adapters(instance.requests))


def apply_iteration(choice: IterationChoice, instance: InstanceView) -> None:
    """Credit each request of the iteration with its new token."""
    chosen = set(choice.request_ids)
    for r in instance.requests:
        if r.request_id in chosen:
            r.generated += 1
            r.prefilled = True


def kv_tokens_needed(choice: IterationChoice, instance: InstanceView) -> int:
    """KV slots (in whole blocks per request) the instance holds once this iteration has run."""
    block = instance.model.kv_block_tokens
    chosen = set(choice.request_ids)
    total = 0
    for r in instance.requests:
        if r.request_id in chosen:
            total += in_blocks(r.context_len() + 1, block)  # the token this iteration writes
        elif r.prefilled:
            total += in_blocks(r.context_len(), block)
    return total

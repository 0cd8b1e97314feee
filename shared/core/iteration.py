"""Headroom-based token-level scheduling (SLINFER §VI-A, Fig. 14).

Every cycle the node runs exactly one iteration of the instance holding the request with the least
headroom: a prefill of one request, alone, if the instance has one waiting; otherwise one decode
step of its whole batch. The node scheduler and shadow validation both call `choose_iteration` and
`apply_iteration`, so the simulated future is the future the node will execute.

Chunked prefill (`CoreConfig.prefill_chunk_tokens` > 0; Sarathi-Serve): when the chosen
instance's next work is a prefill, `plan_chunk` runs only its next chunk, the longest whose cost
(`Profile.prefill_chunk_s`) still lets every decoding request on the node have its next token by
its deadline, their decode steps taken earliest deadline first after the chunk (`edf_slack`); at
least `prefill_chunk_tokens` of it; where no such chunk fits, a decode step of the instance's
prefilled requests if one of them is its most urgent request, else the rest of the prefill at once
(it is the most urgent work on the node: the pick would come straight back to it). Shadow validation sizes its simulated chunks with the same `chunk_tokens`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from shared.core.cost import in_blocks
from shared.core.perf_model import Profile
from shared.core.types import InstanceStatus, InstanceView, RequestView

INF = float("inf")


class IterationKind(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class PrefillChunk:
    """Part of one request's prefill (chunked prefill)."""

    request_id: str
    start: int  # tokens of its context already in the instance's KV cache (earlier chunks)
    tokens: int  # tokens this iteration computes
    final: bool  # its last chunk: the request gets its first token when it ends


@dataclass(frozen=True)
class IterationChoice:
    instance_id: str  # the instance that runs this cycle
    kind: IterationKind  # a prefill (one request) or a decode step (the whole batch)
    request_ids: tuple[str, ...]  # requests that get a token from this iteration
    headroom: float  # least headroom on the instance when chosen (seconds; < 0 means late)
    # A prefill run as a chunk (None: a whole prefill, or a decode step). A chunk that is not
    # the last gives nobody a token: its `request_ids` is empty.
    chunk: PrefillChunk | None = None


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


def decode_step_s(profile: Profile, requests: Collection[RequestView]) -> float:
    """One decode step of these requests batched; one through LoRA adapters costs what the
    profile measured for their rank on top (a batch without adapters: the plain table)."""
    batch, avg_len = decode_shape(requests)
    seconds = profile.decode_s(batch, avg_len)
    rank = lora_rank(requests)
    if not rank:
        return seconds
    return seconds * profile.lora_decode_factor(rank, batch, distinct_adapters(requests))


def predict_seconds(choice: IterationChoice, instance: InstanceView, profile: Profile) -> float:
    """The profile's time for the iteration (a chunk: `Profile.prefill_chunk_s`)."""
    if choice.kind is IterationKind.PREFILL:
        rid = choice.chunk.request_id if choice.chunk is not None else choice.request_ids[0]
        req = next(r for r in instance.requests if r.request_id == rid)
        if choice.chunk is not None:
            return profile.prefill_chunk_s(choice.chunk.start, choice.chunk.tokens, req.lora_rank)
        return profile.prefill_through(req.context_len(), req.lora_rank)
    if choice.chunk is None and len(choice.request_ids) == len(instance.requests):
        return decode_step_s(profile, instance.requests)  # the whole batch (no prefill waits)
    ids = set(choice.request_ids)  # its prefilled requests, while a chunked prefill waits
    return decode_step_s(profile, [r for r in instance.requests if r.request_id in ids])


def apply_iteration(choice: IterationChoice, instance: InstanceView) -> None:
    """Credit each request of the iteration with its new token; a chunk that is not the last
    only records how much of its request's context is in the cache."""
    chunk = choice.chunk
    if chunk is not None:
        if not chunk.final:
            if any(r.request_id == chunk.request_id for r in instance.requests):
                instance.prefill_progress[chunk.request_id] = chunk.start + chunk.tokens
            return
        instance.prefill_progress.pop(chunk.request_id, None)
    chosen = set(choice.request_ids)
    for r in instance.requests:
        if r.request_id in chosen:
            r.generated += 1
            r.prefilled = True


# -- chunked prefill ------------------------------------------------------------------------------


def edf_slack(units: Iterable[tuple[float, float]], now: float) -> float:
    """How long the node may run something else from `now` and still give every decode unit
    (deadline of its most urgent request, its decode step's seconds) its step by that deadline,
    the units taken earliest deadline first (what the least-headroom pick does). INF: none."""
    slack, used = INF, 0.0
    for deadline, step in sorted(units):
        used += step
        slack = min(slack, deadline - now - used)
    return slack


def fit_chunk(cost: Callable[[int], float], remaining: int, budget: float, least: int = 0) -> int:
    """The most tokens (at most `remaining`) whose `cost` is within `budget`, if that is
    `least` at least; else 0. `cost` grows with the tokens (the prefill table never falls), so
    a bisection finds it."""
    if cost(remaining) <= budget:
        return remaining
    if least > 0 and (least >= remaining or cost(least) > budget):
        return 0
    low, high = least, remaining  # cost(low) fits (or low is 0), cost(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        if cost(mid) <= budget:
            low = mid
        else:
            high = mid
    return low


def chunk_tokens(profile: Profile, start: int, remaining: int, rank: int,
                 units: Iterable[tuple[float, float]], now: float, decoder_first: bool,
                 min_tokens: int, scale: float) -> int:
    """The next chunk of a prefill whose first `start` tokens are in the cache and `remaining`
    are not: the longest whose cost, scaled by `scale` (the validation's overestimate), fits the
    slack of the node's decode `units` (`edf_slack`), if that is `min_tokens` at least. 0 means:
    not a chunk now, but a decode step of the instance's prefilled requests, when the slack
    holds no minimum chunk and the instance's most urgent request is one of them
    (`decoder_first`). When the slack holds no minimum chunk and the prefill is the most urgent
    work on the node, all that remains runs now: the pick would come back to it after every
    minimum chunk (no deadline moves meanwhile, the slack only shrinks), so splitting it further
    would only add each chunk's own cost. The node's scheduler and shadow validation both
    decide with this."""
    slack = edf_slack(units, now)
    fit = fit_chunk(lambda c: profile.prefill_chunk_s(start, c, rank) * scale, remaining, slack,
                    min_tokens)
    if fit:
        return fit
    return 0 if decoder_first else remaining


def decode_units(instances: Iterable[InstanceView], profiles: Mapping[str, Profile], now: float,
                 scale: float, can_run: Callable[[InstanceView], bool],
                 joining: RequestView) -> list[tuple[float, float]]:
    """Each instance that may run with a prefilled request still on time: (its earliest
    deadline, a decode step of its prefilled requests, scaled). The instance of `joining`, the
    request being prefilled, is timed with it in the batch: its last chunk may be this one, and
    the decode step after it then holds it too. A request already late is no reason to hold a
    prefill back: nothing saves its token."""
    units = []
    for inst in instances:
        if not can_run(inst):
            continue
        decoding = [r for r in inst.requests if r.prefilled]
        if not decoding:
            continue
        deadline = min(r.deadline() for r in decoding)
        if deadline < now:
            continue
        batch = [*decoding, joining] if joining in inst.requests else decoding
        units.append((deadline, decode_step_s(profiles[inst.instance_id], batch) * scale))
    return units


def plan_chunk(choice: IterationChoice, instances: Collection[InstanceView],
               profiles: Mapping[str, Profile], now: float, blocked: Collection[str],
               min_tokens: int, scale: float) -> IterationChoice:
    """A prefill `choose_iteration` chose, made the next chunk of it (`chunk_tokens`), or a
    decode step of its instance's prefilled requests where one of them is the most urgent and
    no minimum chunk fits the slack."""
    inst = next(i for i in instances if i.instance_id == choice.instance_id)
    req = next(r for r in inst.requests if r.request_id == choice.request_ids[0])
    start = inst.prefill_progress.get(req.request_id, 0)
    remaining = max(1, req.context_len() - start)
    units = decode_units(instances, profiles, now, scale, lambda i: runnable(i, now, blocked), req)
    decoding = [r for r in inst.requests if r.prefilled]
    first = min((r.deadline() for r in decoding), default=INF) < req.deadline()
    tokens = chunk_tokens(profiles[inst.instance_id], start, remaining, req.lora_rank, units,
                          now, first, min_tokens, scale)
    if tokens == 0:
        return IterationChoice(inst.instance_id, IterationKind.DECODE,
                               tuple(r.request_id for r in decoding), choice.headroom)
    final = tokens >= remaining
    return IterationChoice(inst.instance_id, IterationKind.PREFILL,
                           (req.request_id,) if final else (), choice.headroom,
                           PrefillChunk(req.request_id, start, tokens, final))


def kv_tokens_needed(choice: IterationChoice, instance: InstanceView) -> int:
    """KV slots (in whole blocks per request) the instance holds once this iteration has run."""
    block = instance.model.kv_block_tokens
    chosen = set(choice.request_ids)
    chunk = choice.chunk
    total = 0
    for r in instance.requests:
        if r.request_id in chosen:
            total += in_blocks(r.context_len() + 1, block)  # the token this iteration writes
        elif r.prefilled:
            total += in_blocks(r.context_len(), block)
        else:  # a chunked prefill under way holds what its chunks wrote (this one's included)
            done = chunk.start + chunk.tokens if chunk is not None \
                and chunk.request_id == r.request_id else \
                instance.prefill_progress.get(r.request_id, 0)
            if done:
                total += in_blocks(done, block)
    return total

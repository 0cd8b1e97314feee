"""The cluster view in Redis: node snapshots (written by node workers with a TTL heartbeat),
timing profiles (written by the profiler), and the registry -> core conversions."""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import replace

from redis.asyncio import Redis

from shared import wire
from shared.core.calibration import DECODE, PREFILL, CalibrationConfig, aged, calibrated
from shared.core.perf_model import PerfModel, Profile
from shared.core.snapshot import rebase, to_snapshot
from shared.core.types import (SLO, AdapterSpec, ModelSpec, NodeView, RequestView, resume_grace,
                               slo_for_class)
from shared.redis_client import write_confirmed
from shared.schemas import InferenceRequest, ModelRecord, NodeReply, TokenMessage
from shared.subjects import (CALIBRATION_HASH, NODES_SET, PROFILES_HASH, calibration_field,
                             node_key, profile_field)

log = logging.getLogger("slinfer.cluster")


# Tokens per KV block of each engine's paged cache (the torch engine's DEFAULT_BLOCK_SIZE).
ENGINE_KV_BLOCK_TOKENS = {"torch": 16, "openvino": 32, "vllm": 16}
TIERED_ENGINES = frozenset({"torch", "auto"})  # load through the node's loader ("auto": torch)
# Engines a running request can migrate live on (shared/core/migration.py: LIVE_ENGINES).
LIVE_MIGRATION_ENGINES = frozenset({"torch", "auto"})
# Engines that run a prefill in chunks (services/node/engines/base.py: ChunksPrefill).
CHUNKED_PREFILL_ENGINES = frozenset({"torch", "auto"})


def model_spec(record: ModelRecord, avg_output_len: float = 128.0) -> ModelSpec:
    return ModelSpec(record.name, record.weight_bytes, record.kv_bytes_per_token,
                     record.max_context, avg_output_len,
                     kv_block_tokens=ENGINE_KV_BLOCK_TOKENS.get(record.engine, 16),
                     tiered=record.engine in TIERED_ENGINES,
                     live_migration=record.engine in LIVE_MIGRATION_ENGINES,
                     chunked_prefill=record.engine in CHUNKED_PREFILL_ENGINES,
                     layers=record.layers if record.engine == "torch" else 0,
                     head_bytes=record.head_bytes, token_bytes=record.token_bytes,
                     keep_alive_s=record.keep_alive_s, min_instances=record.min_instances)


def request_view(req: InferenceRequest) -> RequestView:
    """The core's view of a wire request. A resumed request counts its earlier tokens as output
    (they set its headroom) but must re-prefill them where it lands; it keeps its cold-start grace."""
    return RequestView(req.request_id, req.model, len(req.prompt_token_ids), req.arrival,
                       SLO(req.ttft_slo_s, req.tpot_slo_s), generated=len(req.resumed_token_ids),
                       max_tokens=req.max_tokens, grace_s=req.grace_s, prefilled=False,
                       lora_rank=req.adapter_rank if req.adapter is not None else 0,
                       adapter=req.adapter, keep_alive_s=req.keep_alive_s)


def grace_from_now(req: InferenceRequest, tokens: int, now: float) -> float:
    """The grace that judges `req`, with `tokens` output tokens, as a new arrival from `now` on
    (`resume_grace`): the time a fault cost it (a dead node, a stopping one) is not load."""
    return max(req.grace_s, resume_grace(req.arrival, req.tpot_slo_s, tokens, now))


def announcement(req: InferenceRequest, node_id: str) -> TokenMessage:
    """The empty token message that tells the gateway `node_id` holds `req` now (its watchdog
    asks that node if the stream goes quiet): sent by the node that admits it, and by a placer
    that finds a node holds it after the node's own answer was lost."""
    return TokenMessage(req.request_id, len(req.resumed_token_ids), [], node_id=node_id,
                        attempt=req.attempt)


# Request ids of warm-ups: requests that only start an instance (pinning's, the admin's preload,
# a pre-warm's stand-in). The pre-warming policy does not count them as calls of their model.
PIN_ID_PREFIX, PRELOAD_ID_PREFIX, PREWARM_ID_PREFIX = "pin-", "preload-", "prewarm-"
WARM_UP_PREFIXES = (PIN_ID_PREFIX, PRELOAD_ID_PREFIX, PREWARM_ID_PREFIX)


def is_warm_up(request_id: str) -> bool:
    return request_id.startswith(WARM_UP_PREFIXES)


def warm_up_request(record: ModelRecord, request_id: str, now: float, timeout_s: float,
                    keep_alive_s: float | None = None) -> InferenceRequest:
    """A request that only starts (or finds warm) an instance of `record` where the core places
    it: one prompt token (its first EOS id, else 0), one output token. The placer's pinning
    sends these for a pinned model short of its warm instances; the admin's preload is one."""
    slo = slo_for_class(record.slo_class, 1)
    prompt = list(record.eos_token_ids[:1]) or [0]
    return InferenceRequest(request_id=request_id, tenant=record.owner or "", model=record.name,
                            prompt_token_ids=prompt, max_tokens=1, arrival=now,
                            ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s, temperature=0.0,
                            ignore_eos=True, deadline=now + timeout_s, keep_alive_s=keep_alive_s)


def adapter_spec(req: InferenceRequest, records: dict[str, ModelRecord]) -> AdapterSpec | None:
    """The core's view of the LoRA adapter a wire request runs through, from the registry's
    records (what the node's admission uses: its bytes); None for a plain request, or one whose
    adapter is not registered (the node refuses that one itself)."""
    record = records.get(req.adapter) if req.adapter is not None else None
    return AdapterSpec(record.name, record.weight_bytes) if record is not None else None


# A node view read within this long of its heartbeat (on the reader's clock) is taken to come
# from the same clock, so that old (`shared.core.snapshot`). Above the snapshot's TTL (a dozen
# heartbeats, 3 s by default), far below any real clock offset that matters.
SNAPSHOT_MAX_AGE_S = 10.0


def encode_node(view: NodeView) -> bytes:
    """A node's view on the wire: a snapshot, its times relative to its heartbeat."""
    return wire.encode(to_snapshot(view))


def decode_node(blob: bytes, now: float) -> NodeView:
    """A node's view off the wire, rebased onto the reader's clock (`now`)."""
    return rebase(wire.decode(NodeView, blob), now, SNAPSHOT_MAX_AGE_S)


def encode_reply(reply: NodeReply) -> bytes:
    """A node's answer to a command; the view it carries is a snapshot (`encode_node`)."""
    if reply.node is not None:
        reply = replace(reply, node=to_snapshot(reply.node))
    return wire.encode(reply)


def decode_reply(data: bytes, now: float) -> NodeReply:
    """A node's answer, its view rebased onto the reader's clock (`decode_node`)."""
    reply = wire.decode(NodeReply, data)
    if reply.node is not None:
        reply = replace(reply, node=rebase(reply.node, now, SNAPSHOT_MAX_AGE_S))
    return reply


async def publish_node(redis: Redis, view: NodeView, ttl_s: float) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(node_key(view.node_id), encode_node(view), px=int(ttl_s * 1000))
        pipe.sadd(NODES_SET, view.node_id)
        await pipe.execute()


async def remove_node(redis: Redis, node_id: str) -> None:
    await redis.delete(node_key(node_id))
    await redis.srem(NODES_SET, node_id)


async def read_nodes(redis: Redis, now: float | None = None) -> list[NodeView]:
    """Live nodes, their times on this process's clock (`now`: time.time()); a member whose
    snapshot expired (missed heartbeats) is dropped from the set."""
    ids = member_ids(await redis.smembers(NODES_SET))
    if not ids:
        return []
    return await views_of(redis, ids, await redis.mget([node_key(i) for i in ids]), now)


def member_ids(members) -> list[str]:
    """The node ids of NODES_SET's members, sorted."""
    return sorted(m.decode() if isinstance(m, bytes) else m for m in members)


async def views_of(redis: Redis, ids: list[str], blobs: list, now: float | None = None) -> list[NodeView]:
    """The views of the snapshots `blobs` of nodes `ids` (an MGET's answer); a member whose
    snapshot expired is dropped from NODES_SET."""
    now = time.time() if now is None else now
    nodes = []
    for node_id, blob in zip(ids, blobs):
        if blob is None:
            await redis.srem(NODES_SET, node_id)
            continue
        try:
            nodes.append(decode_node(blob, now))
        except wire.WireError as exc:
            log.warning("skipping undecodable snapshot of node %s: %s", node_id, exc)
    return nodes


def profile_to_json(profile: Profile) -> str:
    return json.dumps(wire.to_plain(profile), sort_keys=True)


def profile_from_json(text: str | bytes) -> Profile:
    return wire.from_plain(Profile, json.loads(text))


async def save_profile(redis: Redis, profile: Profile) -> None:
    """Stored, and confirmed by a replica when there are replicas (a profile takes minutes to
    measure: a failover must not lose it)."""
    field, data = profile_field(profile.model, profile.hardware.value), profile_to_json(profile)
    await write_confirmed(redis, f"profile {field}", lambda p: p.hset(PROFILES_HASH, field, data))


# A node's calibration older than this is from a node that has stopped reporting: ignored.
CALIBRATION_TTL_S = 600.0


async def save_calibration(redis: Redis, node_id: str, model: str, hardware: str,
                           factors: dict[str, float], seen: dict[str, float] | None = None) -> None:
    """A node's correction factors per iteration kind, with when it last saw an iteration of
    each kind (`seen`; readers fade an unconfirmed factor from then on, see `aged`)."""
    now = time.time()
    await redis.hset(CALIBRATION_HASH, calibration_field(model, hardware, node_id),
                     json.dumps({**factors, "updated": now,
                                 **{f"{kind}_seen": t for kind, t in (seen or {}).items()}}))


async def remove_calibration(redis: Redis, node_id: str) -> None:
    fields = [f for f in await redis.hkeys(CALIBRATION_HASH)
              if (f.decode() if isinstance(f, bytes) else f).endswith(f"|{node_id}")]
    if fields:
        await redis.hdel(CALIBRATION_HASH, *fields)


async def load_calibration(redis: Redis, config: CalibrationConfig = CalibrationConfig()
                           ) -> dict[tuple[str, str], dict[str, float]]:
    """(model, hardware) -> the median correction factor of the nodes of that hardware kind that
    reported one recently (one profile per kind is what the core decides with; the median keeps
    one odd node from moving every node's decisions), each faded by how long its node has not
    seen an iteration of that kind."""
    by_kind: dict[tuple[str, str], list[dict]] = {}
    now = time.time()
    for key, blob in (await redis.hgetall(CALIBRATION_HASH)).items():
        key = key.decode() if isinstance(key, bytes) else key
        try:
            model, hardware, _node = key.rsplit("|", 2)
            entry = json.loads(blob)
            if now - float(entry["updated"]) > CALIBRATION_TTL_S:
                continue
            by_kind.setdefault((model, hardware), []).append(entry)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("skipping bad calibration %s: %s", key, exc)
    def factor(entry: dict, kind: str) -> float:
        seen = float(entry.get(f"{kind}_seen", entry["updated"]))
        return aged(float(entry.get(kind, 1.0)), now - seen, config)

    return {k: {kind: statistics.median(factor(e, kind) for e in entries)
                for kind in (PREFILL, DECODE)} for k, entries in by_kind.items()}


async def load_perf(redis: Redis, calibrate: bool = True,
                    config: CalibrationConfig = CalibrationConfig()) -> PerfModel:
    """The measured profiles, each corrected by its online calibration (if any and `calibrate`)."""
    factors = await load_calibration(redis, config) if calibrate else {}
    perf = PerfModel()
    for field, blob in (await redis.hgetall(PROFILES_HASH)).items():
        try:
            profile = profile_from_json(blob)
        except (ValueError, wire.WireError) as exc:
            log.warning("skipping bad profile %s: %s", field, exc)
            continue
        f = factors.get((profile.model, profile.hardware.value))
        perf.add(calibrated(profile, f[PREFILL], f[DECODE]) if f else profile)
    return perf

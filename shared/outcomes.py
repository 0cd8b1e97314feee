"""A request's terminal answer that must outlive a lost message.

A placer that ends a request (dropped: no node can meet its TTFT; failed) tells the gateway on
core NATS, and a message sent while the gateway reconnects is lost. The gateway's watchdog waits
as long as no node has the request, so such a request would hang until its deadline. The placer
therefore also keeps the answer in Redis for a while (as a node keeps its finished requests for
STATUS), and the watchdog reads it when no node is there to ask.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared import wire
from shared.schemas import TokenMessage
from shared.subjects import outcome_key

OUTCOME_TTL_S = 600  # far past any request's deadline at the gateway


async def record_outcome(redis: Redis, final: TokenMessage, ttl_s: int = OUTCOME_TTL_S) -> None:
    """Keep `final` (a finished TokenMessage) for the attempt it answers."""
    if not final.finished:
        raise ValueError("only a final message is an outcome")
    await redis.set(outcome_key(final.request_id, final.attempt), wire.encode(final), ex=ttl_s)


async def read_outcome(redis: Redis, request_id: str, attempt: int) -> TokenMessage | None:
    blob = await redis.get(outcome_key(request_id, attempt))
    return wire.decode(TokenMessage, blob) if blob is not None else None

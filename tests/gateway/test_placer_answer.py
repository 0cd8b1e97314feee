"""A placer's terminal answer survives a lost message (issue 24): on a real nats-server and
valkey, a request the placer ended while its core-NATS message was lost (nothing is published
here) ends at the gateway with the placer's reason at the watchdog's next check, instead of
waiting for the gateway's deadline."""

from __future__ import annotations

import time

import nats
import pytest
from redis.asyncio import Redis

from services.gateway.backend import Finished, InferenceBackend, StreamTimeout
from services.gateway.watchdog import Verdict, WatchdogConfig
from shared.bus import ensure_streams
from shared.outcomes import read_outcome, record_outcome
from shared.schemas import FinishReason, InferenceRequest, TokenMessage

pytestmark = pytest.mark.integration


def _request(request_id: str) -> InferenceRequest:
    return InferenceRequest(request_id, "t", "m", [1, 2, 3], 8, time.time(), 1.0, 0.25)


async def _events(stream) -> list:
    out = []
    async for event in stream.events():
        out.append(event)
    return out


async def test_a_dropped_requests_lost_message_is_read_back_from_redis(nats_url, redis_url):
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    js = nc.jetstream()
    await ensure_streams(js)
    backend = InferenceBackend(nc, js, redis, WatchdogConfig(quiet_s=0.2))
    stream = await backend.submit(_request("answer-kept"), timeout_s=30.0)
    try:
        final = TokenMessage("answer-kept", 0, [], finished=True,
                             finish_reason=FinishReason.ERROR, error="dropped: no node can meet it",
                             prompt_tokens=3, attempt=0)
        await record_outcome(redis, final)  # the placer's answer; its NATS message was lost
        events = await _events(stream)
        assert events == [Finished(FinishReason.ERROR, "dropped: no node can meet it", None)]
        assert stream.verdicts[-1] is Verdict.FINISH
    finally:
        await stream.close()
        await nc.close()
        await redis.aclose()


async def test_without_a_kept_answer_the_stream_waits_for_the_placers(nats_url, redis_url):
    """The other side: no answer kept, no node known: the request is with the placers, so the
    stream waits (here until its short deadline) and never invents an ending."""
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    js = nc.jetstream()
    await ensure_streams(js)
    backend = InferenceBackend(nc, js, redis, WatchdogConfig(quiet_s=0.2))
    stream = await backend.submit(_request("answer-none"), timeout_s=1.5)
    try:
        with pytest.raises(StreamTimeout):
            await _events(stream)
        assert stream.verdicts and set(stream.verdicts) == {Verdict.WAIT}
    finally:
        await stream.close()
        await nc.close()
        await redis.aclose()


async def test_an_outcome_is_only_a_final_message_and_keeps_its_attempt(redis_url):
    redis = Redis.from_url(redis_url)
    try:
        with pytest.raises(ValueError):
            await record_outcome(redis, TokenMessage("x", 0, [1]))
        await record_outcome(redis, TokenMessage("x", 0, [], finished=True, attempt=2))
        assert await read_outcome(redis, "x", 1) is None
        kept = await read_outcome(redis, "x", 2)
        assert kept is not None and kept.finished and kept.attempt == 2
    finally:
        await redis.aclose()

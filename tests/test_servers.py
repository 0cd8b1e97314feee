"""The real servers start from their wheels and answer."""

import nats
import pytest
import redis.asyncio as aioredis

pytestmark = pytest.mark.integration


async def test_nats_has_jetstream(nats_url):
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()


async def test_redis_roundtrip(redis_url):
    r = aioredis.from_url(redis_url)
    try:
        await r.set("slinfer:test", b"x")
        assert await r.get("slinfer:test") == b"x"
    finally:
        await r.aclose()

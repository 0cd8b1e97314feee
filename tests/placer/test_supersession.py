"""The placer's queue holds one message per request: of two copies (the gateway resumed it as a
higher attempt, or a node handed it back with more tokens) the later one is placed and the other
is acked, whichever arrives first; an older copy never reaches a node.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.subjects import PLACER_DURABLE, REQUEST_STREAM

from tests.placer.conftest import FakeNode, empty_gpu, publish, request, running_placer
from tests.placer.test_placer import _idle
from tests.polling import until

pytestmark = pytest.mark.integration


async def _place_queued_copies(servers, conns, copies) -> list:
    """Publish `copies` (request, msg id) while no node exists (they queue), then add a node;
    the requests the node was commanded to run."""
    nc, redis = conns
    async with running_placer(servers) as placer:
        for req, msg_id in copies:
            await publish(nc, req, msg_id=msg_id)
        await _one_held(nc)  # every copy fetched, all but one acked
        assert list(placer.queue) == ["r"]
        node = await FakeNode(nc, redis, empty_gpu("g0")).start()
        await until(lambda: node.commanded("r"), what="the request to be placed")
        await _idle(nc)  # every copy acked: none is left to be redelivered
    await node.stop()
    return [cmd.request for cmd in node.commanded("r")]


async def _one_held(nc) -> None:
    deadline = time.monotonic() + 30
    while True:
        info = await nc.jetstream().consumer_info(REQUEST_STREAM, PLACER_DURABLE)
        if info.num_pending == 0 and info.num_ack_pending == 1:
            return
        assert time.monotonic() < deadline, f"copies not settled: {info}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("resumed_first", [False, True], ids=["older-first", "resumed-first"])
async def test_a_resumed_attempt_supersedes_the_queued_one(servers, conns, resumed_first):
    old = (request("r", ttft=60.0), "r")
    new = (request("r", ttft=60.0, attempt=1, resumed_token_ids=[7, 8]), "r:attempt:1")
    placed = await _place_queued_copies(servers, conns, [new, old] if resumed_first else [old, new])
    assert [(r.attempt, r.resumed_token_ids) for r in placed] == [(1, [7, 8])]


async def test_a_handed_back_copy_with_more_tokens_supersedes_the_queued_one(servers, conns):
    first = (request("r", ttft=60.0, resumed_token_ids=[7]), "r:resume:0:1")
    later = (request("r", ttft=60.0, resumed_token_ids=[7, 8, 9]), "r:resume:0:3")
    placed = await _place_queued_copies(servers, conns, [first, later])
    assert [r.resumed_token_ids for r in placed] == [[7, 8, 9]]

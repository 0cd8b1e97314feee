"""Predictive pre-warming on the placer (services/placer/prewarmer.py), on real NATS and valkey
with a stand-in node: the placer learns a model's idle times from the calls it places (a call
ends once a view of its node taken after its placement no longer holds it; the stand-in's view
never holds one, so each call ends at the node's next heartbeat), then either starts an instance
shortly before the next call is due (START_INSTANCE with a stand-in request and the policy's
keep-alive) or, for a model called again at once, gives its requests the policy's keep-alive.
The policy itself is tested in tests/core/test_prewarm.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from shared.cluster import save_profile
from shared.core.config import CoreConfig
from shared.core.prewarm import PrewarmConfig
from shared.registry import ModelRegistry
from shared.schemas import CommandKind

from tests.placer.conftest import (MODEL, FakeNode, empty_gpu, gpu_profile, publish, request,
                                   running_placer)
from tests.polling import until

ON = CoreConfig(prewarm=True)


def _admits(node: FakeNode) -> list:
    return [c for _, c in node.commands if c.kind is CommandKind.ADMIT]


def _prewarms(node: FakeNode) -> list[tuple[float, object]]:
    return [(t, c) for t, c in node.commands if c.kind is CommandKind.START_INSTANCE]


async def _call(nc, node: FakeNode, rid: str) -> float:
    """One call of the model, placed on `node`; when it was admitted (monotonic)."""
    await publish(nc, request(rid))
    await until(lambda: any(c.request.request_id == rid for c in _admits(node)), 30, f"{rid}'s admission")
    return next(t for t, c in node.commands if c.request is not None and c.request.request_id == rid)


async def test_a_model_called_every_two_seconds_is_prewarmed_before_its_next_call(servers, conns) -> None:
    nc, _ = conns
    node = await FakeNode(nc, conns[1], empty_gpu("g0")).start()
    config = PrewarmConfig(bin_s=0.5, bins=40, min_samples=3)
    async with running_placer(servers, core=ON, prewarm=config, prewarm_check_s=0.05) as placer:
        admitted = []
        for i in range(4):  # three idle times of ~1.7 s: all in one bin, so they predict
            admitted.append(await _call(nc, node, f"c{i}"))
            if i < 3:
                await asyncio.sleep(max(0.0, admitted[-1] + 2.0 - time.monotonic()))
                assert not _prewarms(node), "nothing is predicted before the third idle time"
        await until(lambda: _prewarms(node), 20, "a pre-warm")
        at, cmd = _prewarms(node)[0]
        # Started during the idle period, ahead of when the next call would have come (~2 s).
        assert admitted[-1] < at < admitted[-1] + 2.0 + 0.5
        assert cmd.request.request_id.startswith("prewarm-") and cmd.instance_id is None
        assert cmd.model.name == MODEL.name and 0 < cmd.model.keep_alive_s < 3.0  # the policy's
        # The placer notes the pre-warm once the node's acceptance is back, after the node saw it.
        await until(lambda: placer.prewarmer.started, 30, "the placer to note the pre-warm")
        assert placer.prewarmer.started[0].node_id == "g0"
        await asyncio.sleep(1.0)
        assert len(_prewarms(node)) == 1  # once per idle period
        assert all(c.request.keep_alive_s is None for c in _admits(node))  # not kept: pre-warmed
    await node.stop()


async def test_a_model_called_again_at_once_keeps_its_instance_for_the_policys_window(servers, conns) -> None:
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    config = PrewarmConfig(bin_s=1.0, bins=40, min_samples=3)
    async with running_placer(servers, core=ON, prewarm=config, prewarm_check_s=0.05) as placer:
        for i in range(5):  # idle times of a fraction of a second: in the first bin
            t = await _call(nc, node, f"c{i}")
            await asyncio.sleep(max(0.0, t + 0.7 - time.monotonic()))
        windows = [c.request.keep_alive_s for c in _admits(node)]
        assert windows[:3] == [None] * 3  # learning: the fixed keep-alive
        policy = placer.prewarmer.tracker.windows(MODEL.name, ON.keep_alive_s)
        assert policy.predicted and policy.prewarm_s == 0  # called again at once: no pre-warm
        # The last call carries the policy's window: the tail bin's upper edge plus 10% (1.1 s
        # when every idle time fell in the first bin, as they do unless the box stalls a second).
        assert windows[-1] == policy.keep_alive_s and windows[-1] >= 1.0 * 1.1
        assert not _prewarms(node)  # its instance is kept, none is started
    await node.stop()


async def test_a_model_with_its_own_keep_alive_and_pre_warming_off_keep_theirs(servers, conns) -> None:
    nc, redis = conns
    await ModelRegistry(redis).register(replace(MODEL, name="own", keep_alive_s=30.0))
    await save_profile(redis, gpu_profile("own"))
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    config = PrewarmConfig(bin_s=1.0, bins=40, min_samples=3)
    async with running_placer(servers, core=CoreConfig(), prewarm=config, prewarm_check_s=0.05) as placer:
        for i in range(5):  # pre-warming off: the calls change nothing
            t = await _call(nc, node, f"off{i}")
            await asyncio.sleep(max(0.0, t + 0.7 - time.monotonic()))
        assert not placer.prewarmer.calls and not placer.prewarmer.tracker.models
    async with running_placer(servers, core=ON, prewarm=config, prewarm_check_s=0.05):
        for i in range(5):
            await publish(nc, request(f"own{i}", model="own"))
            await until(lambda: any(c.request.request_id == f"own{i}" for c in _admits(node)), 30,
                        f"own{i}'s admission")
            await asyncio.sleep(0.7)
    assert all(c.request.keep_alive_s is None for c in _admits(node))  # the model's own applies
    assert not _prewarms(node)
    await node.stop()

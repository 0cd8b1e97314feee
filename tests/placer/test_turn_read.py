"""The placer reads the cluster once per turn: every live node's view and every registered model,
in one Redis round trip (`PlacerPort.read_turn`). On real valkey: what it reads must be what the
separate reads (`read_nodes`, `ModelRegistry.list`) give, as nodes join, leave and expire."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.placer.port import PlacerPort
from shared.cluster import publish_node, read_nodes, remove_node
from shared.registry import ModelRegistry
from shared.subjects import NODES_SET

from tests.placer.conftest import MODEL, empty_gpu, settings


async def _both(port: PlacerPort, redis):
    views, records = await port.read_turn()
    return ([v.node_id for v in views], [r.name for r in records],
            [v.node_id for v in await read_nodes(redis)],
            [r.name for r in await ModelRegistry(redis).list()])


async def test_the_turn_read_follows_nodes_joining_leaving_and_expiring(servers, conns) -> None:
    nc, redis = conns
    port = PlacerPort(settings(servers), nc, redis)
    registry = ModelRegistry(redis)  # (the fixture registered MODEL)
    assert await port.read_turn() == ([], [MODEL])  # no node yet: no snapshot to ask for
    await publish_node(redis, empty_gpu("g0"), ttl_s=60)
    assert await _both(port, redis) == (["g0"], ["m"], ["g0"], ["m"])  # a node joined
    await publish_node(redis, empty_gpu("g1"), ttl_s=0.3)
    await registry.register(replace(MODEL, name="m2"))
    assert await _both(port, redis) == (["g0", "g1"], ["m", "m2"], ["g0", "g1"], ["m", "m2"])
    views, _ = await port.read_turn()  # the same members: one trip, fresh snapshots
    assert [v.memory_bytes for v in views] == [80 * 1024**3] * 2
    await publish_node(redis, empty_gpu("g0", memory_gb=40), ttl_s=60)
    views, _ = await port.read_turn()
    assert views[0].memory_bytes == 40 * 1024**3  # a snapshot written since is the one read
    await asyncio.sleep(0.5)  # g1 stops its heartbeats: its snapshot expires
    assert (await port.read_turn())[0][0].node_id == "g0" and len((await port.read_turn())[0]) == 1
    assert await redis.smembers(NODES_SET) == {b"g0"}  # and it left the set
    await remove_node(redis, "g0")
    assert await port.read_turn() == ([], [r for r in await registry.list()])


async def test_reads_side_by_side_each_see_the_nodes_they_asked_for(servers, conns) -> None:
    """Two turn reads in flight at once (the pre-warmer's, pinning's, the turn's own) while a
    node joins: the one that asked for the old members' snapshots must not pair them with the
    new members the other read recorded meanwhile."""
    nc, redis = conns
    port = PlacerPort(settings(servers), nc, redis)
    await publish_node(redis, empty_gpu("g0"), ttl_s=60)
    await port.read_turn()  # members: g0
    await publish_node(redis, empty_gpu("g1", memory_gb=40), ttl_s=60)
    for _ in range(20):  # interleavings vary with the event loop: try a few
        port._node_ids = ["g0"]  # noqa: SLF001 - the state the race needs
        reads = await asyncio.gather(*(port.read_turn() for _ in range(3)))
        for views, _ in reads:
            assert [(v.node_id, v.memory_bytes) for v in views] == [
                ("g0", 80 * 1024**3), ("g1", 40 * 1024**3)]

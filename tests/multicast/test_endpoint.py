"""One multicast endpoint in the test process, on real NATS and a real TCP listener, driven by
hand as a coordinator and a sender would drive it: a block whose bytes do not match its checksum
is refused (and reported), the same block with the right bytes is counted and, as the last one,
makes the node register the model in its DRAM tier; a sender that never connects is reported."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket

import pytest

from services.node.loader import CheckpointLoader, LoaderSettings
from services.node.multicast import MulticastEndpoint
from services.node.multicast_transfer import FRAME, HELLO, build_manifest
from services.node.loader.direct_io import writable_view
from shared.subjects import multicast_events_subject

from tests.multicast.conftest import ask
from tests.polling import until

pytestmark = pytest.mark.integration


@pytest.fixture
async def endpoint(nc):
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=1 << 30, dram_bytes_per_s=1e10))
    ep = MulticastEndpoint(nc, "under-test", loader, connect_timeout_s=0.5)
    await ep.start()
    try:
        yield ep
    finally:
        await ep.stop()
        loader.close()


@pytest.fixture(scope="module")
def source(small_model):
    """The checkpoint in this process's memory and its manifest, as a source would offer it."""
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=1 << 30, dram_bytes_per_s=1e10))
    host = loader.host_checkpoint(small_model)
    yield host, build_manifest(host, str(small_model), blocks=4)
    loader.close()


class Events:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def cb(self, msg) -> None:
        self.queue.put_nowait(json.loads(msg.data))

    async def next(self, kind: str, timeout: float = 30.0) -> dict:
        while True:
            event = await asyncio.wait_for(self.queue.get(), timeout)
            if event["kind"] == kind:
                return event


def _holders(endpoint) -> str:
    """What still refers to each host-pool buffer in use (for a failure message)."""
    slots = [s for s in endpoint.loader._buffers._slots if not s.is_free()]
    return "; ".join(f"{s.size} bytes: " + ", ".join(
        type(r).__name__ for r in gc.get_referrers(s.memory)) for s in slots) or "none"


def _send_blocks(address, transfer: str, epoch: int, blocks, views, corrupt: bool = False):
    with socket.create_connection(tuple(address), timeout=10) as sock:
        hello = json.dumps({"transfer": transfer, "epoch": epoch, "src": "sender"}).encode()
        sock.sendall(HELLO.pack(len(hello)) + hello)
        for b in blocks:
            data = bytearray(views[b.file][b.start:b.end])
            if corrupt:
                data[len(data) // 2] ^= 0x01
            sock.sendall(FRAME.pack(b.index, b.size) + bytes(data))


@contextlib.asynccontextmanager
async def receiving(nc, transfer: str, manifest):
    """The endpoint prepared as a destination of `transfer`: its events and its address."""
    events = Events()
    sub = await nc.subscribe(multicast_events_subject(transfer), cb=events.cb)
    try:
        got = await ask(nc, "under-test", {"op": "prepare", "transfer": transfer,
                                           "manifest": manifest.to_wire()})
        assert got["ok"], got
        yield events, got["address"]
    finally:
        await sub.unsubscribe()


async def send_epoch(nc, transfer: str, address, number: int, manifest, views,
                     corrupt: bool = False) -> None:
    """As the coordinator: plan epoch `number` (every block from "sender") and start it; then,
    as the sender, send the blocks (only the first, one bit flipped, with `corrupt`)."""
    everything = [[s, "sender", b.index] for s, b in enumerate(manifest.blocks)]
    for op, body in (("plan", {"epoch": number, "addresses": {}, "sends": [],
                               "receives": everything}), ("go", {"epoch": number})):
        reply = await ask(nc, "under-test", {"op": op, "transfer": transfer, **body})
        assert reply["ok"], reply
    await asyncio.to_thread(_send_blocks, address, transfer, number,
                            manifest.blocks[:1] if corrupt else manifest.blocks, views, corrupt)


async def test_a_corrupt_block_is_refused_and_the_good_one_completes_the_model(
        endpoint, nc, source, small_model, small_digests):
    host, manifest = source
    views = {f: writable_view(buf) for f, buf in host.buffers.items()}
    transfer = "t-corrupt"
    async with receiving(nc, transfer, manifest) as (events, address):
        await send_epoch(nc, transfer, address, 0, manifest, views, corrupt=True)
        suspect = await events.next("suspect")
        assert suspect["peer"] == "sender" and "block 0 from sender failed its checksum" in \
            suspect["reason"]
        reply = await ask(nc, "under-test", {"op": "abort", "transfer": transfer, "epoch": 0})
        assert reply["have"] == [] and not reply["complete"]

        await send_epoch(nc, transfer, address, 1, manifest, views)
        done = await events.next("complete")
        assert done["registered"]
        reply = await ask(nc, "under-test", {"op": "finish", "transfer": transfer})
        assert reply["complete"] and reply["registered"]
    digest = await ask(nc, "under-test", {"op": "digest", "model_path": str(small_model)})
    assert digest["tier"] == "dram" and digest["tensors"] == small_digests


async def test_a_sender_that_never_connects_is_reported(endpoint, nc, source):
    _, manifest = source
    transfer = "t-ghost"
    events = Events()
    sub = await nc.subscribe(multicast_events_subject(transfer), cb=events.cb)
    try:
        assert (await ask(nc, "under-test", {"op": "prepare", "transfer": transfer,
                                             "manifest": manifest.to_wire()}))["ok"]
        for op, body in (("plan", {"epoch": 0, "addresses": {}, "sends": [],
                                   "receives": [[0, "ghost", 0]]}), ("go", {"epoch": 0})):
            assert (await ask(nc, "under-test", {"op": op, "transfer": transfer, **body}))["ok"]
        suspect = await events.next("suspect")
        assert suspect["peer"] == "ghost" and "did not connect" in suspect["reason"]
    finally:
        await sub.unsubscribe()
        await ask(nc, "under-test", {"op": "finish", "transfer": transfer})


async def test_unknown_transfers_and_ops_get_an_error_answer(endpoint, nc):
    reply = await ask(nc, "under-test", {"op": "go", "transfer": "nope", "epoch": 0})
    assert not reply["ok"] and "no transfer nope" in reply["error"]
    reply = await ask(nc, "under-test", {"op": "explode"})
    assert not reply["ok"] and "unknown op" in reply["error"]


async def test_a_transfer_whose_coordinator_never_finishes_it_is_forgotten(endpoint, nc, source):
    _, manifest = source
    got = await ask(nc, "under-test", {"op": "prepare", "transfer": "t-orphan", "ttl_s": 0.2,
                                       "manifest": manifest.to_wire()})
    assert got["ok"], got
    reply = {"ok": True}
    for _ in range(100):  # gone after its ttl (polled, no wall-clock bound asserted)
        reply = await ask(nc, "under-test", {"op": "abort", "transfer": "t-orphan", "epoch": 0})
        if not reply["ok"]:
            break
        await asyncio.sleep(0.1)
    assert not reply["ok"] and "no transfer t-orphan" in reply["error"]


async def test_a_received_model_dropped_from_the_dram_tier_frees_its_buffers_for_the_next(
        endpoint, nc, source, small_model):
    """A finished transfer keeps nothing: once its model leaves the DRAM tier, the buffers it
    arrived in go back to the loader's pool (repeated bursts must not grow a node's memory)."""
    host, manifest = source
    views = {f: writable_view(buf) for f, buf in host.buffers.items()}
    for transfer in ("t-first", "t-second"):
        async with receiving(nc, transfer, manifest) as (events, address):
            await send_epoch(nc, transfer, address, 0, manifest, views)
            assert (await events.next("complete"))["registered"]
            assert (await ask(nc, "under-test", {"op": "finish", "transfer": transfer}))["ok"]
        assert endpoint.loader.free_buffer_bytes() == 0  # the DRAM tier holds the copy
        reply = await ask(nc, "under-test", {"op": "drop", "model_path": str(small_model)})
        assert reply["dropped"]
        # Waited for, not read at once: twice in full runs (one in CI) the buffers were still
        # viewed just after the drop, by something not found yet that lets go (a leak would
        # keep them, and fail here all the same).
        try:
            await until(lambda: endpoint.loader.free_buffer_bytes() >= host.nbytes, 30.0,
                        f"the buffers of {transfer} back in the pool")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; still viewed: {_holders(endpoint)}") from None

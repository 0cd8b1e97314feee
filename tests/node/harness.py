"""A node worker in the test process, driven over real NATS by a stand-in placer (the test)."""

from __future__ import annotations

import asyncio
import time
import uuid

from services.node.settings import NodeSettings
from services.node.worker import NodeWorker
from shared import wire
from shared.core.config import CoreConfig
from shared.registry import model_record_from_dir
from shared.schemas import CommandKind, InferenceRequest, NodeCommand, NodeReply, TokenMessage
from shared.subjects import REQUEST_SUBJECT, node_command_subject, token_subject

from tests.polling import until

__all__ = ["MODELS", "Harness", "submit", "until"]

MODELS = ("alpha", "beta")


async def submit(nc, model: str, prompt_len: int, max_tokens: int,
                 finals: dict[str, TokenMessage], prefix: str = "req") -> str:
    """Publish a greedy request on the placer's request stream (the gateway's part); its final
    token message lands in `finals` under the returned request id."""
    rid = f"{prefix}-{uuid.uuid4().hex[:8]}"

    async def on_token(msg) -> None:
        m = wire.decode(TokenMessage, msg.data)
        if m.finished:
            finals[rid] = m

    await nc.subscribe(token_subject(rid), cb=on_token)
    req = InferenceRequest(rid, "t", model, [5 + i for i in range(prompt_len)], max_tokens,
                           time.time(), 30.0, 0.5, temperature=0.0)
    await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req), headers={"Nats-Msg-Id": rid})
    return rid


class Harness:
    """A node worker in this process and a stand-in placer talking to it over real NATS."""

    def __init__(self, nc, redis, model_dir, memory_bytes: int, node_id: str,
                 heartbeat_s: float = 0.25, calibrate: bool = True,
                 core: CoreConfig | None = None) -> None:
        self.nc, self.redis = nc, redis
        self.records = {m: model_record_from_dir(m, model_dir) for m in MODELS}
        settings = NodeSettings(node_id=node_id, hardware="cpu", device="cpu",
                                memory_bytes=memory_bytes, matrix_accel=True, nats_url="", redis_url="",
                                core=core or CoreConfig(keep_alive_s=30.0), heartbeat_s=heartbeat_s,
                                calibrate=calibrate)
        self.worker = NodeWorker(settings, nc, redis)
        self.instances: dict[str, str] = {}
        self.tokens: dict[str, list[float]] = {}  # request id -> arrival time of each token
        self.done: dict[str, asyncio.Event] = {}
        self.finals: dict[str, TokenMessage] = {}
        self.messages: dict[str, list[TokenMessage]] = {}  # every token message, in arrival order

    def request(self, model: str, prompt_len: int, max_tokens: int, ttft: float,
                tpot: float = 0.25) -> InferenceRequest:
        rid = f"{model}-{uuid.uuid4().hex[:8]}"
        return InferenceRequest(rid, "t", model, [5 + (i % 1000) for i in range(prompt_len)],
                                max_tokens, time.time(), ttft, tpot, temperature=0.0)

    async def watch(self, req: InferenceRequest) -> None:
        """Record the request's token stream, wherever it is served."""
        rid = req.request_id
        self.tokens[rid], self.done[rid], self.messages[rid] = [], asyncio.Event(), []

        async def on_token(msg, rid=rid):
            m = wire.decode(TokenMessage, msg.data)
            self.messages[rid].append(m)
            self.tokens[rid].extend([time.time()] * len(m.token_ids))
            if m.finished:
                self.finals[rid] = m
                self.done[rid].set()

        await self.nc.subscribe(token_subject(rid), cb=on_token)

    async def command(self, cmd: NodeCommand) -> NodeReply:
        return wire.decode(NodeReply, (await self.nc.request(
            node_command_subject(self.worker.s.node_id), wire.encode(cmd), timeout=10)).data)

    async def admit(self, model: str, prompt_len: int, max_tokens: int, ttft: float, tpot: float = 0.25) -> tuple[InferenceRequest, NodeReply]:
        req = self.request(model, prompt_len, max_tokens, ttft, tpot)
        await self.watch(req)
        iid = self.instances.get(model)
        reply = await self.command(NodeCommand(CommandKind.ADMIT, request=req, instance_id=iid,
                                               model=None if iid else self.records[model]))
        if reply.accepted:
            self.instances[model] = reply.instance_id
        return req, reply

    async def wait(self, reqs, timeout: float = 60) -> None:
        await asyncio.wait_for(asyncio.gather(*[self.done[r.request_id].wait() for r in reqs]), timeout)

    def lateness(self, req: InferenceRequest) -> tuple[int, float | str]:
        """(index of the worst token, seconds past its deadline) for a failure message."""
        times = self.tokens[req.request_id]
        if not times:
            final = self.finals.get(req.request_id)
            return -1, final.error if final else "no final message"
        worst = max(range(len(times)), key=lambda k: times[k] - req.tpot_slo_s * k)
        return worst, times[worst] - (req.arrival + req.ttft_slo_s + req.tpot_slo_s * worst)

    def streamed_once(self, req: InferenceRequest) -> bool:
        """Every output token streamed exactly once, in order, with no gap (the final message's
        full output is what the client ends up with)."""
        final = self.finals[req.request_id]
        seen: list[int] = []
        for m in self.messages[req.request_id]:
            if m.seq != len(seen):
                return False
            seen += m.token_ids
        return seen == final.output_token_ids

    def deadlines_met(self, req: InferenceRequest) -> bool:
        """Token k must arrive by ST + TTFT + TPOT*k (eq. 1 never negative)."""
        times = self.tokens[req.request_id]
        return bool(times) and all(t <= req.arrival + req.ttft_slo_s + req.tpot_slo_s * k + 1e-3
                                   for k, t in enumerate(times))


class Requeued:
    """Requests handed back to the request stream (a plain subscriber sees the stream's publishes)."""

    def __init__(self) -> None:
        self.requests: list[InferenceRequest] = []

    async def start(self, nc) -> None:
        async def on_msg(msg):
            self.requests.append(wire.decode(InferenceRequest, msg.data))
        self.sub = await nc.subscribe(REQUEST_SUBJECT, cb=on_msg)

    def of(self, request_id: str) -> list[InferenceRequest]:
        return [r for r in self.requests if r.request_id == request_id]

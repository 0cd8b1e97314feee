"""A stand-in for placer + node in the gateway tests: pulls requests off the JetStream request
stream and plays back a scripted token stream on the request's token subject. It also records the
cancel notices the gateway publishes. Test-only; the real path is the placer's and node's."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import nats
import numpy as np
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared import wire
from shared.schemas import CancelNotice, FinishReason, InferenceRequest, TokenLogprob, TokenMessage
from shared.subjects import CANCEL_SUBJECT, REQUEST_STREAM, REQUEST_SUBJECT, token_subject
from shared.tasks import cancel_and_wait


@dataclass
class Hang:
    """Script step: send nothing more (until cancelled)."""


Step = TokenMessage | float | Hang  # a message to send, or seconds to wait, or hang
Script = Callable[[InferenceRequest], list[Step]]


def scripted_logprobs(req: InferenceRequest, tokens: list[int]) -> list[TokenLogprob]:
    """What a node sends for `tokens` of a request that asked for logprobs ([] otherwise): each
    token the likeliest, at log(1/2), then the ids after it (inside the tiny model's vocabulary)
    at log(1/4), log(1/8), ..."""
    if req.logprobs is None:
        return []
    return [TokenLogprob(math.log(0.5), [(t + i) % 1000 for i in range(req.logprobs)],
                         [math.log(0.5 ** (i + 1)) for i in range(req.logprobs)])
            for t in tokens]


def scripted_prompt_logprobs(req: InferenceRequest) -> list[TokenLogprob]:
    """What a node sends with the first token for the prompt of a request that asked for
    prompt logprobs (echo): the tokens after the first, scored as `scripted_logprobs` does."""
    if req.prompt_logprobs is None:
        return []
    return scripted_logprobs(replace(req, logprobs=req.prompt_logprobs), req.prompt_token_ids[1:])


def token_script(
    req: InferenceRequest,
    output: list[int],
    *,
    chunk: int = 2,
    finish: FinishReason = FinishReason.LENGTH,
    order: str = "in_order",  # in_order | shuffled (pairs swapped) | gap (one chunk never sent)
    delay_s: float = 0.0,
    final: bool = True,
) -> list[Step]:
    """The node's part for `output`: seq-numbered chunks, then the final message with the whole
    output. `gap` loses a middle chunk that only the final message can fill."""
    chunks = [TokenMessage(req.request_id, seq, output[seq:seq + chunk],
                           logprobs=scripted_logprobs(req, output[seq:seq + chunk]),
                           prompt_logprobs=[] if seq else scripted_prompt_logprobs(req))
              for seq in range(0, len(output), chunk)]
    if order == "shuffled":
        for i in range(0, len(chunks) - 1, 2):
            chunks[i], chunks[i + 1] = chunks[i + 1], chunks[i]
    elif order == "gap":
        assert len(chunks) >= 3
        del chunks[len(chunks) // 2]
    steps: list[Step] = []
    for c in chunks:
        steps.append(c)
        if delay_s:
            steps.append(delay_s)
    if final:
        steps.append(TokenMessage(req.request_id, len(output), [], finished=True, finish_reason=finish,
                                  output_token_ids=list(output),
                                  prompt_tokens=len(req.prompt_token_ids), node_id="fake-node"))
    return steps


def scripted_vector(req: InferenceRequest) -> np.ndarray:
    """What a node sends for an embedding request: a unit vector that depends on its prompt
    (its length and first id)."""
    v = np.arange(1, 9, dtype="<f4") + np.float32(len(req.prompt_token_ids) + req.prompt_token_ids[0])
    return v / np.linalg.norm(v)


def embedding_script(req: InferenceRequest, vector: bytes | None = None,
                     error: str | None = None) -> list[Step]:
    """A node's answer to an embedding request: one final message, with the vector (or the
    error)."""
    data = scripted_vector(req).astype("<f4").tobytes() if vector is None else vector
    return [TokenMessage(req.request_id, 0, [], finished=True,
                         finish_reason=FinishReason.ERROR if error else FinishReason.STOP,
                         prompt_tokens=len(req.prompt_token_ids), node_id="fake-node",
                         error=error, embedding=b"" if error else data)]


@dataclass
class Responder:
    nats_url: str
    tokenizer: object
    script: Script | None = None
    requests: list[InferenceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancels: list[CancelNotice] = field(default_factory=list)

    async def start(self) -> None:
        self._nc = await nats.connect(self.nats_url)
        js = self._nc.jetstream()
        self._psub = await js.pull_subscribe(
            REQUEST_SUBJECT, stream=REQUEST_STREAM, config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW))
        self._cancel_sub = await self._nc.subscribe(CANCEL_SUBJECT, cb=self._on_cancel)
        self._cancel_event = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.create_task(self._pull())

    async def stop(self) -> None:
        await cancel_and_wait(self._loop, *self._tasks)  # it pulls from JetStream: shared.tasks
        await self._nc.close()

    async def _on_cancel(self, msg) -> None:
        self.cancels.append(wire.decode(CancelNotice, msg.data))
        self._cancel_event.set()

    async def _pull(self) -> None:
        while True:
            try:
                msgs = await self._psub.fetch(8, timeout=0.5)
            except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either when idle
                continue
            for msg in msgs:
                await msg.ack()
                req = wire.decode(InferenceRequest, msg.data)
                self.requests.append(req)
                self.headers.append(dict(msg.headers or {}))
                task = asyncio.create_task(self._play(req))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def default_output(self, text: str = "Hello, wörld — ✓ 日本") -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def _play(self, req: InferenceRequest) -> None:
        script = self.script or (lambda r: embedding_script(r) if r.embedding is not None
                                 else token_script(r, self.default_output()))
        for step in script(req):
            if isinstance(step, Hang):
                return
            if isinstance(step, float | int):
                await asyncio.sleep(step)
                continue
            await self._nc.publish(token_subject(req.request_id), wire.encode(step))
        await self._nc.flush()

    async def wait_cancel(self, request_id: str | None = None, timeout_s: float = 5.0) -> CancelNotice:
        async def wait() -> CancelNotice:
            while True:
                for c in self.cancels:
                    if request_id is None or c.request_id == request_id:
                        return c
                self._cancel_event.clear()
                await self._cancel_event.wait()

        return await asyncio.wait_for(wait(), timeout_s)

    async def settle(self) -> None:
        """Until what the gateway published before its last answer has reached our callbacks:
        the gateway flushes a cancel before it answers, NATS delivers it ahead of the reply to
        this flush, and the callbacks run within a few loop turns after that."""
        await self._nc.flush()
        for _ in range(10):
            await asyncio.sleep(0)

    async def wait_requests(self, n: int, timeout_s: float = 5.0) -> list[InferenceRequest]:
        async def wait() -> list[InferenceRequest]:
            while len(self.requests) < n:
                await asyncio.sleep(0.01)
            return self.requests

        return await asyncio.wait_for(wait(), timeout_s)

"""Delivering a `Generation` to the client, streamed (SSE) or whole, and cancelling it on the node
when the client goes away — whether it leaves mid-stream or while waiting for a whole response."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.gateway.errors import APIError
from services.gateway.generation import Generation
from services.gateway.responses import ResponseFormat, usage

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    pass


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class SSEResponse(Response):
    """Streams byte chunks and watches the connection at the same time: when the client
    disconnects, the chunk source is cancelled at once (not at the next write) and closed, so its
    cleanup (the cancel notice) runs even while no token is flowing."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)  # no body attribute: no Content-Length
        self._chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self._chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass  # the connection broke under a write; the generator's cleanup still runs below
        finally:
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()  # type: ignore[attr-defined]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def respond(request: Request, gen: Generation, fmt: ResponseFormat, prompt_tokens: int,
                  stream: bool, include_usage: bool) -> Response:
    if not stream:
        try:
            return JSONResponse(await until_disconnect(request, _whole(gen, fmt, prompt_tokens)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was cancelled
        finally:
            await gen.close()

    # Wait for the first token before sending headers, so that a request dropped or failed before
    # producing anything gets a proper HTTP status rather than an error event.
    deltas = gen.deltas()
    try:
        first = await until_disconnect(request, _first(deltas))
    except ClientGone:
        await gen.close()
        return Response(status_code=499)
    except BaseException:
        await gen.close()
        raise
    return SSEResponse(_sse_chunks(gen, deltas, first, fmt, prompt_tokens, include_usage))


_END = object()


async def _first(deltas: AsyncIterator[str]) -> Any:
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return _END


async def _whole(gen: Generation, fmt: ResponseFormat, prompt_tokens: int) -> dict[str, Any]:
    async for _ in gen.deltas():
        pass
    assert gen.finish_reason is not None
    return fmt.whole(gen.text, gen.finish_reason, usage(prompt_tokens, gen.completion_tokens),
                     gen.logprobs)


async def _sse_chunks(gen: Generation, deltas: AsyncIterator[str], first: Any, fmt: ResponseFormat,
                      prompt_tokens: int, include_usage: bool) -> AsyncIterator[bytes]:
    def so_far() -> dict[str, int] | None:  # read when each chunk is made: the count grows
        return usage(prompt_tokens, gen.completion_tokens) if fmt.continuous_usage else None

    try:
        for chunk in fmt.opening(so_far()):
            yield sse(chunk)
        if first is not _END:
            # A delta whose text is held back (half a character, a possible stop sequence, the
            # start of a tool call) sends nothing; its tokens' logprobs go with the next chunk.
            if first and (chunk := fmt.delta(first, so_far(), gen.take_logprobs())) is not None:
                yield sse(chunk)
            async for text in deltas:
                if text and (chunk := fmt.delta(text, so_far(), gen.take_logprobs())) is not None:
                    yield sse(chunk)
        assert gen.finish_reason is not None
        yield sse(fmt.closing(gen.finish_reason, so_far(), gen.take_logprobs()))
        if include_usage:
            yield sse(fmt.usage_chunk(usage(prompt_tokens, gen.completion_tokens)))
    except APIError as exc:
        yield sse(exc.body())  # the stream already started: the error travels as an event
    finally:
        await gen.close()  # cancels on the node unless it finished (disconnect, error, timeout)
    yield sse("[DONE]")

"""Delivering a request's choices (`Choices`) to the client, streamed (SSE) or whole, and
cancelling them on their nodes when the client goes away — whether it leaves mid-stream or while
waiting for a whole response — or when one of them fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.gateway import errors
from services.gateway.choices import ChoiceEvent, Choices
from services.gateway.errors import APIError
from services.gateway.responses import ResponseFormat, usage
from shared.tasks import cancel_and_wait

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    pass


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


Render = Callable[[AsyncIterator[ChoiceEvent], Any], AsyncIterator[bytes]]


class SSEResponse(Response):
    """A streamed answer. It waits for the first event before any header goes out, so that a
    request dropped or failed before producing anything gets a proper HTTP status (the answer
    the app's error handlers give) rather than an error event; then it streams the chunks that
    `render(events, first)` makes. All along it watches the connection: when the client
    disconnects, the wait or the chunk source is cancelled at once (not at the next write) and
    the choices are closed, so their cleanup (the cancel notice) runs even while no token flows.

    (Waiting here, inside the response, rather than in the route before it returns: when the
    first token comes, only its chunk is left to make and send. ~0.2 ms of every time to first
    token on the 2-core box went to returning through the framework and starting the response.)"""

    media_type = "text/event-stream"

    def __init__(self, choices: Choices, render: Render) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)  # no body attribute: no Content-Length
        self._choices = choices
        self._render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self._choices.events()
        chunks: AsyncIterator[bytes] | None = None
        failure: Exception | None = None  # before the first event
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    first = await _first(events)
                except Exception as exc:
                    failure = exc
                    tg.cancel_scope.cancel()
                    return
                chunks = self._render(events, first)
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass  # the connection broke under a write; the generator's cleanup still runs below
        finally:
            with anyio.CancelScope(shield=True):
                if chunks is not None:
                    await chunks.aclose()  # type: ignore[attr-defined]
                else:  # failed, or the client left, before the first event
                    await self._choices.close(CHOICE_FAILED if isinstance(failure, APIError)
                                              else "client disconnected")
            if chunks is None:
                await self._before_first(failure, scope, receive, send)

    @staticmethod
    async def _before_first(failure: Exception | None, scope: Scope, receive: Receive,
                            send: Send) -> None:
        """The answer when no event came: the failure's, or 499 for a client that left."""
        if failure is None:
            answer: Response = Response(status_code=499)  # nobody reads it
        else:
            answer = errors.answer(Request(scope, receive), failure)
        await answer(scope, receive, send)


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
        await cancel_and_wait(task)  # (its outcome no longer matters: nobody reads it)
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


# Why the other choices of a request are cancelled when one of them failed.
CHOICE_FAILED = "a choice of the request failed"


async def respond(request: Request, choices: Choices, fmts: list[ResponseFormat],
                  prompt_tokens: int, stream: bool, include_usage: bool) -> Response:
    """`fmts[i]` renders choice i. Usage counts the prompt once and every choice's output."""
    if not stream:
        reason = "client disconnected"
        try:
            return JSONResponse(await until_disconnect(request, _whole(choices, fmts,
                                                                       prompt_tokens)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was cancelled
        except APIError:
            reason = CHOICE_FAILED
            raise
        finally:
            await choices.close(reason)

    return SSEResponse(choices, lambda events, first: _sse_chunks(
        choices, events, first, fmts, prompt_tokens, include_usage))


_END = object()


async def _first(events: AsyncIterator[ChoiceEvent]) -> Any:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return _END


async def _whole(choices: Choices, fmts: list[ResponseFormat],
                 prompt_tokens: int) -> dict[str, Any]:
    async for _ in choices.events():
        pass
    rendered = []
    for gen, fmt in zip(choices, fmts):
        assert gen.finish_reason is not None
        rendered.append(fmt.choice(gen.text, gen.finish_reason, gen.logprobs,
                                   gen.prompt_logprobs))
    return fmts[0].whole(rendered, usage(prompt_tokens, choices.completion_tokens))


async def _sse_chunks(choices: Choices, events: AsyncIterator[ChoiceEvent], first: Any,
                      fmts: list[ResponseFormat], prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
    continuous = fmts[0].continuous_usage

    def so_far() -> dict[str, int] | None:  # read when each chunk is made: the count grows
        return usage(prompt_tokens, choices.completion_tokens) if continuous else None

    reason = "client disconnected"
    opened: set[int] = set()
    try:
        event = first
        while event is not _END:
            fmt = fmts[event.index]
            if event.index not in opened:  # a choice opens with its first piece (it has the
                opened.add(event.index)    # prompt's logprobs, for echo, by then)
                for chunk in fmt.opening(so_far(), choices[event.index].prompt_logprobs):
                    yield sse(chunk)
            if event.text is None:
                finish_reason = choices[event.index].finish_reason
                assert finish_reason is not None
                yield sse(fmt.closing(finish_reason, so_far(), event.entries))
            # A delta whose text is held back (half a character, a possible stop sequence, the
            # start of a tool call) sends nothing; its tokens' logprobs go with the next chunk.
            elif event.text and (chunk := fmt.delta(event.text, so_far(),
                                                    event.entries)) is not None:
                yield sse(chunk)
            event = await _first(events)
        if include_usage:
            yield sse(fmts[0].usage_chunk(usage(prompt_tokens, choices.completion_tokens)))
    except APIError as exc:
        reason = CHOICE_FAILED
        yield sse(exc.body())  # the stream already started: the error travels as an event
    finally:
        # Cancels on the nodes what has not finished (disconnect, error, timeout).
        await choices.close(reason)
    yield sse("[DONE]")

"""Request bodies: a size limit enforced while reading (413 before the whole body is in memory),
and strict UTF-8 before any JSON parsing."""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import body_too_large, invalid_request


class BodyLimitMiddleware:
    """Pure ASGI: a declared Content-Length above the limit is refused at once; a body without
    one (chunked) is counted as it arrives and reading stops at the limit."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await invalid_request("Invalid Content-Length header.").response()(scope, receive, send)
                    return
                if declared > self.limit:
                    await body_too_large(self.limit).response()(scope, receive, send)
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise body_too_large(self.limit)
            return message

        await self.app(scope, limited_receive, send)


async def read_utf8_body(request: Request) -> bytes:
    """The raw body, checked to be UTF-8 (pydantic parses the JSON from bytes)."""
    body = await read_optional_body(request)
    if not body.strip():
        raise invalid_request("The request body is empty; expected a JSON object.", code="invalid_json")
    return body


async def read_optional_body(request: Request) -> bytes:
    """The raw body, checked to be UTF-8; it may be empty (a route whose body is optional)."""
    body = await request.body()
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"The request body is not valid UTF-8 (byte {exc.start}).",
                              code="invalid_utf8") from None
    return body

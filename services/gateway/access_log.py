"""The gateway's access log: a line per HTTP request, written when its response has ended.

uvicorn's own access log (off: `__main__.py`) writes its line when a response *starts*: for a
stream that is between the first token and the client's first byte, a log record formatted and
written on the way (~0.1 ms of every time to first token on the 2-core box).
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("slinfer.gateway.access")


class AccessLogMiddleware:
    """Pure ASGI: `client - "METHOD path HTTP/v" status duration`, as uvicorn's line with the
    request's whole duration (a stream's too). Status 500 when the app sent no response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            log.info('%s - "%s %s HTTP/%s" %d %.1f ms', _client(scope), scope["method"],
                     _target(scope), scope.get("http_version", "1.1"), status,
                     (time.perf_counter() - started) * 1e3)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _target(scope: Scope) -> str:
    query = scope.get("query_string", b"")
    return scope.get("path", "") + (f"?{query.decode('latin-1')}" if query else "")

"""The inference routes' way in: `POST /v1/completions` and `POST /v1/chat/completions` go
straight to their endpoint functions, ahead of FastAPI's router.

FastAPI's way to an endpoint (its exception and exit-stack middlewares, route matching through
the included routers, dependency solving, its request/response wrapper) took ~0.2 ms of every
streamed request's time to first token on the 2-core box (bench/BENCHMARKS.md, "The request
path"). The routes are declared with FastAPI like every other (their OpenAPI entries, their
endpoint functions in openai_routes.py); this only takes their requests a shorter way, with the
same dependency (`deps.get_inference_call`), the same error answers (`errors.answer`) and the
same route in the scope (the server span's and the HTTP metric's `http.route`). Other methods on
these paths, and every other path, go on to FastAPI.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway import errors, openai_routes
from services.gateway.deps import InferenceCall, get_inference_call

Endpoint = Callable[[Request, InferenceCall], Awaitable[Response]]
HOT_ENDPOINTS: tuple[Endpoint, ...] = (openai_routes.completions, openai_routes.chat_completions)


class HotRoutes:
    """Pure ASGI, the innermost of the gateway's middlewares (the body limit, the access log and
    the server span wrap it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.routes: dict[str, APIRoute] = {
            route.path: route for route in openai_routes.router.routes
            if isinstance(route, APIRoute) and route.endpoint in HOT_ENDPOINTS
            and "POST" in route.methods}
        assert len(self.routes) == len(HOT_ENDPOINTS), "a hot endpoint lost its POST route"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) \
            if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request, await get_inference_call(request))
        except Exception as exc:  # nothing went out yet: answered as the app's handlers would
            response = errors.answer(request, exc)
        await response(scope, receive, send)

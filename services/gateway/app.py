"""`create_app(settings, telemetry)`: the gateway's FastAPI application.

NATS (and JetStream's request stream) and Redis are opened in the lifespan and handed to the
routes through dependencies (`deps.py`); the routes are split by role (`openai_routes.py`,
`admin_routes.py`), and the completions' requests reach theirs ahead of FastAPI's router
(`hot_routes.py`); every error leaves through `errors.py`. `GET /metrics` is the Prometheus
exposition of the process's metrics; with tracing on, `observe.ServerSpanMiddleware` makes the
HTTP server span (no per-chunk send/receive spans) under which each request's GenAI span sits.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from services.gateway import (admin_routes, drain_routes, embedding_routes, errors,
                              model_ops_routes, openai_routes, token_routes)
from services.gateway import openapi_docs as docs
from services.gateway.access_log import AccessLogMiddleware
from services.gateway.auth import may_read_metrics
from services.gateway.backend import InferenceBackend
from services.gateway.body import BodyLimitMiddleware
from services.gateway.direct import DirectConfig, DirectRoutes
from services.gateway.deps import Context, GatewayContext
from services.gateway.embeddings import EmbeddingBody
from services.gateway.errors import install_error_handlers
from services.gateway.hot_routes import HotRoutes
from services.gateway.observe import ServerSpanMiddleware
from services.gateway.record_cache import follow_changes
from services.gateway.service import GatewayService
from services.gateway.settings import ENV_API_KEYS, GatewaySettings
from services.gateway.tokenization import TokenizerCache
from services.gateway.watchdog import WatchdogConfig
from services.gateway.validation import (ChatBody, CompletionBody, DetokenizeBody,
                                         TokenizeBody)
from shared import telemetry as tm
from shared.bus import connect_nats, ensure_streams
from shared.redis_client import open_redis
from shared.settings import redact_url
from shared.registry import ModelRegistry

log = logging.getLogger("slinfer.gateway")

REDIS_TIMEOUT_S = 5.0

# FastAPI releases with native OpenTelemetry would add their own server span, per-operation spans
# (dependencies, endpoint) and HTTP metrics whenever a global tracer provider is set: off, the
# gateway makes its one server span itself (ServerSpanMiddleware).
_NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def create_app(settings: GatewaySettings, telemetry: tm.Telemetry | None = None) -> FastAPI:
    tel = telemetry or tm.local("gateway")
    metrics = tm.GenAIMetrics(tel.meter("slinfer.gateway"))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.auth_enabled:
            log.warning("auth is OFF: %s is not set; every caller is tenant 'local' and the gateway "
                        "serves %s only", ENV_API_KEYS, settings.host)
        nc = await connect_nats(settings.nats_url, "slinfer-gateway", connect_timeout=5)
        # Bounded waits: a Redis that went away answers 503 in seconds instead of hanging requests.
        redis = open_redis(settings.redis_url, REDIS_TIMEOUT_S)
        metrics_server = None
        backend: InferenceBackend | None = None
        direct: DirectRoutes | None = None
        try:
            await redis.ping()
            js = nc.jetstream()
            await ensure_streams(js, settings.stream_replicas)
            registry = ModelRegistry(redis)
            await registry.mark_intact()  # a fresh Redis: its (empty) registry is the truth
            watchdog = WatchdogConfig(quiet_s=settings.stream_quiet_s,
                                      max_resumes=settings.max_resumes)
            direct = DirectRoutes(nc, redis, DirectConfig(enabled=settings.direct_admit),
                                  tel.meter("slinfer.gateway"))
            await direct.start()
            backend = InferenceBackend(nc, js, redis, watchdog, direct)
            service = GatewayService(settings, registry, backend,
                                     TokenizerCache(), metrics, redis)
            await follow_changes(nc, service.records)
            app.state.ctx = GatewayContext(settings=settings, nc=nc, redis=redis, registry=registry,
                                           service=service)
            if settings.metrics_port is not None:
                metrics_server = await tm.serve_metrics(tel, settings.metrics_host,
                                                        settings.metrics_port)
            log.info("gateway ready: NATS %s, Redis %s", settings.nats_url,
                     redact_url(settings.redis_url))
            yield
        finally:
            if metrics_server is not None:
                metrics_server.close()
            if backend is not None:
                await backend.settle_cancels(timeout_s=5.0)
            if direct is not None:
                await direct.stop()
            await nc.drain()
            await redis.aclose()

    app = FastAPI(title="slinfer gateway", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None, **_NO_NATIVE_TELEMETRY)
    app.state.settings = settings
    app.add_middleware(HotRoutes)  # (the completions' way past FastAPI's router: hot_routes.py)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.access_log:  # (outside the body limit: its 413s are logged too)
        app.add_middleware(AccessLogMiddleware)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(token_routes.router)
    app.include_router(embedding_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(drain_routes.router)
    app.include_router(model_ops_routes.router)

    @app.get("/health", response_model=None, openapi_extra={"security": []},
             responses={200: docs.HEALTH, 503: docs.HEALTH_DOWN})
    async def health(ctx: Context) -> Any:
        nats_ok = ctx.nc.is_connected
        try:
            redis_ok = bool(await ctx.redis.ping())
        except Exception:
            redis_ok = False
        ok = nats_ok and redis_ok
        return JSONResponse({"status": "ok" if ok else "degraded", "nats": nats_ok, "redis": redis_ok,
                             "auth": settings.auth_enabled}, status_code=200 if ok else 503)

    if settings.metrics_port is None:  # else only on the internal port (see lifespan)
        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics(request: Request) -> Response:
            if not may_read_metrics(settings, request):
                raise errors.invalid_api_key()  # its labels name models, private ones too
            return Response(tel.metrics_text(), media_type=tm.PROMETHEUS_CONTENT_TYPE)

    _publish_schema(app)

    if tel.tracing:  # outermost of our middlewares: the body limit's refusals are traced too
        app.add_middleware(ServerSpanMiddleware, tracer=tel.tracer("slinfer.gateway.http"),
                           meter=tel.meter("slinfer.gateway.http"), excluded=("/health", "/metrics"))
    return app


def _publish_schema(app: FastAPI) -> None:
    """/openapi.json with the request bodies the routes parse themselves, and no 422."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = docs.finish_schema(schema, {
                "ChatBody": ChatBody, "CompletionBody": CompletionBody,
                "TokenizeBody": TokenizeBody, "DetokenizeBody": DetokenizeBody,
                "EmbeddingBody": EmbeddingBody,
                "RegisterModel": admin_routes.RegisterModel,
                "AddAlias": admin_routes.AddAlias,
                "UpdateModel": admin_routes.UpdateModel,
                "PreloadModel": model_ops_routes.PreloadModel})
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

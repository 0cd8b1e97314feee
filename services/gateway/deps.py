"""FastAPI dependencies: the per-process context (opened in the lifespan), the caller (its tenant
and whether it is the operator), the raw request body; and for the inference routes all three
in one (`Call`).

Each is `async def` though none awaits: FastAPI runs a plain `def` dependency in a worker thread,
a thread hop per dependency on every request, for work that takes microseconds. `Call` is one
dependency where the three were six: FastAPI's solving of a dependency graph cost more than half
of a completion's way through the framework (~65 of ~130 µs, profiled in process; ~250 µs of
every time to first token on the 2-core box)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from services.gateway.auth import Principal, authenticate
from services.gateway.body import read_optional_body, read_utf8_body
from services.gateway.service import GatewayService
from services.gateway.settings import GatewaySettings
from shared.registry import ModelRegistry


@dataclass(frozen=True)
class GatewayContext:
    settings: GatewaySettings
    nc: NATS
    redis: Redis
    registry: ModelRegistry
    service: GatewayService


async def get_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


async def get_context(request: Request) -> GatewayContext:
    return request.app.state.ctx


async def get_caller(request: Request,
                     settings: Annotated[GatewaySettings, Depends(get_settings)]) -> Principal:
    return authenticate(settings, request)


async def get_tenant(caller: Annotated[Principal, Depends(get_caller)]) -> str:
    return caller.tenant


async def get_service(ctx: Annotated[GatewayContext, Depends(get_context)]) -> GatewayService:
    return ctx.service


async def get_registry(ctx: Annotated[GatewayContext, Depends(get_context)]) -> ModelRegistry:
    return ctx.registry


@dataclass(frozen=True)
class InferenceCall:
    """What an inference route needs of its request: the caller's tenant, the body (UTF-8
    checked), the service."""

    tenant: str
    body: bytes
    service: GatewayService


async def get_inference_call(request: Request) -> InferenceCall:
    """The caller is authenticated before the body is read (a bad key is a 401 at once)."""
    ctx: GatewayContext = request.app.state.ctx
    tenant = authenticate(ctx.settings, request).tenant
    return InferenceCall(tenant, await read_utf8_body(request), ctx.service)


Settings = Annotated[GatewaySettings, Depends(get_settings)]
Context = Annotated[GatewayContext, Depends(get_context)]
Caller = Annotated[Principal, Depends(get_caller)]
Tenant = Annotated[str, Depends(get_tenant)]
Service = Annotated[GatewayService, Depends(get_service)]
Registry = Annotated[ModelRegistry, Depends(get_registry)]
RawBody = Annotated[bytes, Depends(read_utf8_body)]
OptionalBody = Annotated[bytes, Depends(read_optional_body)]  # may be empty
Call = Annotated[InferenceCall, Depends(get_inference_call)]

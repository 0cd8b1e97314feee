"""FastAPI dependencies: the per-process context (opened in the lifespan), the caller (its tenant
and whether it is the operator), the raw request body.

Each is `async def` though none awaits: FastAPI runs a plain `def` dependency in a worker thread,
a thread hop per dependency on every request (five on a completion), for work that takes
microseconds."""

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


Settings = Annotated[GatewaySettings, Depends(get_settings)]
Context = Annotated[GatewayContext, Depends(get_context)]
Caller = Annotated[Principal, Depends(get_caller)]
Tenant = Annotated[str, Depends(get_tenant)]
Service = Annotated[GatewayService, Depends(get_service)]
Registry = Annotated[ModelRegistry, Depends(get_registry)]
RawBody = Annotated[bytes, Depends(read_utf8_body)]
OptionalBody = Annotated[bytes, Depends(read_optional_body)]  # may be empty

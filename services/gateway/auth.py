"""API keys -> tenants. `Authorization: Bearer <key>`; with no keys configured, tenant "local"."""

from __future__ import annotations

import hmac

from fastapi import Request

from services.gateway.errors import invalid_api_key
from services.gateway.settings import GatewaySettings

LOCAL_TENANT = "local"


def tenant_for_key(settings: GatewaySettings, key: str) -> str | None:
    """The tenant of `key`, comparing in constant time against every configured key."""
    found = None
    for candidate, tenant in settings.api_keys.items():
        if hmac.compare_digest(candidate.encode(), key.encode()):
            found = tenant
    return found


def authenticate(settings: GatewaySettings, request: Request) -> str:
    if not settings.auth_enabled:
        return LOCAL_TENANT
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise invalid_api_key()
    tenant = tenant_for_key(settings, key.strip())
    if tenant is None:
        raise invalid_api_key()
    return tenant

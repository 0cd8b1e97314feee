"""API keys -> principals. `Authorization: Bearer <key>`.

A tenant key (`SLINFER_API_KEYS`) acts as its tenant; an operator key (`SLINFER_OPERATOR_KEYS`)
acts as the operator, who may also manage public models, every tenant's models and read metrics.
With no keys configured at all there is no auth: the caller is tenant "local", and the operator,
since nobody else can reach a loopback-only gateway.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from services.gateway.errors import invalid_api_key
from services.gateway.settings import OPERATOR_TENANT, GatewaySettings

LOCAL_TENANT = "local"


@dataclass(frozen=True)
class Principal:
    tenant: str  # whose private models it sees and whose limits its requests count against
    operator: bool = False


def _matches(candidate: str, key: str) -> bool:
    return hmac.compare_digest(candidate.encode(), key.encode())


def tenant_for_key(settings: GatewaySettings, key: str) -> str | None:
    """The tenant of `key`, comparing in constant time against every configured key."""
    found = None
    for candidate, tenant in settings.api_keys.items():
        if _matches(candidate, key):
            found = tenant
    return found


def is_operator_key(settings: GatewaySettings, key: str) -> bool:
    found = False
    for candidate in settings.operator_keys:
        found |= _matches(candidate, key)
    return found


def bearer_key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def authenticate(settings: GatewaySettings, request: Request) -> Principal:
    if not settings.auth_enabled:
        return Principal(LOCAL_TENANT, operator=True)
    key = bearer_key(request)
    if key is None:
        raise invalid_api_key()
    if is_operator_key(settings, key):
        return Principal(OPERATOR_TENANT, operator=True)
    tenant = tenant_for_key(settings, key)
    if tenant is None:
        raise invalid_api_key()
    return Principal(tenant)


def may_read_metrics(settings: GatewaySettings, request: Request) -> bool:
    """/metrics on the public port: open without auth; else the metrics key or an operator key
    (its labels carry model names, private ones included)."""
    if not settings.auth_enabled and settings.metrics_key is None:
        return True
    key = bearer_key(request)
    if key is None:
        return False
    if settings.metrics_key is not None and _matches(settings.metrics_key, key):
        return True
    return is_operator_key(settings, key)

"""Ways the gateway tests talk to the gateway: an httpx client with a tenant's key, and the
server-sent events of a streamed answer."""

from __future__ import annotations

import json

import httpx


def api_client(gateway, key: str = "key-a") -> httpx.AsyncClient:
    """An async client on the test gateway, authorised as `key`'s tenant (no proxy from env)."""
    return httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"},
                             trust_env=False, timeout=20)


def sse_events(text: str) -> list[dict]:
    """The JSON events of a streamed body, checking it ends with `[DONE]`."""
    lines = [ln.removeprefix("data: ") for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]

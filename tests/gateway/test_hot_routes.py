"""The completions' way past FastAPI's router (services/gateway/hot_routes.py) answers as the
app does: its dependency's 401, an APIError as itself, an unexpected failure as a JSON 500, Redis
down as 503; other methods on its paths go on to FastAPI (405). The app in process, on a stand-in
service (no servers: pure request handling); the real routes' behaviour is every other test of
tests/gateway."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from services.gateway import errors
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


class _Service:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def prepare(self, *args, **kwargs):
        raise self.exc


class _Ctx:
    def __init__(self, exc: Exception) -> None:
        self.settings = GatewaySettings(api_keys={"key-a": "tenant-a"})
        self.service = _Service(exc)


def _call(exc: Exception, method: str = "POST", path: str = "/v1/completions",
          key: str = "key-a", body: dict | None = None) -> httpx.Response:
    ctx = _Ctx(exc)
    app = create_app(ctx.settings)
    app.state.ctx = ctx

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            return await client.request(method, path, json=body or BODY if method == "POST" else None,
                                        headers={"Authorization": f"Bearer {key}"})
    return asyncio.run(go())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_api_error_is_answered_as_itself(path):
    body = {**BODY, "messages": [{"role": "user", "content": "hi"}]} if "chat" in path else BODY
    resp = _call(errors.model_not_found("m"), path=path, body=body)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_a_bad_key_is_401_before_the_body_is_read():
    resp = _call(RuntimeError("unused"), key="wrong")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_an_unexpected_failure_is_a_json_500():
    resp = _call(RuntimeError("boom"))
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error"
    assert "boom" not in resp.text


def test_redis_down_is_503():
    resp = _call(RedisConnectionError("gone"))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "registry_unavailable"


def test_other_methods_go_on_to_fastapi():
    resp = _call(RuntimeError("unused"), method="GET")
    assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"

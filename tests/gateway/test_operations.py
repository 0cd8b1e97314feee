"""Operations: who reads /metrics (a key, or an internal port), 503 (not 500) while Redis is
down, the access log, and an /openapi.json that declares the real request bodies and error
answers."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from shared.servers import free_port, start_redis
from tests.gateway.conftest import OPERATOR_KEY, PUBLIC_MODEL, start_gateway

pytestmark = pytest.mark.integration


def _get(url: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url, headers=headers, trust_env=False, timeout=10)


def test_metrics_need_an_operator_or_metrics_key_with_auth_on(make_settings, seeded_models):
    gw = start_gateway(make_settings(metrics_key="scrape-me"))
    try:
        for key in (None, "key-a", "wrong"):
            resp = _get(gw.url + "/metrics", key)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        for key in ("scrape-me", OPERATOR_KEY):
            resp = _get(gw.url + "/metrics", key)
            assert resp.status_code == 200 and b"process_cpu_seconds_total" in resp.content
    finally:
        gw.stop()


def test_metrics_on_an_internal_port_only(make_settings, seeded_models):
    port = free_port()
    gw = start_gateway(make_settings(metrics_port=port))
    try:
        assert _get(gw.url + "/metrics", OPERATOR_KEY).status_code == 404  # not on the API port
        resp = _get(f"http://127.0.0.1:{port}/metrics")
        assert resp.status_code == 200 and b"process_cpu_seconds_total" in resp.content
    finally:
        gw.stop()
    with pytest.raises(httpx.ConnectError):  # and it went away with the gateway
        _get(f"http://127.0.0.1:{port}/metrics")


def test_metrics_are_open_without_auth(local_gateway):
    assert _get(local_gateway.url + "/metrics").status_code == 200


def test_each_request_has_an_access_line_once_its_response_ended(make_settings, seeded_models,
                                                                   caplog):
    gw = start_gateway(make_settings(access_log=True))
    caplog.set_level(logging.INFO, logger="slinfer.gateway.access")
    try:
        assert _get(gw.url + "/v1/models/no-such-model?x=1", "key-a").status_code == 404
        with httpx.stream("POST", gw.url + "/v1/completions", trust_env=False, timeout=10,
                          json={"model": PUBLIC_MODEL, "prompt": "x"}) as resp:  # no key: 401
            assert resp.status_code == 401
        deadline = time.monotonic() + 5  # written by the gateway's thread, after the response
        while len([r for r in caplog.records if r.name == "slinfer.gateway.access"]) < 2 \
                and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        gw.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "slinfer.gateway.access"]
    assert len(lines) == 2, lines
    assert '"GET /v1/models/no-such-model?x=1 HTTP/1.1" 404' in lines[0]
    assert '"POST /v1/completions HTTP/1.1" 401' in lines[1] and lines[1].endswith(" ms")


def test_redis_down_is_503_not_500(make_settings, seeded_models, tmp_path):
    redis = start_redis(tmp_path / "redis")
    gw = start_gateway(make_settings(redis_url=redis.url))
    try:
        assert _get(gw.url + "/v1/models", "key-a").status_code == 200
        redis.stop()
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/admin/models", None),
                                   ("POST", "/v1/completions",
                                    {"model": PUBLIC_MODEL, "prompt": "x"})):
            resp = httpx.request(method, gw.url + path, json=body, trust_env=False, timeout=30,
                                 headers={"Authorization": "Bearer key-a"})
            assert resp.status_code == 503, (path, resp.text)
            assert resp.json()["error"]["code"] == "registry_unavailable"
            assert resp.headers["Retry-After"] == "1"
        health = _get(gw.url + "/health")
        assert health.status_code == 503 and health.json()["redis"] is False
    finally:
        gw.stop()
        redis.stop()


def test_openapi_declares_bodies_errors_and_no_422(gateway):
    schema = _get(gateway.url + "/openapi.json").json()
    schemas = schema["components"]["schemas"]
    for path, component, extra in (("/v1/completions", "CompletionBody", True),
                                   ("/v1/chat/completions", "ChatBody", True),
                                   ("/admin/models", "RegisterModel", False)):
        op = schema["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{component}" and op["requestBody"]["required"]
        # Unknown keys: ignored (and named) by the OpenAI routes, refused by the admin API.
        assert schemas[component]["additionalProperties"] is extra
    chat = schemas["ChatBody"]["properties"]
    for name in ("ignore_eos", "min_tokens", "top_k", "repetition_penalty", "stream_options"):
        assert name in chat
    assert set(schemas["StreamOptions"]["properties"]) == {"include_usage", "continuous_usage_stats"}
    statuses = set(schema["paths"]["/v1/chat/completions"]["post"]["responses"])
    assert {"200", "400", "401", "404", "413", "429", "503", "504"} <= statuses
    assert "403" in schema["paths"]["/admin/models"]["post"]["responses"]
    for path, path_item in schema["paths"].items():
        for op in path_item.values():
            assert "422" not in op["responses"]
            for status, answer in op["responses"].items():
                if status.startswith(("4", "5")) and path != "/health":  # its 503 is its report
                    content = answer["content"]["application/json"]["schema"]["$ref"]
                    assert content.endswith("/ErrorResponse")
    assert "HTTPValidationError" not in schemas
    assert schema["paths"]["/health"]["get"]["security"] == []
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"

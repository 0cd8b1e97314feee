"""API keys, tenants and the no-auth local mode."""

from __future__ import annotations

import logging

import httpx
import pytest

from services.gateway.__main__ import main
from services.gateway.settings import GatewaySettings
from tests.gateway.conftest import PRIVATE_A, PUBLIC_MODEL, SHORT_MODEL, start_gateway

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-a"},
                                     {"Authorization": "Basic key-a"}, {"Authorization": "Bearer key-a-extra"}])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                              ("POST", "/admin/models"), ("GET", "/admin/nodes")])
def test_missing_or_unknown_key_is_401(gateway, headers, method, path):
    with httpx.Client(base_url=gateway.url, trust_env=False) as c:
        resp = c.request(method, path, headers=headers, content=b"{not json")
    assert resp.status_code == 401
    err = resp.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"


def test_health_needs_no_key(gateway):
    resp = httpx.get(gateway.url + "/health", trust_env=False)
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "nats": True, "redis": True, "auth": True}


def test_models_list_shape_and_tenant_view(client_a, client_b):
    a = client_a.get("/v1/models").json()
    assert a["object"] == "list"
    assert {m["id"] for m in a["data"]} >= {PUBLIC_MODEL, SHORT_MODEL, PRIVATE_A}
    for m in a["data"]:
        assert m["object"] == "model" and isinstance(m["created"], int) and m["owned_by"]
    b = client_b.get("/v1/models").json()
    assert PRIVATE_A not in {m["id"] for m in b["data"]}
    assert PUBLIC_MODEL in {m["id"] for m in b["data"]}
    assert client_a.get(f"/v1/models/{PRIVATE_A}").json()["owned_by"] == "tenant-a"


def test_another_tenants_private_model_is_404_not_403(client_b):
    unknown = client_b.post("/v1/chat/completions", json={
        "model": "never-registered", "messages": [{"role": "user", "content": "x"}]})
    hidden = client_b.post("/v1/chat/completions", json={
        "model": PRIVATE_A, "messages": [{"role": "user", "content": "x"}]})
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.json()["error"]["code"] == "model_not_found"
    # Same message shape as for a model that does not exist: nothing leaks.
    assert hidden.json()["error"]["message"].replace(PRIVATE_A, "X") == \
        unknown.json()["error"]["message"].replace("never-registered", "X")
    assert client_b.post("/v1/completions", json={"model": PRIVATE_A, "prompt": "x"}).status_code == 404
    assert client_b.get(f"/v1/models/{PRIVATE_A}").status_code == 404
    assert client_b.delete(f"/admin/models/{PRIVATE_A}").status_code == 404
    assert PRIVATE_A not in {m["name"] for m in client_b.get("/admin/models").json()["data"]}


async def test_owner_can_use_its_private_model(gateway, responder):
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": "Bearer key-a"},
                                 trust_env=False, timeout=20) as c:
        resp = await c.post("/v1/completions", json={"model": PRIVATE_A, "prompt": "x", "max_tokens": 20})
    assert resp.status_code == 200, resp.text
    assert responder.requests[0].tenant == "tenant-a"


def test_no_keys_means_no_auth_and_tenant_local(local_gateway, caplog):
    with httpx.Client(base_url=local_gateway.url, trust_env=False) as c:
        models = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert PUBLIC_MODEL in models and PRIVATE_A not in models  # "local" is just another tenant
        assert c.get("/health").json()["auth"] is False
        # Any Authorization header is ignored, not rejected.
        assert c.get("/v1/models", headers={"Authorization": "Bearer whatever"}).status_code == 200


def test_auth_off_is_logged(make_settings, seeded_models, caplog):
    caplog.set_level(logging.WARNING, logger="slinfer.gateway")
    gw = start_gateway(make_settings(api_keys={}, operator_keys=frozenset()))
    gw.stop()
    assert any("auth is OFF" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_no_keys_refuses_non_loopback_host(host):
    with pytest.raises(ValueError, match="SLINFER_API_KEYS"):
        GatewaySettings(host=host)
    assert GatewaySettings(host=host, api_keys={"k": "t"}).host == host


def test_main_refuses_public_bind_without_keys(monkeypatch, capsys):
    monkeypatch.delenv("SLINFER_API_KEYS", raising=False)
    monkeypatch.setenv("SLINFER_GATEWAY_HOST", "0.0.0.0")
    assert main([]) == 2
    assert "SLINFER_API_KEYS" in capsys.readouterr().err


def test_main_reports_bad_settings(monkeypatch, capsys):
    monkeypatch.setenv("SLINFER_GATEWAY_PORT", "eighty")
    assert main([]) == 2
    assert "SLINFER_GATEWAY_PORT" in capsys.readouterr().err

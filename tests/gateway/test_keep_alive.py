"""Keep-alive and pinning through the gateway: a request's `keep_alive` (Ollama's forms) parsed
and forwarded on the InferenceRequest, bad values refused by name; a model's keep-alive and
min_instances set at registration and by PATCH, with who may change what; an unload refused for
a pinned model."""

from __future__ import annotations

import json

import pytest

from tests.gateway.clients import api_client
from tests.gateway.conftest import OPERATOR_KEY, PUBLIC_MODEL

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hi"}]


async def test_keep_alive_is_forwarded_in_seconds(gateway, responder):
    async with api_client(gateway) as c:
        for keep_alive in ("5m", 0, -1, "1h30m", 2.5):
            resp = await c.post("/v1/chat/completions", json={
                "model": PUBLIC_MODEL, "messages": MSG, "max_tokens": 2, "keep_alive": keep_alive})
            assert resp.status_code == 200, resp.text
        resp = await c.post("/v1/completions", json={"model": PUBLIC_MODEL, "prompt": "x",
                                                     "max_tokens": 2, "keep_alive": "30s"})
        assert resp.status_code == 200, resp.text
        resp = await c.post("/v1/completions", json={"model": PUBLIC_MODEL, "prompt": "x",
                                                     "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    assert [r.keep_alive_s for r in responder.requests] == [300.0, 0.0, -1.0, 5400.0, 2.5, 30.0,
                                                            None]


@pytest.mark.parametrize("bad", ["5x", "", "m", "five minutes", True, [5], {"s": 1}, 1e400])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_bad_keep_alive_is_400(gateway, path, bad):
    body = {"model": PUBLIC_MODEL, "keep_alive": bad}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": MSG})
    async with api_client(gateway) as c:
        resp = await c.post(path, content=_json(body), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "keep_alive"


def _json(body: dict) -> str:
    """JSON text; 1e400 is a JSON number that no float holds (Python writes it Infinity)."""
    return json.dumps(body).replace("Infinity", "1e400")


def test_register_and_patch_serving_settings(client_a, client_b, tenant_models):
    body = {"name": "ka/one", "path": str(tenant_models / "tenant-a" / "tiny"),
            "keep_alive": "5m", "min_instances": 2}
    resp = client_a.post("/admin/models", json=body)
    assert resp.status_code == 201, resp.text
    assert (resp.json()["keep_alive_s"], resp.json()["min_instances"]) == (300.0, 2)
    resp = client_a.patch("/admin/models/ka/one", json={"keep_alive": -1})
    assert resp.status_code == 200, resp.text
    assert (resp.json()["keep_alive_s"], resp.json()["min_instances"]) == (-1.0, 2)  # kept
    resp = client_a.patch("/admin/models/ka/one", json={"min_instances": 0})
    assert (resp.json()["keep_alive_s"], resp.json()["min_instances"]) == (-1.0, 0)
    resp = client_a.patch("/admin/models/ka/one", json={"keep_alive": None})  # the default
    assert resp.json()["keep_alive_s"] is None
    resp = client_a.patch("/admin/models/ka/one", json={"slo_class": "batch"})
    assert resp.status_code == 200 and resp.json()["slo_class"] == "batch", resp.text
    got = client_a.get("/admin/models/ka/one").json()
    assert (got["keep_alive_s"], got["min_instances"]) == (None, 0)
    assert client_b.patch("/admin/models/ka/one", json={"min_instances": 1}).status_code == 404
    assert client_a.delete("/admin/models/ka/one").status_code == 200


def test_a_tenant_cannot_change_a_public_model(client_a):
    resp = client_a.patch(f"/admin/models/{PUBLIC_MODEL}", json={"min_instances": 1})
    assert resp.status_code == 403, resp.text
    assert client_a.post(f"/admin/models/{PUBLIC_MODEL}/unload").status_code == 403


@pytest.mark.parametrize(("body", "param"), [
    ({"keep_alive": "soon"}, "keep_alive"), ({"min_instances": -1}, "min_instances"),
    ({"min_instances": 1.5}, "min_instances"), ({"keep_alive": True}, "keep_alive"),
    ({"pinned": True}, "pinned"), ({"slo_class": "fastest"}, "slo_class"),
])
def test_bad_serving_settings_are_400(client_a, tenant_models, body, param):
    path = str(tenant_models / "tenant-a" / "tiny")
    resp = client_a.post("/admin/models", json={"name": "ka/bad", "path": path, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    resp = client_a.patch("/admin/models/a-private", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


async def test_preload_is_a_warm_up_request(gateway, responder):
    async with api_client(gateway, key=OPERATOR_KEY) as c:
        resp = await c.post(f"/admin/models/{PUBLIC_MODEL}/preload", json={"keep_alive": "10m"})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"object": "model.preload", "model": PUBLIC_MODEL,
                               "instances": []}  # no node here: the responder answered
        resp = await c.post(f"/admin/models/{PUBLIC_MODEL}/preload")  # no body: the model's
        assert resp.status_code == 200, resp.text
        resp = await c.post(f"/admin/models/{PUBLIC_MODEL}/preload", json={"keep_alive": "x"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "keep_alive"
    first, second = responder.requests
    assert (first.model, first.max_tokens, len(first.prompt_token_ids), first.keep_alive_s) == \
        (PUBLIC_MODEL, 1, 1, 600.0)
    assert second.keep_alive_s is None


def test_unloading_a_pinned_model_is_refused(client_op):
    assert client_op.patch(f"/admin/models/{PUBLIC_MODEL}", json={"min_instances": 1}).status_code == 200
    try:
        resp = client_op.post(f"/admin/models/{PUBLIC_MODEL}/unload")
        assert resp.status_code == 409, resp.text
        assert resp.json()["error"]["code"] == "model_pinned"
    finally:
        client_op.patch(f"/admin/models/{PUBLIC_MODEL}", json={"min_instances": 0})
    resp = client_op.post(f"/admin/models/{PUBLIC_MODEL}/unload")
    assert resp.status_code == 200, resp.text  # no node holds it here: nothing to unload
    assert resp.json() == {"object": "model.unload", "model": PUBLIC_MODEL, "nodes": [],
                           "instances": []}

"""Model aliases through the admin API: a request for an alias is served by its model (the placer
sees the model's id), `/v1/models` lists aliases with the model they name (`root`), an alias is
seen by whoever sees its model and by no one else, and one name keeps one meaning per tenant."""

from __future__ import annotations

import pytest

from shared.registry import model_id
from tests.gateway.clients import api_client
from tests.gateway.conftest import OPERATOR_KEY, PRIVATE_A, PUBLIC_MODEL, SHORT_MODEL

pytestmark = pytest.mark.integration


def _ids(listing: dict) -> dict[str, dict]:
    return {m["id"]: m for m in listing["data"]}


async def test_public_alias_serves_its_model_for_every_tenant(gateway, responder):
    async with api_client(gateway, OPERATOR_KEY) as op, api_client(gateway, "key-a") as a, \
            api_client(gateway, "key-b") as b:
        resp = await op.post(f"/admin/models/{PUBLIC_MODEL}/aliases", json={"alias": "org/gpt-x"})
        assert resp.status_code == 201, resp.text
        assert resp.json() == {"id": "org/gpt-x", "object": "model.alias", "model": PUBLIC_MODEL,
                               "owned_by": "public"}
        try:
            for client in (a, b):
                card = _ids((await client.get("/v1/models")).json())["org/gpt-x"]
                assert card["root"] == PUBLIC_MODEL and card["owned_by"] == "public"
                assert (await client.get("/v1/models/org/gpt-x")).json()["root"] == PUBLIC_MODEL
                resp = await client.post("/v1/completions", json={
                    "model": "org/gpt-x", "prompt": "x", "max_tokens": 4})
                assert resp.status_code == 200, resp.text
                assert resp.json()["model"] == "org/gpt-x"  # the name asked for, as OpenAI echoes
            assert [r.model for r in responder.requests] == [PUBLIC_MODEL, PUBLIC_MODEL]
            assert _ids((await a.get("/v1/models")).json())[PUBLIC_MODEL]["root"] == PUBLIC_MODEL
            view = (await a.get(f"/admin/models/{PUBLIC_MODEL}")).json()
            assert view["aliases"] == ["org/gpt-x"]
            # Public: only the operator names and unnames it.
            resp = await a.post(f"/admin/models/{PUBLIC_MODEL}/aliases", json={"alias": "mine"})
            assert resp.status_code == 403, resp.text
            assert (await a.delete("/admin/aliases/org/gpt-x")).status_code == 403
        finally:
            assert (await op.delete("/admin/aliases/org/gpt-x")).status_code == 200
        assert (await a.get("/v1/models/org/gpt-x")).status_code == 404
        resp = await a.post("/v1/completions", json={"model": "org/gpt-x", "prompt": "x"})
        assert resp.status_code == 404
        assert (await a.get(f"/admin/models/{PUBLIC_MODEL}")).json()["aliases"] == []


async def test_private_alias_is_its_owners_alone(gateway, responder):
    async with api_client(gateway, "key-a") as a, api_client(gateway, "key-b") as b, \
            api_client(gateway, OPERATOR_KEY) as op:
        resp = await a.post(f"/admin/models/{PRIVATE_A}/aliases", json={"alias": "fast"})
        assert resp.status_code == 201, resp.text
        assert resp.json()["id"] == "fast" and resp.json()["owned_by"] == "tenant-a"
        try:
            resp = await a.post("/v1/chat/completions", json={
                "model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert resp.status_code == 200, resp.text
            assert [r.model for r in responder.requests] == [model_id(PRIVATE_A, "tenant-a")]
            assert _ids((await a.get("/v1/models")).json())["fast"]["root"] == PRIVATE_A
            assert [x["id"] for x in (await a.get("/admin/aliases")).json()["data"]] == ["fast"]

            # Tenant-b: no such name, in every view, and nothing to remove.
            assert "fast" not in _ids((await b.get("/v1/models")).json())
            assert (await b.get("/v1/models/fast")).status_code == 404
            assert (await b.get("/v1/models/" + model_id("fast", "tenant-a"))).status_code == 404
            resp = await b.post("/v1/completions", json={"model": "fast", "prompt": "x"})
            assert resp.status_code == 404
            assert (await b.get("/admin/aliases")).json()["data"] == []
            assert (await b.delete("/admin/aliases/fast")).status_code == 404
            # The operator sees it by its id.
            listed = (await op.get("/admin/aliases")).json()["data"]
            assert {"id": model_id("fast", "tenant-a"), "object": "model.alias",
                    "model": model_id(PRIVATE_A, "tenant-a"), "owned_by": "tenant-a"} in listed
        finally:
            assert (await a.delete("/admin/aliases/fast")).status_code == 200
        assert (await a.get("/v1/models/fast")).status_code == 404


async def test_one_name_one_meaning(gateway, tenant_models):
    async with api_client(gateway, "key-a") as a, api_client(gateway, OPERATOR_KEY) as op:
        def alias(client, model, name):
            return client.post(f"/admin/models/{model}/aliases", json={"alias": name})

        # An alias may not take a model's name, in the public space or the tenant's own.
        assert (await alias(op, PUBLIC_MODEL, SHORT_MODEL)).status_code == 409
        assert (await alias(a, PRIVATE_A, PUBLIC_MODEL)).status_code == 409
        assert (await alias(a, PRIVATE_A, PRIVATE_A)).status_code == 409
        resp = await alias(a, PRIVATE_A, "bad~name")
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "alias"
        assert (await alias(a, "no-such-model", "x")).status_code == 404

        assert (await alias(op, PUBLIC_MODEL, "shared-name")).status_code == 201
        assert (await alias(a, PRIVATE_A, "own-name")).status_code == 201
        try:
            # A private alias may not shadow a public one, nor the operator publish a tenant's.
            resp = await alias(a, PRIVATE_A, "shared-name")
            assert resp.status_code == 409 and resp.json()["error"]["code"] == "model_exists"
            assert (await alias(op, PUBLIC_MODEL, "own-name")).status_code == 409
            assert (await alias(op, SHORT_MODEL, "shared-name")).status_code == 409  # taken
            # A model may not take an alias's name.
            path = str(tenant_models / "tenant-a" / "tiny")
            for name in ("shared-name", "own-name"):
                resp = await a.post("/admin/models", json={"name": name, "path": path})
                assert resp.status_code == 409, resp.text
        finally:
            assert (await op.delete("/admin/aliases/shared-name")).status_code == 200
            assert (await a.delete("/admin/aliases/own-name")).status_code == 200


async def test_deleting_a_model_deletes_its_aliases(gateway, tenant_models):
    async with api_client(gateway, "key-a") as a:
        path = str(tenant_models / "tenant-a" / "tiny")
        assert (await a.post("/admin/models", json={"name": "short-lived", "path": path})
                ).status_code == 201
        assert (await a.post("/admin/models/short-lived/aliases", json={"alias": "sl"})
                ).status_code == 201
        assert (await a.get("/admin/models/short-lived")).json()["aliases"] == ["sl"]
        # Replacing the model keeps its aliases (they name the model, not a checkpoint).
        resp = await a.post("/admin/models", json={"name": "short-lived", "path": path,
                                                   "replace": True})
        assert resp.status_code == 201 and resp.json()["aliases"] == ["sl"]
        assert (await a.delete("/admin/models/short-lived")).status_code == 200
        assert (await a.get("/v1/models/sl")).status_code == 404
        assert (await a.get("/admin/aliases")).json()["data"] == []
        # The name is free again, for a model too.
        assert (await a.post("/admin/models", json={"name": "sl", "path": path})).status_code == 201
        assert (await a.delete("/admin/models/sl")).status_code == 200

"""Admin API: model registration round trip, who may register and delete what, private name
spaces, model paths confined to their roots, adapters, and the cluster view each caller reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from redis import Redis as SyncRedis

from shared import wire
from shared.core.types import (SLO, Hardware, InstanceView, ModelSpec, NodeView, PipelineMode,
                               RequestView, StorageView)
from shared.registry import model_id
from shared.subjects import NODES_SET, node_key
from tests.gateway.clients import api_client
from tests.gateway.conftest import PRIVATE_A, PUBLIC_MODEL, copy_model, start_gateway

pytestmark = pytest.mark.integration


def _names(client: httpx.Client, path: str = "/v1/models") -> set[str]:
    key = "id" if path == "/v1/models" else "name"
    return {m[key] for m in client.get(path).json()["data"]}


def test_register_list_use_delete_round_trip(client_a, client_b, tenant_models):
    body = {"name": "org/round-trip", "path": str(tenant_models / "tenant-a" / "tiny"),
            "engine": "torch", "slo_class": "interactive"}
    resp = client_a.post("/admin/models", json=body)
    assert resp.status_code == 201, resp.text
    rec = resp.json()
    assert rec["name"] == "org/round-trip" and rec["owner"] == "tenant-a" and rec["slo_class"] == "interactive"
    assert rec["max_context"] == 2048 and rec["kv_bytes_per_token"] > 0 and rec["weight_bytes"] > 0
    assert rec["eos_token_ids"] and "path" not in rec  # no server paths for tenants

    assert "org/round-trip" in _names(client_a) and "org/round-trip" in _names(client_a, "/admin/models")
    assert "org/round-trip" not in _names(client_b) | _names(client_b, "/admin/models")

    # Its own duplicate -> 409; replace=true overwrites its own.
    assert client_a.post("/admin/models", json=body).json()["error"]["code"] == "model_exists"
    resp = client_a.post("/admin/models", json={**body, "slo_class": "relaxed", "replace": True})
    assert resp.status_code == 201 and resp.json()["slo_class"] == "relaxed"

    assert client_b.delete("/admin/models/" + quote("org/round-trip", safe="")).status_code == 404
    resp = client_a.delete("/admin/models/org/round-trip")
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    assert client_a.delete("/admin/models/org/round-trip").status_code == 404
    assert client_a.post("/v1/completions", json={"model": "org/round-trip", "prompt": "x"}).status_code == 404


async def test_two_tenants_each_own_a_private_model_of_one_name(gateway, responder, tenant_models):
    """The name another tenant holds privately is free (no 409 that would leak it), and each
    tenant's requests go to its own model: the placer sees two ids."""
    async with api_client(gateway, "key-a") as a, api_client(gateway, "key-b") as b:
        for client, tenant in ((a, "tenant-a"), (b, "tenant-b")):
            resp = await client.post("/admin/models", json={
                "name": "same-name", "path": str(tenant_models / tenant / "tiny")})
            assert resp.status_code == 201, resp.text
        resp = await b.post("/admin/models", json={"name": PRIVATE_A,
                                                   "path": str(tenant_models / "tenant-b" / "tiny")})
        assert resp.status_code == 201, resp.text  # tenant-a's private name: free for tenant-b
        try:
            for client in (a, b):
                resp = await client.post("/v1/completions", json={"model": "same-name", "prompt": "x",
                                                                   "max_tokens": 20})
                assert resp.status_code == 200, resp.text
                assert resp.json()["model"] == "same-name"
            assert [r.model for r in responder.requests] == [model_id("same-name", "tenant-a"),
                                                             model_id("same-name", "tenant-b")]
            assert [r.tenant for r in responder.requests] == ["tenant-a", "tenant-b"]
            assert (await b.get(f"/v1/models/{PRIVATE_A}")).json()["owned_by"] == "tenant-b"
            assert (await a.get(f"/v1/models/{PRIVATE_A}")).json()["owned_by"] == "tenant-a"
        finally:
            for client, name in ((a, "same-name"), (b, "same-name"), (b, PRIVATE_A)):
                assert (await client.delete(f"/admin/models/{name}")).status_code == 200
        assert (await a.get(f"/v1/models/{PRIVATE_A}")).status_code == 200  # a's untouched


def test_a_tenant_cannot_replace_or_delete_a_public_model(client_a, client_b, tenant_models):
    path = str(tenant_models / "tenant-a" / "tiny")
    # The former bug: replace=true overwrote the public record with a private one (404 for b).
    resp = client_a.post("/admin/models", json={"name": PUBLIC_MODEL, "path": path, "replace": True})
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "model_exists"
    resp = client_a.post("/admin/models", json={"name": PUBLIC_MODEL, "path": path, "public": True,
                                                "replace": True})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "permission_denied"
    resp = client_a.delete(f"/admin/models/{PUBLIC_MODEL}")
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "permission_error"
    got = client_b.get(f"/v1/models/{PUBLIC_MODEL}")
    assert got.status_code == 200 and got.json()["owned_by"] == "public"


def test_operator_publishes_and_deletes_public_models(client_op, client_a, client_b, model_dir):
    resp = client_a.post("/admin/models", json={"name": "pub-x", "path": str(model_dir), "public": True})
    assert resp.status_code == 403  # tenants cannot publish
    resp = client_op.post("/admin/models", json={"name": "pub-x", "path": str(model_dir), "public": True})
    assert resp.status_code == 201 and resp.json()["owner"] is None
    assert resp.json()["path"] == str(model_dir.resolve())  # the operator sees paths
    assert "pub-x" in _names(client_b)
    assert client_b.delete("/admin/models/pub-x").status_code == 403
    assert client_op.delete("/admin/models/pub-x").status_code == 200
    assert "pub-x" not in _names(client_b)


def test_operator_sees_every_model_and_deletes_a_tenants(client_op, client_a, tenant_models):
    path = str(tenant_models / "tenant-a" / "tiny")
    assert client_a.post("/admin/models", json={"name": "a-temp", "path": path}).status_code == 201
    records = {r["name"]: r for r in client_op.get("/admin/models").json()["data"]}
    rid = model_id("a-temp", "tenant-a")
    assert records[rid]["owner"] == "tenant-a" and records[rid]["path"] == path
    assert model_id(PRIVATE_A, "tenant-a") in records and PUBLIC_MODEL in records
    assert client_op.delete("/admin/models/" + quote(rid, safe="")).status_code == 200
    assert "a-temp" not in _names(client_a)


def test_operator_cannot_publish_a_name_held_privately(client_op, model_dir):
    resp = client_op.post("/admin/models", json={"name": PRIVATE_A, "path": str(model_dir),
                                                 "public": True})
    assert resp.status_code == 409 and "tenant-a" in resp.json()["error"]["message"]


@pytest.mark.parametrize("where", ["other_tenant", "operator_root", "missing_outside", "dot_dot"])
def test_paths_outside_the_tenants_directory_are_refused(client_a, tenant_models, model_dir, where):
    path = {"other_tenant": tenant_models / "tenant-b" / "tiny",
            "operator_root": model_dir,
            "missing_outside": Path("/nonexistent/secret/model"),
            "dot_dot": tenant_models / "tenant-a" / ".." / "tenant-b" / "tiny"}[where]
    resp = client_a.post("/admin/models", json={"name": "escape", "path": str(path)})
    assert resp.status_code == 403, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == ("path", "path_not_allowed")
    assert "does not exist" not in err["message"]  # nothing told about what is outside


def test_symlinks_out_of_the_root_are_refused(client_a, tenant_models, model_dir):
    root = tenant_models / "tenant-a"
    link = root / "linked-model"
    if not link.exists():
        link.symlink_to(model_dir, target_is_directory=True)
    inner = copy_model(model_dir, root / "inner-link")
    (inner / "config.json").unlink()
    (inner / "config.json").symlink_to(model_dir / "config.json")
    for path in (link, inner):
        resp = client_a.post("/admin/models", json={"name": "escape", "path": str(path)})
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "path_not_allowed", resp.text
    # A symlink that stays inside the tenant's directory is fine.
    inside = root / "inside-link"
    if not inside.exists():
        inside.symlink_to(root / "tiny", target_is_directory=True)
    resp = client_a.post("/admin/models", json={"name": "via-link", "path": str(inside)})
    assert resp.status_code == 201, resp.text
    assert client_a.delete("/admin/models/via-link").status_code == 200


def test_operator_roots_confine_the_operator_too(client_op, tenant_models):
    resp = client_op.post("/admin/models", json={"name": "op-x", "public": True,
                                                 "path": str(tenant_models / "tenant-a" / "tiny")})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "path_not_allowed"


def test_tenants_cannot_register_without_a_tenant_directory(make_settings, seeded_models, model_dir):
    gw = start_gateway(make_settings(tenant_models_dir=None))
    try:
        resp = httpx.post(gw.url + "/admin/models", json={"name": "x", "path": str(model_dir)},
                          headers={"Authorization": "Bearer key-a"}, trust_env=False)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "permission_denied"
    finally:
        gw.stop()


@pytest.mark.parametrize(("patch", "status", "param", "code"), [
    ({"path": "relative/missing"}, 403, "path", "path_not_allowed"),
    ({"path": "MISSING_IN_ROOT"}, 400, "path", "invalid_model_dir"),
    ({"path": "bad\u0000path"}, 400, "path", "invalid_value"),
    ({"engine": "tensorrt"}, 400, "engine", "invalid_value"),
    ({"slo_class": "platinum"}, 400, "slo_class", "invalid_value"),
    ({"name": ""}, 400, "name", "invalid_value"),
    ({"name": "../etc"}, 400, "name", "invalid_value"),
    ({"name": "tenant-a~x"}, 400, "name", "invalid_value"),  # "~" is the id separator
    ({"public": "yes"}, 400, "public", "invalid_value"),
    ({"base_model": PRIVATE_A}, 404, "base_model", "model_not_found"),  # tenant-b cannot see it
    ({"colour": "red"}, 400, "colour", "unknown_parameter"),
])
def test_register_rejects_bad_input(client_b, tenant_models, patch, status, param, code):
    root = tenant_models / "tenant-b"
    patch = {k: str(root / "missing") if v == "MISSING_IN_ROOT" else v for k, v in patch.items()}
    body = {"name": "bad-one", "path": str(root / "tiny"), **patch}
    resp = client_b.post("/admin/models", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, code)


def test_register_path_without_config_json(client_a, tenant_models):
    empty = tenant_models / "tenant-a" / "empty"
    empty.mkdir(exist_ok=True)
    resp = client_a.post("/admin/models", json={"name": "empty-dir", "path": str(empty)})
    assert resp.status_code == 400 and "config.json" in resp.json()["error"]["message"]


def test_lora_adapter_inherits_from_base(client_a, tenant_models):
    adapter = tenant_models / "tenant-a" / "lora"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    resp = client_a.post("/admin/models", json={"name": "a-lora", "path": str(adapter),
                                                "base_model": PRIVATE_A})
    assert resp.status_code == 201, resp.text
    rec = resp.json()
    assert rec["base_model"] == PRIVATE_A and rec["max_context"] == 2048 and rec["kv_bytes_per_token"] > 0
    assert {"id": "a-lora", "parent": PRIVATE_A}.items() <= \
        next(m for m in client_a.get("/v1/models").json()["data"] if m["id"] == "a-lora").items()
    assert client_a.delete("/admin/models/a-lora").status_code == 200


PIPELINE = PipelineMode(2, 0.002, 1e8, 2048, 3.0, ("cpu-1",))
PIPELINE_JSON = {"hops": 2, "hop_latency_s": 0.002, "hop_bytes_per_s": 1e8, "token_bytes": 2048,
                 "until": 3.0, "helpers": ["cpu-1"], "stages": [], "ranges": []}


def _node(node_id: str, models: list[str]) -> NodeView:
    instances = [InstanceView(instance_id=f"{node_id}-{i}", node_id=node_id,
                              model=ModelSpec(m, weight_bytes=1000 + i, kv_bytes_per_token=10,
                                              max_context=2048),
                              kv_bytes=4096 * (i + 1),
                              requests=[RequestView(f"req-{m}", m, 5, 0.0, SLO(1.0, 0.25))])
                 for i, m in enumerate(models)]
    storage = StorageView({"dram": 2e10, "disk": 1e9}, {m: "dram" for m in models}, 0.5,
                          arriving={m: 1.5 for m in models}, multicast_bytes_per_s=1e9,
                          pipelines={m: PIPELINE for m in models}, dram_bytes=4 << 30)
    return NodeView(node_id=node_id, hardware=Hardware.CPU, memory_bytes=1 << 30, matrix_accel=True,
                    instances=instances, budget_bytes=5000, heartbeat=12.5, storage=storage)


def test_nodes_and_instances_views(client_a, client_b, client_op, redis_url):
    private_id = model_id(PRIVATE_A, "tenant-a")
    r = SyncRedis.from_url(redis_url)
    r.sadd(NODES_SET, "cpu-0", "cpu-1", "gone")  # "gone": its key expired
    r.set(node_key("cpu-0"), wire.encode(_node("cpu-0", [PUBLIC_MODEL, private_id])))
    r.set(node_key("cpu-1"), wire.encode(_node("cpu-1", [])))
    try:
        nodes = client_a.get("/admin/nodes").json()["data"]
        assert [n["node_id"] for n in nodes] == ["cpu-0", "cpu-1"]
        assert nodes[0]["hardware"] == "cpu" and nodes[0]["memory_bytes"] == 1 << 30
        assert [i["model"]["name"] for i in nodes[0]["instances"]] == [PUBLIC_MODEL, PRIVATE_A]
        assert [i["kv_bytes"] for i in nodes[0]["instances"]] == [4096, 8192]
        assert nodes[1]["instances"] == []
        # The node's checkpoint tiers and the copies on their way to it by multicast, its own
        # private model under the name it gave it, the other tenant's not at all.
        visible = {PUBLIC_MODEL: "dram", PRIVATE_A: "dram"}
        assert nodes[0]["storage"] == {"bytes_per_s": {"dram": 2e10, "disk": 1e9}, "holds": visible,
                                       "pending_s": 0.5, "arriving": {m: 1.5 for m in visible},
                                       "multicast_bytes_per_s": 1e9,
                                       "pipelines": {m: PIPELINE_JSON for m in visible},
                                       "dram_bytes": 4 << 30}

        inst = {i["model"]: i for i in client_a.get("/admin/instances").json()["data"]}
        assert set(inst) == {PUBLIC_MODEL, PRIVATE_A}  # its own private one, by its own name
        tiny = inst[PUBLIC_MODEL]
        assert (tiny["node_id"], tiny["instance_id"], tiny["weight_bytes"]) == ("cpu-0", "cpu-0-0", 1000)
        assert tiny["batch_size"] == 1 and tiny["status"] == "ready" and tiny["kv_bytes"] == 4096
        assert tiny["requests"] == [""]  # counted, not named: other tenants' requests share it

        # tenant-b does not learn about tenant-a's private model through the cluster view.
        inst_b = client_b.get("/admin/instances").json()["data"]
        assert [(i["model"], i["instance_id"]) for i in inst_b] == [(PUBLIC_MODEL, "cpu-0-0")]
        node_b = client_b.get("/admin/nodes").json()["data"][0]
        assert [i["model"]["name"] for i in node_b["instances"]] == [PUBLIC_MODEL]
        assert node_b["storage"]["holds"] == {PUBLIC_MODEL: "dram"}
        assert private_id not in json.dumps(node_b) and PRIVATE_A not in json.dumps(node_b)

        # The operator sees everything, ids and request ids included.
        inst_op = {i["model"]: i for i in client_op.get("/admin/instances").json()["data"]}
        assert set(inst_op) == {PUBLIC_MODEL, private_id}
        assert inst_op[private_id]["requests"] == [f"req-{private_id}"]
        node_op = client_op.get("/admin/nodes").json()["data"][0]
        assert node_op["storage"]["holds"] == {PUBLIC_MODEL: "dram", private_id: "dram"}
    finally:
        r.delete(NODES_SET, node_key("cpu-0"), node_key("cpu-1"))
        r.close()


def test_symlink_checks_do_not_follow_loops(client_a, tenant_models):
    loop = tenant_models / "tenant-a" / "loop"
    if not loop.is_symlink():
        os.symlink(loop, loop)
    resp = client_a.post("/admin/models", json={"name": "loop", "path": str(loop)})
    assert resp.status_code in (400, 403), resp.text

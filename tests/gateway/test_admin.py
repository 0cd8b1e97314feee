"""Admin API: model registration round trip, tenancy, adapters, and the cluster view."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from redis import Redis as SyncRedis

from shared import wire
from shared.core.types import Hardware, InstanceView, ModelSpec, NodeView, RequestView, SLO
from shared.subjects import NODES_SET, node_key
from tests.gateway.conftest import PRIVATE_A

pytestmark = pytest.mark.integration


def test_register_list_use_delete_round_trip(client_a, client_b, model_dir):
    body = {"name": "org/round-trip", "path": str(model_dir), "engine": "torch",
            "slo_class": "interactive"}
    resp = client_a.post("/admin/models", json=body)
    assert resp.status_code == 201, resp.text
    rec = resp.json()
    assert rec["name"] == "org/round-trip" and rec["owner"] == "tenant-a" and rec["slo_class"] == "interactive"
    assert rec["max_context"] == 2048 and rec["kv_bytes_per_token"] > 0 and rec["weight_bytes"] > 0
    assert rec["eos_token_ids"]

    assert "org/round-trip" in {m["name"] for m in client_a.get("/admin/models").json()["data"]}
    assert "org/round-trip" in {m["id"] for m in client_a.get("/v1/models").json()["data"]}
    assert "org/round-trip" not in {m["id"] for m in client_b.get("/v1/models").json()["data"]}

    # Duplicate -> 409; for another tenant as well (names are global), without revealing the owner.
    assert client_a.post("/admin/models", json=body).json()["error"]["code"] == "model_exists"
    assert client_b.post("/admin/models", json=body).status_code == 409
    assert client_b.post("/admin/models", json={**body, "replace": True}).status_code == 409
    # The owner may replace it.
    resp = client_a.post("/admin/models", json={**body, "slo_class": "relaxed", "replace": True})
    assert resp.status_code == 201 and resp.json()["slo_class"] == "relaxed"

    assert client_b.delete("/admin/models/" + quote("org/round-trip", safe="")).status_code == 404
    resp = client_a.delete("/admin/models/org/round-trip")
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    assert client_a.delete("/admin/models/org/round-trip").status_code == 404
    assert client_a.post("/v1/completions", json={"model": "org/round-trip", "prompt": "x"}).status_code == 404


def test_public_model_is_visible_to_every_tenant(client_a, client_b, model_dir):
    resp = client_a.post("/admin/models", json={"name": "shared-pub", "path": str(model_dir), "public": True})
    assert resp.status_code == 201 and resp.json()["owner"] is None
    assert "shared-pub" in {m["id"] for m in client_b.get("/v1/models").json()["data"]}
    assert client_b.delete("/admin/models/shared-pub").status_code == 200


@pytest.mark.parametrize(("patch", "status", "param", "code"), [
    ({"path": "/does/not/exist"}, 400, "path", "invalid_model_dir"),
    ({"engine": "tensorrt"}, 400, "engine", "invalid_value"),
    ({"slo_class": "platinum"}, 400, "slo_class", "invalid_value"),
    ({"name": ""}, 400, "name", "invalid_value"),
    ({"name": "../etc"}, 400, "name", "invalid_value"),
    ({"public": "yes"}, 400, "public", "invalid_value"),
    ({"base_model": PRIVATE_A}, 404, "base_model", "model_not_found"),  # tenant-b cannot see it
    ({"colour": "red"}, 400, "colour", "unknown_parameter"),
])
def test_register_rejects_bad_input(client_b, model_dir, patch, status, param, code):
    body = {"name": "bad-one", "path": str(model_dir), **patch}
    resp = client_b.post("/admin/models", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, code)


def test_register_path_without_config_json(client_a, tmp_path):
    resp = client_a.post("/admin/models", json={"name": "empty-dir", "path": str(tmp_path)})
    assert resp.status_code == 400 and "config.json" in resp.json()["error"]["message"]


def test_lora_adapter_inherits_from_base(client_a, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    resp = client_a.post("/admin/models", json={"name": "a-lora", "path": str(tmp_path),
                                                "base_model": PRIVATE_A})
    assert resp.status_code == 201, resp.text
    rec = resp.json()
    assert rec["base_model"] == PRIVATE_A and rec["max_context"] == 2048 and rec["kv_bytes_per_token"] > 0
    assert {"id": "a-lora", "parent": PRIVATE_A}.items() <= \
        next(m for m in client_a.get("/v1/models").json()["data"] if m["id"] == "a-lora").items()
    assert client_a.delete("/admin/models/a-lora").status_code == 200


def _node(node_id: str, models: list[str]) -> NodeView:
    instances = [InstanceView(instance_id=f"{node_id}-{m}", node_id=node_id,
                              model=ModelSpec(m, weight_bytes=1000, kv_bytes_per_token=10, max_context=2048),
                              kv_bytes=4096,
                              requests=[RequestView("r1", m, 5, 0.0, SLO(1.0, 0.25))])
                 for m in models]
    return NodeView(node_id=node_id, hardware=Hardware.CPU, memory_bytes=1 << 30, matrix_accel=True,
                    instances=instances, budget_bytes=5000, heartbeat=12.5)


def test_nodes_and_instances_views(client_a, client_b, redis_url):
    r = SyncRedis.from_url(redis_url)
    r.sadd(NODES_SET, "cpu-0", "cpu-1", "gone")  # "gone": its key expired
    r.set(node_key("cpu-0"), wire.encode(_node("cpu-0", ["tiny", PRIVATE_A])))
    r.set(node_key("cpu-1"), wire.encode(_node("cpu-1", [])))
    try:
        nodes = client_a.get("/admin/nodes").json()["data"]
        assert [n["node_id"] for n in nodes] == ["cpu-0", "cpu-1"]
        assert nodes[0]["hardware"] == "cpu" and nodes[0]["memory_bytes"] == 1 << 30
        assert len(nodes[0]["instances"]) == 2

        inst = client_a.get("/admin/instances").json()["data"]
        assert {(i["node_id"], i["model"]) for i in inst} == {("cpu-0", "tiny"), ("cpu-0", PRIVATE_A)}
        assert inst[0]["batch_size"] == 1 and inst[0]["status"] == "ready"

        # tenant-b does not learn about tenant-a's private model through the cluster view.
        inst_b = client_b.get("/admin/instances").json()["data"]
        assert {i["model"] for i in inst_b} == {"tiny"}
        assert len(client_b.get("/admin/nodes").json()["data"][0]["instances"]) == 1
    finally:
        r.delete(NODES_SET, node_key("cpu-0"), node_key("cpu-1"))
        r.close()

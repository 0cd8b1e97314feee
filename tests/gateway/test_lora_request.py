"""A call to a LoRA adapter leaves the gateway as a request of its backbone naming the adapter
and its rank (from the adapter's adapter_config.json), which the placer's and the node's core
charge the profiled cost of unmerged LoRA at that rank."""

from __future__ import annotations

import json

import httpx
import pytest

from shared.registry import model_id
from tests.gateway.conftest import PRIVATE_A, PUBLIC_MODEL

pytestmark = pytest.mark.integration


async def test_an_adapter_call_carries_its_backbone_adapter_and_rank(gateway, responder,
                                                                    tenant_models):
    adapter = tenant_models / "tenant-a" / "rank16"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 16, "peft_type": "LORA"}))
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": "Bearer key-a"},
                                 trust_env=False, timeout=20) as c:
        resp = await c.post("/admin/models", json={"name": "rank16", "path": str(adapter),
                                                   "base_model": PRIVATE_A})
        assert resp.status_code == 201, resp.text
        try:
            for model in ("rank16", PUBLIC_MODEL):
                resp = await c.post("/v1/completions", json={"model": model, "prompt": "x",
                                                              "max_tokens": 4})
                assert resp.status_code == 200, resp.text
        finally:
            assert (await c.delete("/admin/models/rank16")).status_code == 200
    through, plain = responder.requests[-2:]
    assert (through.model, through.adapter, through.adapter_rank) == (
        model_id(PRIVATE_A, "tenant-a"), model_id("rank16", "tenant-a"), 16)
    assert (plain.adapter, plain.adapter_rank) == (None, 0)

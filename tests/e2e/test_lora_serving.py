"""LoRA adapters through the whole stack (ServerlessLoRA in slinfer): adapters registered over a
backbone with the admin API, called by name through the OpenAI API, served by one instance of the
backbone on the node with the adapters attached; tenants' adapters stay private.

The reference for an adapter's output at temperature 0 is the base model with the adapter merged
by peft, generating greedily with transformers from the prompt tokens the gateway makes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import httpx
import pytest

from services.gateway.tokenization import encode_text
from services.stack import Stack, running_stack
from shared.adaptergen import build_adapter
from shared.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
OPERATOR = "key-op"
PROMPTS = ["Return the value of the attribute.", "def main():",
           "The quick brown fox jumps over the lazy dog"]
MAX_TOKENS = 24


class LoraStack:
    def __init__(self, stack: Stack, model_dir: Path, tenant_dir: Path, adapter_dir: Path,
                 metrics_url: str) -> None:
        self.stack, self.model_dir, self.tenant_dir = stack, model_dir, tenant_dir
        self.adapter_dir, self.metrics_url = adapter_dir, metrics_url

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def register(self, key: str, name: str, path: Path, public: bool = False) -> httpx.Response:
        # "relaxed" (TTFT x2): this 2-core test machine is shared with other work, and nine
        # requests at once must not be dropped for a TTFT the CPU could not keep meanwhile.
        return httpx.post(f"{self.stack.url}/admin/models", headers=self.headers(key), timeout=30,
                          json={"name": name, "path": str(path), "base_model": self.stack.model,
                                "public": public, "slo_class": "relaxed"})


@pytest.fixture(scope="module")
def lora(tmp_path_factory, demo_model_dir, demo_profile) -> Iterator[LoraStack]:
    root = tmp_path_factory.mktemp("lora-stack")
    tenant_dir = root / "tenant-models"
    for tenant in KEYS.values():
        (tenant_dir / tenant).mkdir(parents=True)
    metrics_port = free_port()
    env = {"SLINFER_API_KEYS": ",".join(f"{k}:{t}" for k, t in KEYS.items()),
           "SLINFER_OPERATOR_KEYS": OPERATOR, "SLINFER_TENANT_MODELS_DIR": str(tenant_dir),
           # Instances stay while the test looks at them after its requests ended.
           "SLINFER_KEEP_ALIVE_S": "60"}
    with running_stack(root / "stack", demo_model_dir, extra_env=env, profile=demo_profile,
                       child_env={"node-0": {"SLINFER_NODE_METRICS_PORT": str(metrics_port)}}) as s:
        yield LoraStack(s, demo_model_dir, tenant_dir, root / "adapters",
                        f"http://127.0.0.1:{metrics_port}/metrics")


@lru_cache(maxsize=1)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def merged_reference(model_dir: Path, adapter: Path | None, prompt: str) -> tuple[str, int]:
    """(text, completion tokens) of the base model with `adapter` merged, greedy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    ids = encode_text(tokenizer, prompt)
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False), len(new)


async def complete(lora: LoraStack, key: str, model: str, prompt: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{lora.stack.url}/v1/completions", headers=lora.headers(key),
                                 json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                       "temperature": 0})


def node_metrics(url: str) -> dict[str, float]:
    """The node's slinfer_node_* gauges from its Prometheus endpoint."""
    text = httpx.get(url, timeout=5).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(slinfer_node_[a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


def operator_node(lora: LoraStack, key: str = OPERATOR) -> dict:
    r = httpx.get(f"{lora.stack.url}/admin/nodes", headers=lora.headers(key), timeout=10)
    assert r.status_code == 200, r.text
    (node,) = r.json()["data"]
    return node


def node_since(lora: LoraStack, since: float, key: str = OPERATOR) -> dict:
    """The node as `key` sees it in a view the node published after `since` (time.time(); the
    node runs on this machine). The node publishes its view at each heartbeat (0.25 s): a view
    read as soon as a response arrives may be from before that request was admitted."""
    deadline = time.monotonic() + 30
    while (node := operator_node(lora, key))["heartbeat"] <= since:
        assert time.monotonic() < deadline, f"no view of the node published since {since}"
        time.sleep(0.05)
    return node


def test_eight_adapters_on_one_backbone_serve_their_own_outputs(lora: LoraStack):
    names = [f"lora-{i}" for i in range(8)]
    paths = {}
    for i, name in enumerate(names):
        paths[name] = build_adapter(lora.model_dir, lora.adapter_dir / name, seed=10 + i)
        r = lora.register(OPERATOR, name, paths[name], public=True)
        assert r.status_code == 201, r.text
        assert r.json()["lifecycle"]["state"] == "ready"  # served on the backbone's profile
    # The backbone resident first (the case backbone sharing is for): one plain request.
    assert asyncio.run(complete(lora, "key-a", lora.stack.model, PROMPTS[2])).status_code == 200
    jobs = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate(names)]
    jobs += [(lora.stack.model, PROMPTS[0])]  # and the plain base among them

    async def all_at_once():
        return await asyncio.gather(*(complete(lora, "key-a", m, p) for m, p in jobs))

    responses = asyncio.run(all_at_once())
    answered = time.time()
    assert [r.status_code for r in responses] == [200] * len(jobs), [r.text for r in responses]
    # On the node, as it was once every request had been answered (read first: the references
    # below take a while, and the keep-alive runs): the backbone's instances, with the eight
    # adapters attached to them. One instance is the usual outcome; on a loaded box the core may
    # rightly start a second copy when the first cannot take more within the SLOs. What must hold either way: adapters share
    # a copy (never a backbone per adapter), and the memory holds each copy's weights once.
    node = node_since(lora, answered)
    instances = node["instances"]
    assert {i["model"]["name"] for i in instances} == {lora.stack.model}
    attached = [a for i in instances for a in i["adapters"]]
    assert set(attached) >= set(names)
    assert len(instances) <= len(names) // 2, "adapters must share backbone copies"
    assert max(len(set(i["adapters"]) & set(names)) for i in instances) >= 2
    adapter_bytes = sum(n for i in instances for n in i["adapters"].values())
    weights = instances[0]["model"]["weight_bytes"]
    kv = sum(i["kv_bytes"] for i in instances)
    assert node["budget_bytes"] == len(instances) * weights + kv + adapter_bytes
    # The node's own memory metric says the same: one backbone's weights per instance.
    deadline = time.monotonic() + 10
    while True:  # the gauges are sampled at each heartbeat
        metrics = node_metrics(lora.metrics_url)
        if metrics.get("slinfer_node_memory_budget_bytes") == node["budget_bytes"] or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert metrics["slinfer_node_instances"] == len(instances)
    assert metrics["slinfer_node_memory_budget_bytes"] - metrics["slinfer_node_kv_allocated_bytes"] \
        - adapter_bytes == len(instances) * weights

    for (model, prompt), r in zip(jobs, responses):
        assert r.status_code == 200, r.text
        body = r.json()
        expected = merged_reference(lora.model_dir, paths.get(model), prompt)
        assert (body["choices"][0]["text"], body["usage"]["completion_tokens"]) == expected, model
        assert body["model"] == model
    # The outputs are the adapters' own: no two adapters on one prompt answered alike.
    texts = {(p, r.json()["choices"][0]["text"]) for (_, p), r in zip(jobs, responses)}
    assert len(texts) == len(jobs)


def test_a_tenants_adapter_is_invisible_to_other_tenants(lora: LoraStack):
    # tenant-a and tenant-b each own a private adapter called "secret" (names are per tenant).
    path_a = build_adapter(lora.model_dir, lora.tenant_dir / "tenant-a" / "secret", seed=101)
    path_b = build_adapter(lora.model_dir, lora.tenant_dir / "tenant-b" / "secret", seed=202)
    assert lora.register("key-a", "secret", path_a).status_code == 201
    only_a = build_adapter(lora.model_dir, lora.tenant_dir / "tenant-a" / "only-a", seed=303)
    assert lora.register("key-a", "only-a", only_a).status_code == 201

    # tenant-b sees neither of tenant-a's adapters, and cannot call or build on them.
    listed = httpx.get(f"{lora.stack.url}/v1/models", headers=lora.headers("key-b")).json()
    assert "only-a" not in {m["id"] for m in listed["data"]}
    r = asyncio.run(complete(lora, "key-b", "only-a", PROMPTS[0]))
    assert r.status_code == 404 and "only-a" in r.json()["error"]["message"]
    assert httpx.get(f"{lora.stack.url}/admin/models/only-a",
                     headers=lora.headers("key-b")).status_code == 404
    r = httpx.post(f"{lora.stack.url}/admin/models", headers=lora.headers("key-b"), json={
        "name": "on-top", "path": str(path_b), "base_model": "only-a"})
    assert r.status_code == 404

    # Each tenant's "secret" is its own adapter: tenant-b's before it registered one is a 404.
    assert asyncio.run(complete(lora, "key-b", "secret", PROMPTS[1])).status_code == 404
    assert lora.register("key-b", "secret", path_b).status_code == 201
    got_a = asyncio.run(complete(lora, "key-a", "secret", PROMPTS[1])).json()["choices"][0]["text"]
    got_b = asyncio.run(complete(lora, "key-b", "secret", PROMPTS[1])).json()["choices"][0]["text"]
    answered = time.time()

    # Both adapters now sit on the backbone (its one instance, or either of its copies): each
    # tenant's view of the node, published after both calls, shows its own adapter (by its own
    # name) and not the other's; the operator sees both. (Read before the references: those take
    # a while.)
    def adapters_seen(key: str) -> set[str]:
        return {a for i in node_since(lora, answered, key)["instances"] for a in i["adapters"]}

    assert {"tenant-a~secret", "tenant-b~secret"} <= adapters_seen(OPERATOR)
    seen_b = adapters_seen("key-b")
    assert "secret" in seen_b and not any("tenant-a" in a or a == "only-a" for a in seen_b)
    seen_a = adapters_seen("key-a")
    assert "secret" in seen_a and not any("tenant-b" in a for a in seen_a)

    assert got_a == merged_reference(lora.model_dir, path_a, PROMPTS[1])[0]
    assert got_b == merged_reference(lora.model_dir, path_b, PROMPTS[1])[0]
    assert got_a != got_b

"""One error for one cause (issue 24): a model or LoRA adapter whose directory is deleted or
broken after registration is answered as such on the real stack - plain, streamed and chat
requests alike get the same 500 `model_failed` that names the model and says its files are
missing or unreadable (never a 503 "overloaded", never the server's path), whether the node's
failed load or the placer's readiness gate answers it; its lifecycle says `failed` with the
reason (the operator sees the path). Once the files are back, registering it again serves it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from services.stack import Stack
from shared.adaptergen import build_adapter
from shared.subjects import PROFILES_HASH, profile_field

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# (kind, body) of each request, in the order sent: the first meets the node's failed load, the
# later ones the placer's readiness gate (the lifecycle is failed by then).
CALLS = [("stream", {"prompt": "Hello", "stream": True}), ("plain", {"prompt": "Hello"}),
         ("chat", {"messages": [{"role": "user", "content": "Hello"}]}),
         ("chat-stream", {"messages": [{"role": "user", "content": "Hello"}], "stream": True})]


def _delete(directory: Path) -> None:
    shutil.rmtree(directory)


def _truncate(directory: Path) -> None:
    """Every weight file cut to its header: a copy that stopped half-way."""
    for file in directory.glob("*.safetensors"):
        data = file.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        file.write_bytes(data[:8 + length])


def _bad_config(directory: Path) -> None:
    for name in ("config.json", "adapter_config.json"):
        if (directory / name).exists():
            (directory / name).write_text("{ not json")


FAULTS: dict[str, Callable[[Path], None]] = {"deleted": _delete, "truncated": _truncate,
                                             "bad_config": _bad_config}


async def _calls(stack: Stack, model: str) -> list[tuple[str, int, dict]]:
    """(kind, status, error) of each of CALLS for `model`, one after the other."""
    out = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=120, trust_env=False) as http:
        for kind, body in CALLS:
            path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
            r = await http.post(path, json={"model": model, "max_tokens": 4, **body})
            error = r.json().get("error") if r.headers.get("content-type", "").startswith(
                "application/json") else {"stream": r.text[:300]}
            out.append((kind, r.status_code, error))
    return out


def _assert_one_answer(calls: list[tuple[str, int, dict]], model: str, hidden: Path) -> None:
    for kind, status, error in calls:
        assert status == 500, (kind, status, error)
        assert (error["type"], error["code"]) == ("server_error", "model_failed"), (kind, error)
        message = error["message"]
        assert f"{model!r}" in message and "missing or unreadable" in message, (kind, message)
        assert str(hidden) not in message and "<model directory>" in message, (kind, message)
    assert len({(s, e["type"], e["code"]) for _, s, e in calls}) == 1


def _register(stack: Stack, body: dict) -> dict:
    r = httpx.post(f"{stack.url}/admin/models", timeout=30,
                   json={"public": True, "slo_class": "relaxed", **body})
    assert r.status_code in (200, 201), r.text
    return r.json()["lifecycle"]


def _lifecycle(stack: Stack, model: str) -> dict:
    r = httpx.get(f"{stack.url}/admin/models/{model}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["lifecycle"]


async def _copy_profile(stack: Stack, model: str) -> None:
    """The stack's model's profile stored for `model` too: a copy of the same checkpoint, ready
    at its registration (no profiler runs in this stack)."""
    redis = Redis.from_url(stack.redis_url)
    try:
        profile = json.loads(await redis.hget(PROFILES_HASH, profile_field(stack.model, "cpu")))
        profile["model"] = model
        await redis.hset(PROFILES_HASH, profile_field(model, "cpu"), json.dumps(profile))
    finally:
        await redis.aclose()


def _assert_answered_and_failed(stack: Stack, name: str, directory: Path) -> None:
    """Every way of asking answers the one clear error; the lifecycle says failed and why."""
    _assert_one_answer(asyncio.run(_calls(stack, name)), name, directory)
    life = _lifecycle(stack, name)
    assert life["state"] == "failed", life
    reason = life["hardware"]["cpu"]["reason"]
    assert "files missing or unreadable" in reason and str(directory) in reason, reason


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_broken_model_directory_is_one_clear_error(stack: Stack, demo_model_dir: Path,
                                                     tmp_path: Path, fault: str):
    model = f"broken-{fault}"
    directory = Path(shutil.copytree(demo_model_dir, tmp_path / model))  # real copies: cut below
    asyncio.run(_copy_profile(stack, model))
    assert _register(stack, {"name": model, "path": str(directory)})["state"] == "ready"
    FAULTS[fault](directory)

    _assert_answered_and_failed(stack, model, directory)

    # Fixed, and registered again: served.
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(demo_model_dir, directory)
    assert _register(stack, {"name": model, "path": str(directory), "replace": True})[
        "state"] == "ready"
    r = httpx.post(f"{stack.url}/v1/completions", timeout=120,
                   json={"model": model, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_broken_adapter_directory_is_one_clear_error(stack: Stack, demo_model_dir: Path,
                                                       tmp_path: Path, fault: str):
    adapter = f"broken-adapter-{fault}"
    directory = build_adapter(demo_model_dir, tmp_path / adapter, seed=7)
    assert _register(stack, {"name": adapter, "path": str(directory),
                             "base_model": stack.model})["state"] == "ready"
    FAULTS[fault](directory)

    _assert_answered_and_failed(stack, adapter, directory)
    # Its backbone is not harmed: it still serves.
    assert _lifecycle(stack, stack.model)["state"] == "ready"
    r = httpx.post(f"{stack.url}/v1/completions", timeout=120,
                   json={"model": stack.model, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text

    shutil.rmtree(directory, ignore_errors=True)
    build_adapter(demo_model_dir, directory, seed=7)
    assert _register(stack, {"name": adapter, "path": str(directory), "base_model": stack.model,
                             "replace": True})["state"] == "ready"
    r = httpx.post(f"{stack.url}/v1/completions", timeout=120,
                   json={"model": adapter, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text

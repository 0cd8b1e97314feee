"""A registered model becomes servable by itself: `POST /admin/models` starts its lifecycle (one
profiling job per hardware kind on the JetStream work queue), `GET /admin/models` and
`GET /admin/models/{name}` show it per kind with progress and, for failed, the reason (a tenant
without server paths), and the gateway answers the placer's not-ready errors as 503s and its
failed errors as 500s that say so. A stand-in profiler drives the states here; the last test runs the whole path with
the real profiler service, placer and node: register, profile, serve."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from redis.asyncio import Redis

from services.profiler.service import ProfilerService, ProfilerSettings
from services.stack import Stack
from shared import wire
from shared.cluster import read_nodes, save_profile
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware
from shared.model_state import (ModelState, ProfileJob, ensure_job_stream, lifecycle_error,
                                set_hardware_state)
from shared.registry import model_id
from shared.schemas import FinishReason, TokenMessage
from shared.subjects import job_subject
from tests.gateway.clients import api_client
from tests.gateway.conftest import copy_model

pytestmark = pytest.mark.integration


class StandInProfiler:
    """Takes one hardware kind's jobs from the work queue the way the profiler service does (its
    durable consumer) and reports states as the test says."""

    def __init__(self, nats_url: str, redis_url: str, kind: str) -> None:
        self.nats_url, self.redis_url, self.kind = nats_url, redis_url, kind

    async def __aenter__(self) -> StandInProfiler:
        self.nc, self.redis = await nats.connect(self.nats_url), Redis.from_url(self.redis_url)
        js = self.nc.jetstream()
        await ensure_job_stream(js)
        self.sub = await js.pull_subscribe(
            job_subject(self.kind), durable=f"profiler-{self.kind}",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=600.0))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()
        await self.redis.aclose()

    async def take(self, model: str, timeout_s: float = 10.0) -> ProfileJob:
        """The job for `model` (others, from other tests' registrations, are taken and dropped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msgs = await self.sub.fetch(batch=16, timeout=0.5)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            for msg in msgs:
                await msg.ack()
                job = wire.decode(ProfileJob, msg.data)
                if job.model == model:
                    return job
        raise AssertionError(f"no profiling job for {model} on {self.kind}")

    async def report(self, model: str, state: ModelState, reason: str = "", progress: float = 0.0):
        await set_hardware_state(self.redis, model, self.kind, state, reason, progress)


async def _kinds(redis_url: str) -> list[str]:
    """The kinds registration profiles on here: the live nodes' (another test may have
    published some), else the default, cpu."""
    redis = Redis.from_url(redis_url)
    try:
        return sorted({n.hardware.value for n in await read_nodes(redis)}) or ["cpu"]
    finally:
        await redis.aclose()


async def test_registration_queues_jobs_and_the_admin_api_shows_the_states(
        gateway, nats_url, redis_url, model_dir):
    kinds = await _kinds(redis_url)
    async with api_client(gateway, "key-op") as op:
        resp = await op.post("/admin/models", json={"name": "lc/walk", "path": str(model_dir),
                                                    "public": True})
        assert resp.status_code == 201, resp.text
        life = resp.json()["lifecycle"]
        assert life["state"] == "converting" and sorted(life["hardware"]) == kinds
        assert all(k["state"] == "converting" and k["reason"] == "queued"
                   for k in life["hardware"].values())

        async with StandInProfiler(nats_url, redis_url, kinds[0]) as prof:
            job = await prof.take("lc/walk")
            assert job.hardware == kinds[0]
            await prof.report("lc/walk", ModelState.PROFILING, "profiling on torch", 0.5)
            one = (await op.get("/admin/models/lc/walk")).json()
            assert one["name"] == "lc/walk" and one["lifecycle"]["state"] == "profiling"
            step = one["lifecycle"]["hardware"][kinds[0]]
            assert step["state"] == "profiling" and step["progress"] == 0.5
            assert step["reason"] == "profiling on torch"

            await prof.report("lc/walk", ModelState.READY, "", 1.0)
            listed = {m["name"]: m for m in (await op.get("/admin/models")).json()["data"]}
            assert listed["lc/walk"]["lifecycle"]["state"] == "ready"
        assert (await op.get("/admin/models/not-there")).status_code == 404
        assert (await op.delete("/admin/models/lc/walk")).status_code == 200


async def test_a_failed_lifecycle_shows_its_reason_without_server_paths_for_tenants(
        gateway, nats_url, redis_url, tenant_models):
    kind = (await _kinds(redis_url))[0]
    async with api_client(gateway, "key-a") as a, api_client(gateway, "key-b") as b, \
            api_client(gateway, "key-op") as op:
        resp = await a.post("/admin/models", json={"name": "lc-broken",
                                                   "path": str(tenant_models / "tenant-a" / "tiny")})
        assert resp.status_code == 201, resp.text
        rid = model_id("lc-broken", "tenant-a")
        path = (await op.get(f"/admin/models/{rid}")).json()["path"]
        async with StandInProfiler(nats_url, redis_url, kind) as prof:
            await prof.take(rid)
            await prof.report(rid, ModelState.FAILED, f"OSError: cannot read {path}/model.safetensors")
        mine = (await a.get("/admin/models/lc-broken")).json()["lifecycle"]
        assert mine["state"] == "failed"
        assert mine["hardware"][kind]["reason"] == \
            "OSError: cannot read <model directory>/model.safetensors"
        theirs = (await op.get(f"/admin/models/{rid}")).json()["lifecycle"]
        assert path in theirs["hardware"][kind]["reason"]  # the operator sees where
        assert (await b.get("/admin/models/lc-broken")).status_code == 404  # not b's to see
        await a.delete("/admin/models/lc-broken")


async def test_a_model_with_a_profile_is_ready_at_once_and_a_replaced_checkpoint_is_profiled_again(
        gateway, redis_url, model_dir, tmp_path):
    redis = Redis.from_url(redis_url)
    kinds = await _kinds(redis_url)
    for kind in kinds:
        await save_profile(redis, _flat_profile("lc/profiled", Hardware(kind)))
    await redis.aclose()
    async with api_client(gateway, "key-op") as op:
        body = {"name": "lc/profiled", "path": str(model_dir), "public": True}
        life = (await op.post("/admin/models", json=body)).json()["lifecycle"]
        assert life["state"] == "ready"
        assert {k: s["state"] for k, s in life["hardware"].items()} == {k: "ready" for k in kinds}
        # Same checkpoint again: still ready. Another checkpoint: its old profile is not its own.
        assert (await op.post("/admin/models", json={**body, "replace": True})).json()[
            "lifecycle"]["state"] == "ready"
        other = copy_model(model_dir, model_dir.parent / "lc-other")
        life = (await op.post("/admin/models", json={**body, "path": str(other),
                                                    "replace": True})).json()["lifecycle"]
        assert life["state"] == "converting"
        await op.delete("/admin/models/lc/profiled")


@pytest.mark.parametrize("code,status_code,retry", [("model_not_ready", 503, "5"),
                                                     ("model_failed", 500, None)])
async def test_the_placers_not_ready_errors_reach_the_client_as_such(
        gateway, responder, code, status_code, retry):
    message = "The model 'tiny' is not ready yet: profiling on cpu (profiling on torch, 40%)."
    responder.script = lambda r: [TokenMessage(r.request_id, 0, [], finished=True,
                                               finish_reason=FinishReason.ERROR,
                                               error=lifecycle_error(code, message))]
    async with api_client(gateway, "key-a") as a:
        for stream in (False, True):
            resp = await a.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                         "stream": stream})
            assert resp.status_code == status_code, resp.text
            err = resp.json()["error"]
            assert err["code"] == code and err["message"] == message
            assert "overloaded" not in err["message"]
            assert resp.headers.get("Retry-After") == retry


def _flat_profile(model: str, hardware: Hardware) -> Profile:
    return Profile(model, hardware, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]), load_s=0.5)


# --- the whole path: gateway, real profiler service, placer, node ---------------------------------

@pytest.mark.slow
async def test_register_profile_serve_with_the_real_profiler(stack: Stack, model_dir, tmp_path):
    """On the session's stack (tests/conftest.py), which runs no profiler service of its own."""
    fresh_dir = copy_model(model_dir, Path(tmp_path) / "fresh")
    async with httpx.AsyncClient(base_url=stack.url, timeout=120, trust_env=False) as http:
        resp = await http.post("/admin/models", json={"name": "fresh", "path": str(fresh_dir),
                                                      "public": True})
        assert resp.status_code == 201, resp.text
        assert resp.json()["lifecycle"]["hardware"]["cpu"]["state"] == "converting"

        # No profiler yet: a request waits out its TTFT SLO, then says the model is not ready.
        resp = await http.post("/v1/completions", json={"model": "fresh", "prompt": "Hello",
                                                        "max_tokens": 4})
        assert resp.status_code == 503, resp.text
        err = resp.json()["error"]
        assert err["code"] == "model_not_ready" and "converting on cpu (queued)" in err["message"]

        nc, redis = await nats.connect(stack.nats_url), Redis.from_url(stack.redis_url)
        service = ProfilerService(ProfilerSettings(stack.nats_url, stack.redis_url, max_len=64,
                                                   max_batch=2), nc, redis)
        await service.start()
        stop = asyncio.Event()
        runner = asyncio.create_task(service.run(stop))
        try:
            seen = set()
            deadline = time.monotonic() + 240
            while True:
                life = (await http.get("/admin/models/fresh")).json()["lifecycle"]
                seen.add(life["state"])
                if life["state"] in ("ready", "failed"):
                    break
                assert time.monotonic() < deadline, f"never ready: {life}"
                await asyncio.sleep(0.2)
            assert life["state"] == "ready", life
            assert "profiling" in seen  # its progress was visible on the way
        finally:
            stop.set()
            await runner
            await nc.close()
            await redis.aclose()

        resp = await http.post("/v1/completions", json={"model": "fresh", "prompt": "Hello",
                                                        "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
        # The stack is the session's: the next test finds only what it registered itself.
        assert (await http.delete("/admin/models/fresh")).status_code == 200

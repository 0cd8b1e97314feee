"""Keep-alive, pinning, preload and unload on the real stack (gateway, placer, a CPU node worker
and its torch engine as processes), judged by the node's own view in Redis as the admin API
reads it: a request's keep_alive 0 unloads its instance although its model keeps instances
10 minutes; a pinned model gets an instance from the placer alone and keeps it idle well past
the cluster's keep-alive (1 s, the stack's default); preload starts an instance with the
keep-alive asked for, and unload takes it down."""

from __future__ import annotations

import httpx
import pytest

from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEFAULT_KEEP_ALIVE_S = 1.0  # CoreConfig's, which the stack does not change


async def test_keep_alive_pinning_preload_and_unload(stack):
    model = stack.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:

        async def views() -> list[tuple[dict, dict]]:
            """(node, instance) of every instance of the model that is not on its way out."""
            nodes = (await c.get("/admin/nodes")).json()["data"]
            return [(n, i) for n in nodes for i in n["instances"]
                    if i["model"]["name"] == model and i["status"] != "unloading"]

        async def patch(**body) -> None:
            resp = await c.patch(f"/admin/models/{model}", json=body)
            assert resp.status_code == 200, resp.text

        try:
            await patch(keep_alive="10m")
            resp = await c.post(f"/admin/models/{model}/preload", json={"keep_alive": "10m"})
            assert resp.status_code == 200, resp.text
            assert resp.json()["instances"], resp.json()
            await until(lambda: _windows_are(views, [600.0]), 30, "the preloaded 10-minute window")

            # A request's keep_alive 0: its instance goes as soon as it is idle.
            resp = await c.post("/v1/completions", json={
                "model": model, "prompt": "hello", "max_tokens": 2, "keep_alive": 0})
            assert resp.status_code == 200, resp.text
            await until(lambda: _none(views), 30, "keep_alive 0 to unload the instance")

            # Pinned: the placer starts an instance by itself, and it outlives the keep-alive.
            await patch(keep_alive=None, min_instances=1)
            await until(lambda: _pinned_idle_past(views, 3 * DEFAULT_KEEP_ALIVE_S), 60,
                        "a pinned instance idle for 3 keep-alives in the node's view")
            assert len(await views()) == 1  # one start, not one per check
            resp = await c.post(f"/admin/models/{model}/unload")
            assert resp.status_code == 409, resp.text

            await patch(min_instances=0)
            resp = await c.post(f"/admin/models/{model}/unload")
            assert resp.status_code == 200, resp.text
            assert resp.json()["nodes"] == list(stack.node_ids)
            await until(lambda: _none(views), 30, "the unload to take the instance down")
        finally:
            await c.patch(f"/admin/models/{model}", json={"keep_alive": None, "min_instances": 0})
            await c.post(f"/admin/models/{model}/unload")


async def _windows_are(views, windows: list[float | None]) -> bool:
    return [i["keep_alive_s"] for _, i in await views()] == windows


async def _none(views) -> bool:
    return not await views()


async def _pinned_idle_past(views, idle_s: float) -> bool:
    """One pinned, ready, idle instance whose node's snapshot was taken more than `idle_s`
    after its last request (node and gateway clocks: the snapshot's, rebased on read)."""
    found = await views()
    return len(found) == 1 and all(
        i["pinned"] and i["status"] == "ready" and not i["requests"]
        and n["heartbeat"] - i["last_active"] > idle_s for n, i in found)

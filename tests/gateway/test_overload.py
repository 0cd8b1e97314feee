"""Overload at the edge: a tenant over its concurrency or request rate, or a model whose queue
is full, gets 429 with Retry-After at once (nothing is queued for it), and is served again once
there is room. Each test runs its own gateway with small limits."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.gateway.admission import Admission
from services.gateway.settings import GatewaySettings
from tests.gateway.conftest import PUBLIC_MODEL, start_gateway
from tests.gateway.responder import Hang, Responder, token_script

pytestmark = pytest.mark.integration


@pytest.fixture
async def limited(make_settings, seeded_models, nats_url, hf_tokenizer, request):
    """A gateway with the limits the test gives (indirect parameter), and a responder that holds
    every request whose prompt ends in HOLD_TOKEN until it is cancelled."""
    gw = start_gateway(make_settings(**request.param))
    r = Responder(nats_url, hf_tokenizer)
    r.script = lambda req: ([Hang()] if req.prompt_token_ids[-1] == HOLD_TOKEN
                            else token_script(req, r.default_output("ok")))
    await r.start()
    yield gw, r
    await r.stop()
    await asyncio.to_thread(gw.stop)


HOLD_TOKEN = 777


def _body(hold: bool, model: str = PUBLIC_MODEL) -> dict:
    return {"model": model, "prompt": [5, HOLD_TOKEN if hold else 6], "max_tokens": 4}


async def _post(gw, key: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url, headers={"Authorization": f"Bearer {key}"},
                                 trust_env=False, timeout=20) as c:
        return await c.post("/v1/completions", json=body)


def _assert_429(resp: httpx.Response, code: str) -> None:
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("rate_limit_error", code)
    assert int(resp.headers["Retry-After"]) >= 1


@pytest.mark.parametrize("limited", [dict(tenant_max_concurrency=2, model_max_queue=0)],
                         indirect=True)
async def test_tenant_concurrency_limit(limited):
    gw, r = limited
    held = [asyncio.create_task(_post(gw, "key-a", _body(hold=True))) for _ in range(2)]
    await r.wait_requests(2)
    _assert_429(await _post(gw, "key-a", _body(hold=False)), "concurrency_limit_exceeded")
    assert len(r.requests) == 2  # the refused request was never queued
    assert (await _post(gw, "key-b", _body(hold=False))).status_code == 200  # other tenants go on
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    await r.wait_cancel(r.requests[1].request_id)
    await r.wait_cancel(r.requests[0].request_id)
    await _eventually_ok(gw, "key-a")  # the slots came back when the held requests ended


async def _eventually_ok(gw, key: str) -> None:
    # The slot is released in the gateway's cleanup of the cancelled request; the test waits
    # for that event, with a bound, rather than for a fixed time.
    for _ in range(200):
        resp = await _post(gw, key, _body(hold=False))
        if resp.status_code == 200:
            return
        assert resp.status_code == 429
        await asyncio.sleep(0.02)
    raise AssertionError("the tenant's slots never came back")


@pytest.mark.parametrize("limited", [dict(tenant_max_concurrency=0, model_max_queue=1)],
                         indirect=True)
async def test_model_queue_limit_counts_every_tenant(limited):
    gw, r = limited
    held = asyncio.create_task(_post(gw, "key-a", _body(hold=True)))
    await r.wait_requests(1)
    _assert_429(await _post(gw, "key-b", _body(hold=False)), "model_queue_full")
    # Another model has its own queue.
    assert (await _post(gw, "key-b", _body(hold=False, model="tiny-short"))).status_code == 200
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    await _eventually_ok(gw, "key-b")


@pytest.mark.parametrize("limited", [dict(tenant_rate_limit=0.001, tenant_rate_burst=3)],
                         indirect=True)
async def test_tenant_rate_limit(limited):
    gw, r = limited
    for _ in range(3):
        assert (await _post(gw, "key-a", _body(hold=False))).status_code == 200
    resp = await _post(gw, "key-a", _body(hold=False))
    _assert_429(resp, "rate_limit_exceeded")
    assert int(resp.headers["Retry-After"]) >= 900  # one token per 1000 s
    assert len(r.requests) == 3
    assert (await _post(gw, "key-b", _body(hold=False))).status_code == 200


@pytest.mark.parametrize("limited", [dict(tenant_max_concurrency=1)],
                         indirect=True)
async def test_a_hidden_model_is_404_even_when_the_tenant_is_at_its_limit(limited):
    gw, r = limited
    held = asyncio.create_task(_post(gw, "key-b", _body(hold=True)))
    await r.wait_requests(1)
    resp = await _post(gw, "key-b", _body(hold=False, model="a-private"))
    assert resp.status_code == 404  # not a 429 that would say the model exists
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)


def test_token_bucket_refills_with_the_clock():
    now = [0.0]
    admission = Admission(GatewaySettings(tenant_rate_limit=2.0, tenant_rate_burst=2),
                          clock=lambda: now[0])
    admission.check_rate("t")
    admission.check_rate("t")
    with pytest.raises(Exception) as err:
        admission.check_rate("t")
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    now[0] = 0.5  # one token back at 2 per second
    admission.check_rate("t")
    with pytest.raises(Exception):
        admission.check_rate("t")


def test_slots_are_released_once():
    admission = Admission(GatewaySettings(tenant_max_concurrency=1, model_max_queue=5))
    slot = admission.acquire("t", "m")
    with pytest.raises(Exception):
        admission.acquire("t", "m")
    slot.release()
    slot.release()  # a second release must not free a slot it does not hold
    admission.acquire("t", "m")
    assert dict(admission.tenant_in_flight) == {"t": 1} and dict(admission.model_in_flight) == {"m": 1}


@pytest.mark.parametrize("limited", [dict(tenant_max_concurrency=3, model_max_queue=0)],
                         indirect=True)
async def test_each_choice_counts_against_the_tenant_limit(limited):
    gw, r = limited
    held = asyncio.create_task(_post(gw, "key-a", {**_body(hold=True), "n": 2}))
    await r.wait_requests(2)
    _assert_429(await _post(gw, "key-a", {**_body(hold=False), "n": 2}),
                "concurrency_limit_exceeded")
    too_many = await _post(gw, "key-b", {**_body(hold=False), "n": 4})  # never fits
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert len(r.requests) == 2  # neither refused request queued a choice
    assert (await _post(gw, "key-a", _body(hold=False))).status_code == 200  # the third slot
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    for req in r.requests[:2]:
        await r.wait_cancel(req.request_id)
    await _eventually_ok(gw, "key-a")


def test_choices_take_their_slots_all_or_none():
    admission = Admission(GatewaySettings(tenant_max_concurrency=4, model_max_queue=3))
    slots = admission.acquire_many("t", "m", 2)
    with pytest.raises(Exception) as err:
        admission.acquire_many("t", "m", 2)  # the model's queue has room for one more
    assert err.value.status == 429
    with pytest.raises(Exception) as err:
        admission.acquire_many("u", "other", 5)  # more than the tenant cap could ever hold
    assert (err.value.status, err.value.param) == (400, "n")
    assert dict(admission.tenant_in_flight) == {"t": 2} and dict(admission.model_in_flight) == {"m": 2}
    for slot in slots:
        slot.release()
    assert not admission.tenant_in_flight and not admission.model_in_flight

"""Schemathesis fuzzes the gateway's published /openapi.json on a real gateway (real NATS and
Redis; the stand-in responder answers for placer and node): schema-valid and schema-invalid
requests to every operation, a bounded number of each. No answer may be a 5xx, every answer must
be one the schema declares (status, content type, body), and afterwards the gateway still serves
an ordinary request."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection,
                                 not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from tests.fuzz.conftest import OPERATOR_KEY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = 40  # per operation and mode: ~800 requests in all, well under a minute
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
# tenant-b owns only "mine": whatever the fuzzer deletes or registers, the model used below stays.
FUZZ_KEY = "fuzz-b"


def _fuzz_operation(operation, mode: GenerationMode, base_url: str,
                    statuses: dict[str, Counter]) -> list[str]:
    """Run the examples; return the failures as text (collected, so one run reports them all)."""
    failures: list[str] = []
    negative = mode is GenerationMode.NEGATIVE
    headers = {"Authorization": f"Bearer {FUZZ_KEY}"}

    @given(operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # a model that exists: the request goes all the way
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        statuses[f"{operation.label} {mode.value}"][_outcome(response)] += 1
        # Invalid data must be refused; a 413 (the body is over the gateway's limit, e.g. more
        # embedding inputs than maxItems allows) refuses it too, though not in schemathesis' list.
        checks = CHECKS + ([negative_data_rejection] if negative and response.status_code != 413
                           else [])
        try:
            case.validate_response(response, checks=checks, headers=headers)
        except Exception as exc:  # schemathesis raises one failure group per case
            failures.append(f"{operation.label} [{mode.value}] -> {response.status_code}: "
                            f"{str(exc)[:800]}\n  {case.as_curl_command()[:400]}")

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        # Nothing to make invalid: an operation without a body or parameters (GET /health).
    return failures


def _outcome(response) -> int | str:
    """The status, and for a 400 the parameter it names (what the fuzzer keeps tripping on)."""
    if response.status_code != 400:
        return response.status_code
    try:
        return f"400 {response.json()['error']['param']}"
    except (ValueError, KeyError, TypeError):
        return "400 ?"


def _fuzz_all(base_url: str) -> tuple[list[str], dict[str, Counter]]:
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    failures: list[str] = []
    statuses: dict[str, Counter] = defaultdict(Counter)
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            failures += _fuzz_operation(result.ok(), mode, base_url, statuses)
    return failures, statuses


async def test_fuzz_the_published_schema(gateway, responder):
    failures, statuses = await asyncio.to_thread(_fuzz_all, gateway.url)
    print("\n".join(f"{k}: {dict(v)}" for k, v in sorted(statuses.items())))
    assert len({k.rsplit(" ", 1)[0] for k in statuses}) >= 10  # every public operation was fuzzed
    assert not failures, "\n".join(failures[:20])
    # Schema-valid requests for the real model went all the way through, not only to a 4xx.
    assert statuses["POST /v1/chat/completions positive"][200] > 0, statuses
    assert statuses["POST /v1/completions positive"][200] > 0, statuses
    assert responder.requests
    # The gateway still serves an ordinary request, and registers nothing the fuzzer sent.
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=30,
                                 headers={"Authorization": "Bearer fuzz-a"}) as c:
        resp = await c.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
        assert (await c.get("/health")).json()["status"] == "ok"
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=30,
                                 headers={"Authorization": f"Bearer {OPERATOR_KEY}"}) as op:
        names = {m["name"] for m in (await op.get("/admin/models")).json()["data"]}
    assert "tiny" in names

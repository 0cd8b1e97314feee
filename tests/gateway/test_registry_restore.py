"""A request for a model while a placer writes the registry back into a Redis that lost its data
(services/gateway/service.py, `visible_model`): the model missing at the first read and the
registry intact at the next means it was restored in between, so it is read again, never
answered 404. Pure logic, with a stand-in registry; the real restore is in
tests/faults/test_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.errors import APIError
from services.gateway.service import GatewayService
from services.gateway.settings import GatewaySettings
from shared.schemas import ModelRecord

RECORD = ModelRecord(name="m", path="/models/m", weight_bytes=1, kv_bytes_per_token=1,
                     max_context=64)


class _Registry:
    """Answers `resolve_served` from `answers` in turn; intact as `intact_now` says."""

    def __init__(self, answers: list[ModelRecord | None], intact_now: bool) -> None:
        self.answers, self.intact_now, self.reads = list(answers), intact_now, 0

    async def resolve_served(self, name: str, tenant: str) -> ModelRecord | None:
        self.reads += 1
        return self.answers.pop(0)

    async def intact(self) -> bool:
        return self.intact_now


def _visible(registry: _Registry) -> ModelRecord:
    service = GatewayService(GatewaySettings(), registry, None, None, None)  # type: ignore[arg-type]
    return asyncio.run(service.visible_model("m", "t"))


def test_a_model_restored_between_the_two_reads_is_served():
    registry = _Registry([None, RECORD], intact_now=True)
    assert _visible(registry) == RECORD and registry.reads == 2


def test_a_model_missing_from_an_intact_registry_is_404():
    with pytest.raises(APIError) as err:
        _visible(_Registry([None, None], intact_now=True))
    assert err.value.status == 404


def test_a_model_missing_while_the_registry_is_lost_is_503():
    with pytest.raises(APIError) as err:
        _visible(_Registry([None], intact_now=False))
    assert err.value.status == 503

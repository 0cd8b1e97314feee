"""`shared.bus.retrying`: a JetStream call that fails the way a settling cluster makes it fail
(timeouts, no responders, "no leader" 503s) is tried again with back-off until it works or its
time is up; any other error is raised at once."""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from shared.bus import retrying


class Flaky:
    """Fails with `error` `times` times, then answers "ok"."""

    def __init__(self, error: BaseException, times: int) -> None:
        self.error, self.left, self.calls = error, times, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.left > 0:
            self.left -= 1
            raise self.error
        return "ok"


@pytest.mark.parametrize("error", [asyncio.TimeoutError(), NoRespondersError(),
                                   APIError(code=503, description="JetStream not ready")],
                         ids=["timeout", "no-responders", "503"])
async def test_a_passing_failure_is_tried_again_until_it_works(error):
    call = Flaky(error, times=3)
    assert await retrying(call, "a call", within_s=30, max_pause_s=0.01) == "ok"
    assert call.calls == 4


async def test_it_gives_up_with_the_last_error_when_the_time_is_up():
    call = Flaky(NoRespondersError(), times=1000)
    with pytest.raises(NoRespondersError):
        await retrying(call, "a call", within_s=0.3, max_pause_s=0.05)
    assert 2 <= call.calls < 1000


async def test_any_other_error_is_raised_at_once():
    call = Flaky(APIError(code=400, description="bad request"), times=1)
    with pytest.raises(APIError):
        await retrying(call, "a call", within_s=30)
    assert call.calls == 1

"""Overload control at the edge: a request the gateway cannot take is answered 429 with
Retry-After at once, before it is queued anywhere, instead of waiting in an unbounded queue.

Three limits, per gateway process (settings `SLINFER_TENANT_MAX_CONCURRENCY`,
`SLINFER_TENANT_RATE_LIMIT` / `_BURST`, `SLINFER_MODEL_MAX_QUEUE`):
- a tenant's request rate (a token bucket), checked before any work is done on the request;
- a tenant's requests in flight (submitted, not yet finished, streaming included);
- a model's requests in flight, which is the queue the placer and the model's instances have
  in front of them from this gateway.

A request with `n` choices is one request to the rate limit (one call) but `n` to both in-flight
counts: each choice is a generation of its own in the cluster, holding its own slot.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway import errors
from services.gateway.settings import GatewaySettings

CONCURRENCY_RETRY_S = 1  # a slot frees when any request of the tenant or model ends: soon


@dataclass
class _Bucket:
    tokens: float
    updated: float


class Slot:
    """One request's place in its tenant's and model's counts; `release` once it has ended."""

    def __init__(self, admission: Admission, tenant: str, model: str) -> None:
        self._admission, self.tenant, self.model = admission, tenant, model
        self._held = True

    def release(self) -> None:
        if self._held:  # idempotent: close paths may overlap
            self._held = False
            self._admission._release(self.tenant, self.model)


class Admission:
    def __init__(self, settings: GatewaySettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._s = settings
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self.tenant_in_flight: dict[str, int] = defaultdict(int)
        self.model_in_flight: dict[str, int] = defaultdict(int)

    def check_rate(self, tenant: str) -> None:
        """Take one token from the tenant's bucket, or raise 429 saying when one is there."""
        rate = self._s.tenant_rate_limit
        if rate <= 0:
            return
        now = self._clock()
        bucket = self._buckets.setdefault(tenant, _Bucket(float(self._s.tenant_rate_burst), now))
        bucket.tokens = min(float(self._s.tenant_rate_burst),
                            bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens < 1.0:
            wait = math.ceil((1.0 - bucket.tokens) / rate)
            raise _too_many(f"Rate limit reached: at most {rate:g} requests per second per tenant "
                            f"(bursts of {self._s.tenant_rate_burst}).", "rate_limit_exceeded",
                            wait)
        bucket.tokens -= 1.0

    def acquire(self, tenant: str, model: str) -> Slot:
        """A slot for one more request of `tenant` on `model` (a registry id), or 429."""
        return self.acquire_many(tenant, model, 1)[0]

    def acquire_many(self, tenant: str, model: str, count: int, param: str = "n",
                     each: str = "choice") -> list[Slot]:
        """`count` slots at once (a request's choices, or an embedding request's inputs: `each`),
        or none and 429. A count no cap could ever hold is a 400 naming `param`: waiting would
        not help."""
        cap = self._s.tenant_max_concurrency
        queue = self._s.model_max_queue
        for limit, what in ((cap, "requests in flight per tenant"),
                            (queue, "requests in flight per model")):
            if limit and count > limit:
                raise errors.invalid_request(
                    f"{param} ({count}) is more than this gateway's {limit} {what}: each "
                    f"{each} is a request in flight.", param=param, code="invalid_value")
        if cap and self.tenant_in_flight[tenant] + count > cap:
            raise _too_many(f"Too many requests in flight: at most {cap} per tenant (each of a "
                            "request's n choices counts); retry when one has finished.",
                            "concurrency_limit_exceeded", CONCURRENCY_RETRY_S)
        if queue and self.model_in_flight[model] + count > queue:
            raise _too_many(f"The model's queue is full ({queue} requests in flight); retry "
                            "shortly.", "model_queue_full", CONCURRENCY_RETRY_S)
        self.tenant_in_flight[tenant] += count
        self.model_in_flight[model] += count
        return [Slot(self, tenant, model) for _ in range(count)]

    def _release(self, tenant: str, model: str) -> None:
        for counts, key in ((self.tenant_in_flight, tenant), (self.model_in_flight, model)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]  # the maps hold only what is in flight


def _too_many(message: str, code: str, retry_after_s: int) -> errors.APIError:
    return errors.APIError(429, message, type="rate_limit_error", code=code,
                           headers={"Retry-After": str(max(1, retry_after_s))})

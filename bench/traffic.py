"""What the soaks share: one OpenAI-API request sent with httpx and everything its answer said
(status, JSON body, every server-sent event in order, or how the connection failed), random
prompts, and every process's resident memory sampled over a run.

`bench/soak.py` tallies answers by kind and status; `bench/chaos.py` judges each one (complete,
a clear error, cut, lost, answered twice, hung) against the faults it injected.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = ("the serverless cluster shares every node at token granularity while each model keeps "
         "its latency objective and the scheduler moves requests between instances").split()
DONE = "[DONE]"


def prompt(rng: random.Random, min_words: int = 8, max_words: int = 400) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


# --------------------------------------------------------------------------- one request


@dataclass
class Answer:
    """Everything a request got back. `events` are the SSE data payloads in arrival order: a
    decoded JSON object, the string "[DONE]", or the raw text of one that is neither."""

    kind: str
    stream: bool
    started: float  # monotonic
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer arrived
    body: Any = None  # the decoded JSON of a whole answer or an error answer
    events: list[Any] = field(default_factory=list)
    error: str | None = None  # the client-side failure: "<exception type>: <text>"
    hung_up: bool = False  # the client closed the stream on purpose
    timed_out: bool = False  # no end within the client's total time limit

    @property
    def error_type(self) -> str | None:
        return None if self.error is None else self.error.split(":", 1)[0]

    @property
    def outcome(self) -> str:
        """The soak's tally key: "<kind> <status>", "hangup 200" or "client error <type>"."""
        if self.error is not None:
            return f"client error {self.error_type}"
        return f"{self.kind} {self.status}"

    @property
    def error_message(self) -> str | None:
        """The message of an error answer (its JSON body), if any."""
        if self.status is None or self.status < 400:
            return None
        try:
            return str(self.body["error"]["message"])
        except (TypeError, KeyError):
            return "(no JSON error body)"


def _decode(data: str | bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data if isinstance(data, str) else data.decode(errors="replace")


async def _exchange(client: httpx.AsyncClient, path: str, payload: dict[str, Any], answer: Answer,
                    hang_up_after: int | None) -> None:
    if not answer.stream:
        r = await client.post(path, **payload)
        answer.status, answer.body = r.status_code, _decode(r.content)
        return
    async with client.stream("POST", path, **payload) as r:
        answer.status = r.status_code
        if r.status_code >= 400:
            answer.body = _decode(await r.aread())
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            answer.events.append(DONE if data == DONE else _decode(data))
            if hang_up_after is not None and len(answer.events) >= hang_up_after:
                answer.hung_up = True  # leaving the block closes the connection
                return


async def send(client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any] | bytes, *,
               stream: bool, hang_up_after: int | None = None,
               total_s: float | None = None) -> Answer:
    """POST `body` (a JSON object, or raw bytes sent as they are) to `path` and read the whole
    answer; a stream is read to its end, or closed after `hang_up_after` events. `total_s`
    bounds the whole exchange (httpx's own timeout is per read, so a trickling stream could
    outlast it)."""
    payload: dict[str, Any] = ({"content": body, "headers": {"Content-Type": "application/json"}}
                               if isinstance(body, bytes) else {"json": body})
    answer = Answer(kind, stream, time.monotonic())
    try:
        async with asyncio.timeout(total_s):
            await _exchange(client, path, payload, answer, hang_up_after)
    except TimeoutError:
        answer.timed_out, answer.error = True, f"TimeoutError: no end within {total_s}s"
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.ended = time.monotonic()
    return answer


# --------------------------------------------------------------------------- memory


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                children = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                todo.extend(int(c) for c in children)
        except OSError:
            pass
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and everything it started."""
    total = 0
    for p in _descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def sample(pids: dict[str, int], requests: int, started: float) -> dict[str, Any]:
    """One sample: seconds since `started`, requests so far, RSS in MB of each named process."""
    return {"t_s": round(time.monotonic() - started, 1), "requests": requests,
            "rss_mb": {n: round(rss_bytes(p) / 2**20, 1) for n, p in pids.items()}}


async def sampler(pids: Callable[[], dict[str, int]], requests: Callable[[], int], until: float,
                  samples: list[dict], started: float, every_s: float) -> None:
    """A sample every `every_s` and one at `until`. `pids` is asked each time: a restarted
    process has a new pid (one that is down at that moment is left out of that sample)."""
    while True:
        samples.append(sample(pids(), requests(), started))
        if time.monotonic() >= until:
            return
        await asyncio.sleep(min(every_s, max(0.0, until - time.monotonic())))

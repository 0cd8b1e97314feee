"""A steady stream of requests with the official `openai` client while a fault is injected, and
what every request ended with; a recorder of the token messages on NATS.

Each of `clients` concurrent clients sends one request after another, rotating streaming and not,
completions and chat, greedy (temperature 0) with `ignore_eos` so that every correct answer has
exactly `max_tokens` tokens and the text a fault-free run of the same prompt gives (`references`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import nats
import openai

from shared import wire
from shared.schemas import TokenMessage

PROMPTS = ("The history of the river", "A recipe for bread", "Notes on the weather",
           "Ten facts about owls")
MAX_TOKENS = 256


@dataclass
class Outcome:
    client: int
    prompt: str
    chat: bool
    stream: bool
    started: float  # monotonic
    ended: float
    text: str | None = None
    tokens: int | None = None
    finish: str | None = None
    error: str | None = None  # the exception, for the failure message
    status: int | None = None  # HTTP status of an error answer (None: no HTTP answer)
    request_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def __str__(self) -> str:
        mode = f"{'chat' if self.chat else 'completion'}{' stream' if self.stream else ''}"
        what = (f"{self.tokens} tokens, {self.finish}" if self.ok
                else f"error {self.status}: {self.error}")
        return f"[{self.client}] {mode} {self.prompt!r} {self.seconds:.1f}s: {what} ({self.request_id})"


def client_for(url: str, timeout_s: float, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                              timeout=timeout_s, http_client=httpx.AsyncClient(trust_env=False,
                                                                               timeout=timeout_s))


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, chat: bool, stream: bool,
                      index: int = 0, max_tokens: int = MAX_TOKENS) -> Outcome:
    out = Outcome(index, prompt, chat, stream, time.monotonic(), 0.0)
    common = dict(model=model, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})
    try:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if stream:
                parts, usage, finish = [], None, None
                async for c in await client.chat.completions.create(
                        messages=messages, stream=True, stream_options={"include_usage": True},
                        **common):
                    out.request_id = c.id
                    if c.choices:
                        parts.append(c.choices[0].delta.content or "")
                        finish = c.choices[0].finish_reason or finish
                    usage = c.usage or usage
                out.text, out.finish = "".join(parts), finish
                out.tokens = usage.completion_tokens if usage else None
            else:
                r = await client.chat.completions.create(messages=messages, **common)
                out.request_id, out.text = r.id, r.choices[0].message.content
                out.finish, out.tokens = r.choices[0].finish_reason, r.usage.completion_tokens
        else:
            if stream:
                parts, usage, finish = [], None, None
                async for c in await client.completions.create(
                        prompt=prompt, stream=True, stream_options={"include_usage": True},
                        **common):
                    out.request_id = c.id
                    if c.choices:
                        parts.append(c.choices[0].text or "")
                        finish = c.choices[0].finish_reason or finish
                    usage = c.usage or usage
                out.text, out.finish = "".join(parts), finish
                out.tokens = usage.completion_tokens if usage else None
            else:
                r = await client.completions.create(prompt=prompt, **common)
                out.request_id, out.text = r.id, r.choices[0].text
                out.finish, out.tokens = r.choices[0].finish_reason, r.usage.completion_tokens
        if out.finish is None or out.tokens is None:
            out.error = "the answer ended without a finish reason or usage"
    except openai.APIStatusError as exc:
        out.error, out.status = f"{type(exc).__name__}: {exc.message}", exc.status_code
    except openai.APIError as exc:  # connection errors, an error event mid-stream
        out.error = f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


def mode(k: int) -> tuple[bool, bool]:
    """(chat, stream) of a client's k-th request."""
    return bool((k // 2) % 2), k % 2 == 0


async def references(url: str, model: str, api_key: str = "unused",
                     max_tokens: int = MAX_TOKENS) -> dict[tuple[str, bool], str]:
    """The fault-free text of every (prompt, chat) the load sends."""
    client = client_for(url, 120, api_key)
    refs = {}
    try:
        for prompt in PROMPTS:
            for chat in (False, True):
                out = await one_request(client, model, prompt, chat, stream=False,
                                        max_tokens=max_tokens)
                assert out.ok and out.tokens == max_tokens, str(out)
                refs[(prompt, chat)] = out.text
    finally:
        await client.close()
    return refs


@dataclass
class Load:
    url: str
    model: str
    clients: int = 4
    timeout_s: float = 90.0  # the client's own; the gateway's deadline is shorter
    api_key: str = "unused"
    max_tokens: int = MAX_TOKENS
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    async def _client(self, i: int) -> None:
        client = client_for(self.url, self.timeout_s, self.api_key)
        try:
            k = i  # clients start at different modes
            while not self._stop.is_set():
                chat, stream = mode(k)
                out = await one_request(client, self.model, PROMPTS[i % len(PROMPTS)], chat, stream,
                                        i, self.max_tokens)
                self.outcomes.append(out)
                if not out.ok:
                    await asyncio.sleep(0.2)  # an error answer comes fast: do not spin
                k += 1
        finally:
            await client.close()

    def completed(self, since: float = 0.0) -> int:
        return sum(1 for o in self.outcomes if o.ok and o.started >= since)

    async def until(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; outcomes so far:\n"
                                     + "\n".join(map(str, self.outcomes)))
            await asyncio.sleep(0.1)

    async def stop(self) -> list[Outcome]:
        """Let every request in flight finish, then return all outcomes."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


def check(outcomes: list[Outcome], refs: dict[tuple[str, bool], str], deadline_s: float,
          allowed_status: frozenset[int] = frozenset(), allow_disconnect: bool = False,
          max_tokens: int = MAX_TOKENS) -> None:
    """Every request completed correctly (all its tokens, the fault-free text: no gap, no
    duplicate) or got a clear error (an HTTP status in `allowed_status`, or with
    `allow_disconnect` a broken connection), and none took longer than the deadline."""
    problems = []
    for o in outcomes:
        if o.seconds > deadline_s:
            problems.append(f"past the deadline: {o}")
        if o.ok:
            if o.tokens != max_tokens or o.finish != "length":
                problems.append(f"wrong length: {o}")
            elif o.text != refs[(o.prompt, o.chat)]:
                problems.append(f"text differs from the fault-free run: {o}\n  got  {o.text!r}\n"
                                f"  want {refs[(o.prompt, o.chat)]!r}")
        elif o.status is not None:
            if o.status not in allowed_status:
                problems.append(f"unexpected error status: {o}")
        elif not allow_disconnect:
            problems.append(f"no HTTP answer: {o}")
    assert not problems, "\n".join(problems) + "\n-- all outcomes --\n" + "\n".join(map(str, outcomes))


class TokenRecorder:
    """Every token message on NATS (all requests), as (request id, attempt, node, message)."""

    def __init__(self, nats_url: str) -> None:
        self.url = nats_url
        self.messages: list[TokenMessage] = []

    async def start(self) -> None:
        self.nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

        async def on_msg(msg) -> None:
            try:
                self.messages.append(wire.decode(TokenMessage, msg.data))
            except wire.WireError:
                pass

        await self.nc.subscribe("slinfer.tokens.>", cb=on_msg)

    async def close(self) -> None:
        await self.nc.close()

    def ran_twice(self) -> list[str]:
        """Requests whose one attempt ended on two different nodes (it ran twice)."""
        enders: dict[tuple[str, int], set[str]] = {}
        for m in self.messages:
            if m.finished and m.node_id:
                enders.setdefault((m.request_id, m.attempt), set()).add(m.node_id)
        return [f"{rid} attempt {a}: {sorted(n)}" for (rid, a), n in enders.items() if len(n) > 1]

    def nodes_of(self, request_id: str) -> list[tuple[int, str]]:
        """(attempt, node) pairs that streamed or announced the request, in order."""
        seen: list[tuple[int, str]] = []
        for m in self.messages:
            if m.request_id == request_id and m.node_id and (m.attempt, m.node_id) not in seen:
                seen.append((m.attempt, m.node_id))
        return seen

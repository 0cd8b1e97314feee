"""OpenAI response bodies for the two endpoints: whole responses and SSE chunks.

A format renders one choice (its `index`); a request with n choices has one per choice, and its
whole response is the first format's `whole` of every format's `choice`.

A request that asked for logprobs has a `LogprobsRenderer`: each body then carries the logprobs of
the tokens it covers (a whole response all of them, a chunk those that arrived since the last; a
chunk that covers none, such as chat's role chunk or a closing chunk, has "logprobs": null).

A chat request with tools has its output parsed for tool calls (tool_calls.py): the message's
`tool_calls`, or the chunks' `delta.tool_calls`, and finish_reason "tool_calls" where the model
stopped after calling. A chunk whose text is all held back (it may begin a call) is not sent;
its logprobs go with the next one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.gateway.logprobs import LogprobsRenderer, TokenEntry
from services.gateway.tool_calls import ToolCallStream, parse
from shared.schemas import TokenLogprob

Entries = Sequence[TokenEntry]


Usage = dict[str, int] | None  # a chunk's usage so far (continuous_usage_stats), else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _with_usage(chunk: dict[str, Any], use: Usage, include_usage: bool) -> dict[str, Any]:
    """A chunk with the usage so far (continuous usage), or "usage": null where a usage chunk
    follows at the end (include_usage), as OpenAI and vLLM write them."""
    if use is not None:
        chunk["usage"] = use
    elif include_usage:
        chunk["usage"] = None
    return chunk


@dataclass(frozen=True)
class Echo:
    """The prompt a completion repeats before its text (`echo`): its text, its token ids and
    where each one's text starts in it."""

    text: str
    token_ids: list[int]
    offsets: list[int]

    def entries(self, logprobs: Sequence[TokenLogprob]) -> list[TokenEntry]:
        """The prompt's tokens with their logprobs (one per token after the first: the first
        has none, nothing comes before it)."""
        return [TokenEntry(t, lp, offset) for t, lp, offset
                in zip(self.token_ids, [None, *logprobs], self.offsets)]


@dataclass
class CompletionFormat:
    """`text_completion` objects of POST /v1/completions. With `echo`, each choice's text begins
    with the prompt (whole: in its text; streamed: as its first chunk) and, with logprobs, so do
    its logprobs, the output's text offsets moved past the prompt."""

    id: str
    model: str
    include_usage: bool = False  # streaming: chunks carry "usage": null, then a usage chunk
    continuous_usage: bool = False  # streaming: every chunk carries the usage so far
    logprobs: LogprobsRenderer | None = None  # the request asked for logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice it renders (a request with n choices has n formats)
    echo: Echo | None = None  # the request asked for echo

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _logprobs(self, entries: Entries) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.echo is not None:  # output offsets count from the start of the prompt
            shift = len(self.echo.text)
            entries = [replace(e, offset=e.offset + shift) for e in entries]
        return self.logprobs.completion(list(entries))

    def _echoed(self, prompt: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """The prompt's part of the logprobs (echo with logprobs)."""
        if self.logprobs is None or self.echo is None:
            return None
        return self.logprobs.completion(self.echo.entries(prompt))

    def choice(self, text: str, finish_reason: str, entries: Entries = (),
               prompt: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """This choice in a whole response (`prompt`: the prompt's logprobs, for echo)."""
        logprobs = self._logprobs(entries)
        echoed = self._echoed(prompt)
        if echoed is not None and logprobs is not None:
            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        return {"index": self.index,
                "text": text if self.echo is None else self.echo.text + text,
                "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, choices: list[dict[str, Any]], use: dict[str, int]) -> dict[str, Any]:
        """The whole response, of every choice's `choice()`."""
        return {**self._base(), "choices": choices, "usage": use}

    def _chunk(self, text: str, finish_reason: str | None, use: Usage,
               entries: Entries) -> dict[str, Any]:
        return _with_usage({**self._base(), "choices": [
            {"index": self.index, "text": text,
             "logprobs": self._logprobs(entries) if entries else None,
             "finish_reason": finish_reason}]}, use, self.include_usage)

    def opening(self, use: Usage = None,
                prompt: Sequence[TokenLogprob] = ()) -> list[dict[str, Any]]:
        """The chunks before this choice's first: the echoed prompt, with its logprobs."""
        if self.echo is None:
            return []
        return [_with_usage({**self._base(), "choices": [
            {"index": self.index, "text": self.echo.text, "logprobs": self._echoed(prompt),
             "finish_reason": None}]}, use, self.include_usage)]

    def delta(self, text: str, use: Usage = None,
              entries: Entries = ()) -> dict[str, Any] | None:
        return self._chunk(text, None, use, entries)

    def closing(self, finish_reason: str, use: Usage = None, entries: Entries = ()) -> dict[str, Any]:
        return self._chunk("", finish_reason, use, entries)

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return {**self._base(), "choices": [], "usage": use}


@dataclass
class ChatFormat:
    """`chat.completion` / `chat.completion.chunk` objects of POST /v1/chat/completions."""

    id: str
    model: str
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: LogprobsRenderer | None = None  # the request asked for logprobs
    tools: bool = False  # parse tool calls out of the output
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice it renders (a request with n choices has n formats)
    _calls: ToolCallStream = field(default_factory=ToolCallStream)  # the stream's, with tools
    _held: list[TokenEntry] = field(default_factory=list)  # logprobs of a chunk not sent

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: Entries) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs.chat(list(entries))

    def _finish(self, finish_reason: str, called: bool) -> str:
        return "tool_calls" if called and finish_reason == "stop" else finish_reason

    def choice(self, text: str, finish_reason: str, entries: Entries = (),
               prompt: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """This choice in a whole response (chat echoes no prompt: `prompt` is unused)."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        calls: list[dict[str, Any]] = []
        if self.tools:
            message["content"], calls = parse(text)
            if calls:
                message["tool_calls"] = calls
        return {"index": self.index, "message": message, "logprobs": self._logprobs(entries),
                "finish_reason": self._finish(finish_reason, bool(calls))}

    def whole(self, choices: list[dict[str, Any]], use: dict[str, int]) -> dict[str, Any]:
        """The whole response, of every choice's `choice()`."""
        return {**self._base("chat.completion"), "choices": choices, "usage": use}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None, use: Usage,
               entries: Entries) -> dict[str, Any]:
        entries = [*self._held, *entries]
        self._held = []
        return _with_usage({**self._base("chat.completion.chunk"), "choices": [
            {"index": self.index, "delta": delta, "logprobs": self._logprobs(entries) if entries else None,
             "finish_reason": finish_reason}]}, use, self.include_usage)

    def _parsed(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    def opening(self, use: Usage = None,
                prompt: Sequence[TokenLogprob] = ()) -> list[dict[str, Any]]:
        """The role chunk that starts this choice (chat echoes no prompt)."""
        return [self._chunk({"role": "assistant", "content": ""}, None, use, ())]

    def delta(self, text: str, use: Usage = None,
              entries: Entries = ()) -> dict[str, Any] | None:
        """The chunk of a text delta; None where tool-call parsing holds all of it back."""
        if not self.tools:
            return self._chunk({"content": text}, None, use, entries)
        delta = self._parsed(*self._calls.feed(text))
        if not delta:
            self._held += entries
            return None
        return self._chunk(delta, None, use, entries)

    def closing(self, finish_reason: str, use: Usage = None, entries: Entries = ()) -> dict[str, Any]:
        if not self.tools:
            return self._chunk({}, finish_reason, use, entries)
        delta = self._parsed(*self._calls.finish())
        return self._chunk(delta, self._finish(finish_reason, self._calls.calls > 0), use,
                           entries)

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": use}


ResponseFormat = CompletionFormat | ChatFormat

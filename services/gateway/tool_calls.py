"""Tool calls out of a chat output (the `<tool_call>` blocks tools.py asks for), as OpenAI's
`tool_calls`: whole, or streamed as OpenAI streams them (a call's id, type and name first, with
empty arguments, then its arguments text in pieces as the model writes them).

`ToolCallStream` takes the output's text deltas and answers each with the content text that is
safe to show and the tool-call deltas it completed. One parser serves both shapes (`parse` runs
it over a whole output), so a streamed answer and a whole one agree.

Text between blocks is content. Whitespace that only separates content from a block is dropped,
and an answer of calls alone has content null. Text that could still become `<tool_call>` is
held back until it cannot. A call's arguments stream as the model writes them where it writes
`{"name": ..., "arguments": {...}}` in that order (the constrained output always does); any
other valid layout of the block is sent whole when the block closes. A block that is not a call
(not JSON, no name) is shown as the text it is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.tools import CALL_CLOSE, CALL_OPEN

# The start of a block written in the constrained layout (whitespace free): up to the arguments.
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

Delta = dict[str, Any]  # one entry of a chunk's delta.tool_calls


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _JsonValueEnd:
    """Finds where a JSON object or array that arrives in pieces ends (strings and escapes
    respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """The index in `text` just past the value's end, if it ends in `text`."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class _Block:
    """The call being read: text after `<tool_call>` not yet consumed."""

    index: int
    gap: str = ""  # the whitespace before it, shown again if it is no call
    text: str = ""
    head_sent: bool = False  # its id and name went out (arguments stream or follow)
    streaming: bool = False  # its arguments go out as they arrive (an object or array)
    scanner: _JsonValueEnd = field(default_factory=_JsonValueEnd)
    scanned: int = 0  # characters of `text` the scanner has seen
    args_start: int = 0
    args_end: int | None = None  # where the arguments value ended in `text`


class ToolCallStream:
    """Feed the output's text deltas; each answer is (content text, tool-call deltas)."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet shown: maybe the start of a block, or whitespace
        self._block: _Block | None = None
        self._after_call = False  # leading whitespace of the next content is dropped
        self.calls = 0  # tool calls begun so far

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        content: list[str] = []
        deltas: list[Delta] = []
        self._pending += text
        while True:
            if self._block is not None:
                shown = self._read_block(deltas)
                if shown is None:
                    break
                content.append(shown)
                continue
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                content.append(self._show(self._safe_text()))
                break
            before = self._pending[:start].rstrip()
            content.append(self._show(before))
            self._block = _Block(self.calls, gap=self._pending[len(before):start])
            self._pending = self._pending[start + len(CALL_OPEN):]
            self.calls += 1
        return "".join(content), _merged(deltas)

    def finish(self) -> tuple[str, list[Delta]]:
        """The end of the output: what was held back."""
        deltas: list[Delta] = []
        content = ""
        if self._block is not None:
            content = self._end_unclosed(deltas)
        else:
            content = self._show(self._pending)
        self._pending = ""
        return content, _merged(deltas)

    # -- content ---------------------------------------------------------------------------

    def _safe_text(self) -> str:
        """Take from the pending text what can be shown now: all but a tail that could begin a
        block, and the whitespace before that tail (it would separate content from a block)."""
        text = self._pending
        hold = next((k for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1)
                     if text.endswith(CALL_OPEN[:k])), 0)
        safe = text[:len(text) - hold]
        shown = safe.rstrip()
        self._pending = text[len(shown):]
        return shown

    def _show(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        return text

    # -- blocks ----------------------------------------------------------------------------

    def _read_block(self, deltas: list[Delta]) -> str | None:
        """Advance the open block with the pending text. None while it is open; once it closed
        (the text after it is pending again), the text to show for it: none for a call, the
        block itself for one that is no call."""
        block = self._block
        assert block is not None
        block.text += self._pending
        self._pending = ""
        if not block.head_sent:
            self._start_head(block, deltas)
        if block.streaming and block.args_end is None:
            self._stream_arguments(block, deltas)
        search_from = block.args_end if block.streaming else 0
        if block.streaming and search_from is None:
            return None  # a close tag inside the arguments would be inside a string
        end = block.text.find(CALL_CLOSE, search_from or 0)
        if end < 0:
            return None
        self._pending = block.text[end + len(CALL_CLOSE):]
        return self._close(block, block.text[:end], deltas)

    def _start_head(self, block: _Block, deltas: list[Delta]) -> None:
        head = HEAD.match(block.text)
        if head is None or head.end() == len(block.text):
            return  # not the streaming layout, or the value's first character is not here yet
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return
        block.head_sent = True
        deltas.append({"index": block.index, "id": call_id(), "type": "function",
                       "function": {"name": name, "arguments": ""}})
        block.args_start = block.scanned = head.end()
        block.streaming = block.text[head.end()] in "{["

    def _stream_arguments(self, block: _Block, deltas: list[Delta]) -> None:
        new = block.text[block.scanned:]
        end = block.scanner.scan(new)
        upto = len(block.text) if end is None else block.scanned + end
        if upto > block.scanned:
            deltas.append({"index": block.index,
                           "function": {"arguments": block.text[block.scanned:upto]}})
        block.scanned = upto
        if end is not None:
            block.args_end = upto

    def _close(self, block: _Block, body: str, deltas: list[Delta]) -> str:
        """The block's text is complete: finish its call (""), or give it back as text if it
        is no call."""
        self._block = None
        if block.streaming:
            self._after_call = True
            return ""  # id, name and arguments went out already
        call = _parse_call(body)
        if call is None and not block.head_sent:
            self.calls -= 1
            return self._show(f"{block.gap}{CALL_OPEN}{body}{CALL_CLOSE}")
        self._after_call = True
        if call is None:  # the name went out: the arguments are what it wrote
            arguments = body[block.args_start:].rstrip().removesuffix("}").rstrip()
            deltas.append({"index": block.index, "function": {"arguments": arguments}})
        elif block.head_sent:
            deltas.append({"index": block.index, "function": {"arguments": call[1]}})
        else:
            deltas.append({"index": block.index, "id": call_id(), "type": "function",
                           "function": {"name": call[0], "arguments": call[1]}})
        return ""

    def _end_unclosed(self, deltas: list[Delta]) -> str:
        """The output ended inside a block (max_tokens, or the model left out the close tag):
        a complete call still counts; anything else is text."""
        block = self._block
        assert block is not None
        block.text += self._pending
        self._pending = ""
        if block.streaming or block.head_sent:
            self._block = None
            if not block.streaming:
                call = _parse_call(block.text)
                if call is not None:
                    deltas.append({"index": block.index, "function": {"arguments": call[1]}})
            return ""
        call = _parse_call(block.text)
        self._block = None
        if call is None:
            self.calls -= 1
            return self._show(block.gap + CALL_OPEN + block.text)
        deltas.append({"index": block.index, "id": call_id(), "type": "function",
                       "function": {"name": call[0], "arguments": call[1]}})
        return ""


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block's JSON, or None if it is no call."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _merged(deltas: list[Delta]) -> list[Delta]:
    """One entry per call: a chunk carries a call's head and its arguments so far together."""
    out: dict[int, Delta] = {}
    for d in deltas:
        entry = out.setdefault(d["index"], {"index": d["index"]})
        for key in ("id", "type"):
            if key in d:
                entry[key] = d[key]
        function = entry.setdefault("function", {})
        if "name" in d["function"]:
            function["name"] = d["function"]["name"]
        function["arguments"] = function.get("arguments", "") + d["function"].get("arguments", "")
    return list(out.values())


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's content (None when it is only calls) and its tool calls, in OpenAI's
    message shape."""
    stream = ToolCallStream()
    content, deltas = stream.feed(text)
    rest, more = stream.finish()
    calls = {}
    for d in deltas + more:
        call = calls.setdefault(d["index"], {"id": None, "type": "function",
                                             "function": {"name": None, "arguments": ""}})
        call["id"] = d.get("id", call["id"])
        call["function"]["name"] = d["function"].get("name", call["function"]["name"])
        call["function"]["arguments"] += d["function"].get("arguments", "")
    text_out = content + rest
    return (text_out if text_out or not calls else None), [calls[i] for i in sorted(calls)]

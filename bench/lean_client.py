"""A lean HTTP/1.1 client for the latency benchmarks: one kept-alive connection on asyncio
streams, a POST with a JSON body, the response's SSE lines as they arrive (chunked transfer
decoding, nothing else).

Why: on the 2-core dev box httpx's streaming API costs ~2 ms of the client's own CPU per
streamed request (bench/path_floor.py measures it against this client on a bare server). That
is the client library's cost, paid against any server; a benchmark of the request path's
overhead that counted it would put it on slinfer's side. The benches report both.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class LeanClient:
    """`async with LeanClient(base_url) as c: async for line in c.post_sse(path, body): ...`
    One request at a time on one connection (the benchmarks send them in sequence)."""

    def __init__(self, base_url: str, timeout_s: float = 60.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"an http:// URL with a host, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> LeanClient:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()

    async def post_sse(self, path: str, body: dict[str, Any]) -> AsyncIterator[str]:
        """POST `body` as JSON; yield each line of the streamed response (without its line
        end). Raises RuntimeError on a status other than 200."""
        assert self._reader is not None and self._writer is not None, "not connected"
        payload = json.dumps(body).encode()
        self._writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
            + payload)
        status, headers = await asyncio.wait_for(self._head(), self.timeout_s)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await self._rest(headers)).decode()[:500]}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError("expected a chunked (streamed) response")
        pending = b""
        while (chunk := await asyncio.wait_for(self._chunk(), self.timeout_s)) is not None:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()

    async def _head(self) -> tuple[int, dict[str, str]]:
        assert self._reader is not None
        status = int((await self._reader.readline()).split()[1])
        headers: dict[str, str] = {}
        while (line := await self._reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _chunk(self) -> bytes | None:
        """One chunk of a chunked body; None after the last (empty) one."""
        assert self._reader is not None
        size = int((await self._reader.readline()).split(b";")[0], 16)
        data = await self._reader.readexactly(size + 2)  # and its CRLF
        if size == 0:
            return None
        return data[:-2]

    async def _rest(self, headers: dict[str, str]) -> bytes:
        """The whole body of a response that is not streamed (an error)."""
        assert self._reader is not None
        if headers.get("transfer-encoding") == "chunked":
            out = b""
            while (chunk := await self._chunk()) is not None:
                out += chunk
            return out
        return await self._reader.readexactly(int(headers.get("content-length", "0")))

"""A request's `n` choices (OpenAI's `n`), one `Generation` each, read as one.

Each choice is a request of its own to the cluster, placed, scheduled and admitted like any, so
the choices run side by side and their output arrives interleaved. `events()` hands it out in
arrival order, each piece tagged with its choice's index. The first choice that fails ends the
read with its error: one failed choice fails the whole request, and `close()` then cancels the
others on their nodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import anyio

from services.gateway.generation import Generation
from services.gateway.logprobs import TokenEntry


@dataclass(frozen=True)
class ChoiceEvent:
    """A piece of one choice's output: a text delta, or its end (`text` None; its
    `finish_reason` is set then). `entries` are the logprobs not handed out before: taken with
    a delta that has text or with the end, so that an empty delta's (text held back) go with the
    next piece of the same choice."""

    index: int
    text: str | None
    entries: list[TokenEntry] = field(default_factory=list)


async def _choice_events(index: int, gen: Generation) -> AsyncIterator[ChoiceEvent]:
    async for text in gen.deltas():
        # Taken here, before the generation reads on: a choice read in its own task runs
        # ahead of the consumer, and its later tokens' logprobs must not join this delta.
        yield ChoiceEvent(index, text, gen.take_logprobs() if text else [])
    yield ChoiceEvent(index, None, gen.take_logprobs())


class Choices:
    """The generations of one request's choices, index i at position i. `events()` may be
    iterated once; `close()` must run however the reading ends (idempotent)."""

    def __init__(self, generations: list[Generation]) -> None:
        if not generations:
            raise ValueError("a request has at least one choice")
        self.generations = generations
        self.created = int(time.time())  # the response's `created`, the same in every chunk
        self._readers: list[asyncio.Task] = []  # one per choice while n > 1 is read

    def __len__(self) -> int:
        return len(self.generations)

    def __iter__(self) -> Iterator[Generation]:
        return iter(self.generations)

    def __getitem__(self, index: int) -> Generation:
        return self.generations[index]

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.generations)

    def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's deltas and end, as they come. Raises the first choice's failure
        (errors.APIError) as soon as it happens."""
        if len(self.generations) == 1:  # no interleaving to do: read it in the caller's task
            return _choice_events(0, self.generations[0])
        return self._interleaved()

    async def _interleaved(self) -> AsyncIterator[ChoiceEvent]:
        queue: asyncio.Queue[ChoiceEvent | Exception] = asyncio.Queue()

        async def read(index: int, gen: Generation) -> None:
            try:
                async for event in _choice_events(index, gen):
                    queue.put_nowait(event)
            except Exception as exc:  # this choice failed: the request fails with it
                queue.put_nowait(exc)

        self._readers = [asyncio.create_task(read(i, g)) for i, g in enumerate(self.generations)]
        try:
            running = len(self._readers)
            while running:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.text is None:
                    running -= 1
                yield item
        finally:
            await self._stop_readers()

    async def _stop_readers(self) -> None:
        readers, self._readers = self._readers, []
        for task in readers:
            task.cancel()
        if readers:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*readers, return_exceptions=True)

    async def close(self, reason: str = "client disconnected") -> None:
        """Stop reading, and close every choice: each one still running is cancelled on its
        node with `reason` (one that failed or finished is not)."""
        with anyio.CancelScope(shield=True):
            await self._stop_readers()
            for gen in self.generations:
                await gen.close(reason)

"""NATS connection and the JetStream streams every service relies on."""

from __future__ import annotations

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from shared.subjects import (CANCEL_STREAM, CANCEL_SUBJECT, MEMOP_STREAM, MEMOP_SUBJECT_PREFIX,
                             REQUEST_DEDUP_WINDOW_S, REQUEST_STREAM, REQUEST_SUBJECT)

STREAM_MAX_AGE_S = 3600.0


async def connect(url: str, name: str) -> NATS:
    # Keep reconnecting forever: a NATS restart must not take a service down with it.
    return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5)


async def _ensure(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError:  # another service created it meanwhile
            await js.stream_info(config.name)


async def ensure_streams(js: JetStreamContext) -> None:
    """The request stream (work queue for placers, dedup by Nats-Msg-Id), the
    reservation-station stream of memory-op completions, and the cancel stream (what placers
    replay at start, so a cancel sent while no placer ran still counts)."""
    # Limits retention with a max age: the placers' durable consumer tracks what is done, and a
    # day-old request is worthless anyway.
    await _ensure(js, StreamConfig(
        name=REQUEST_STREAM, subjects=[REQUEST_SUBJECT], duplicate_window=REQUEST_DEDUP_WINDOW_S,
        max_age=STREAM_MAX_AGE_S))
    await _ensure(js, StreamConfig(
        name=MEMOP_STREAM, subjects=[f"{MEMOP_SUBJECT_PREFIX}.>"], max_age=STREAM_MAX_AGE_S))
    # As long as the requests it may cancel: an older cancel can match nothing left to place.
    await _ensure(js, StreamConfig(name=CANCEL_STREAM, subjects=[CANCEL_SUBJECT],
                                   max_age=STREAM_MAX_AGE_S))

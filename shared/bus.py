"""NATS connection, the JetStream streams every service relies on, and publishing to them across
a stream-leader election.

In a NATS cluster (issue 23, measured with three servers): a stream whose leader dies answers no
publish for about 5 s (NoStreamResponseError, timeouts) while its replicas elect a new one, and
a fresh cluster has no JetStream meta leader for its first seconds, during which creating a
stream times out. So publishes that must not be lost are retried with the same `Nats-Msg-Id`
(the stream drops the copy of a try that was stored with only its acknowledgement lost), and
stream creation waits, bounded, for the meta leader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.errors import ConnectionReconnectingError, NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import PubAck, StreamConfig
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError, NotFoundError

from shared.settings import nats_servers
from shared.subjects import (CANCEL_STREAM, CANCEL_SUBJECT, MEMOP_STREAM, MEMOP_SUBJECT_PREFIX,
                             REQUEST_DEDUP_WINDOW_S, REQUEST_STREAM, REQUEST_SUBJECT)

log = logging.getLogger("slinfer.bus")

STREAM_MAX_AGE_S = 3600.0
# Longer than a stream-leader election (4.2-4.8 s measured) with room for a slow one.
PUBLISH_RETRY_S = 15.0
PUBLISH_TRY_TIMEOUT_S = 2.0
FIRST_PAUSE_S, MAX_PAUSE_S = 0.1, 1.0
START_RETRY_S = 60.0  # a service's JetStream set-up waits this long for a cluster to settle
T = TypeVar("T")
# A fresh cluster elects its meta leader and learns its peers within seconds.
STREAM_SETUP_S = 30.0
# JetStream API errors that pass: unavailable (no meta leader yet), insufficient resources (a
# peer of a forming cluster not known yet; also what one server answers to 3 replicas).
_PASSING_ERR_CODES = frozenset({10008, 10074})
_PASSING = (TimeoutError, NoStreamResponseError, NoRespondersError, ConnectionReconnectingError)


async def connect_nats(url_setting: str, name: str, **kw) -> NATS:
    """Connect to the servers of SLINFER_NATS_URL (one URL or a comma-separated list: nats-py
    takes a list). Reconnects forever unless `kw` says otherwise: a NATS restart must not take a
    service down with it."""
    options = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, **kw}
    return await nats.connect(servers=nats_servers(url_setting), name=name, **options)


def passing(exc: BaseException) -> bool:
    """Whether a JetStream call that raised `exc` may work if tried again shortly: no stream
    leader or meta leader yet, a timeout, a reconnecting client."""
    if isinstance(exc, _PASSING):
        return True
    return isinstance(exc, APIError) and (exc.code == 503 or exc.err_code in _PASSING_ERR_CODES)


async def retrying(call: Callable[[], Awaitable[T]], what: str, *, within_s: float,
                   max_pause_s: float = MAX_PAUSE_S) -> T:
    """`call()`, tried again with back-off while its failure is `passing` and `within_s` lasts
    (0: one try); raises the last error. A JetStream request made while the cluster elects a
    leader (a restart, a failover, or a service starting right after its servers) fails so for
    seconds."""
    give_up = time.monotonic() + within_s
    pause = FIRST_PAUSE_S
    while True:
        try:
            return await call()
        except Exception as exc:
            if not passing(exc) or time.monotonic() + pause >= give_up:
                raise
            log.info("%s failed, retrying in %.1fs: %r", what, pause, exc)
        await asyncio.sleep(pause)
        pause = min(max_pause_s, pause * 2)


async def publish_retrying(js: JetStreamContext, subject: str, payload: bytes,
                           headers: dict[str, str], *, within_s: float = PUBLISH_RETRY_S,
                           try_timeout_s: float = PUBLISH_TRY_TIMEOUT_S,
                           max_pause_s: float = MAX_PAUSE_S) -> PubAck:
    """Publish, retried with the same headers while the failure `passing` and `within_s` lasts
    (0: one try). The headers must carry a `Nats-Msg-Id`: without one a try stored with only its
    ack lost would be stored twice. Raises the last error."""
    if "Nats-Msg-Id" not in headers:
        raise ValueError("publish_retrying needs a Nats-Msg-Id header")
    return await retrying(
        lambda: js.publish(subject, payload, headers=headers, timeout=try_timeout_s),
        f"publish to {subject} ({headers['Nats-Msg-Id']})", within_s=within_s,
        max_pause_s=max_pause_s)


async def ensure_stream(js: JetStreamContext, config: StreamConfig, replicas: int | None = None,
                        within_s: float = STREAM_SETUP_S) -> None:
    """Create the stream with `replicas` copies, or set an existing one's count to `replicas`
    when it differs (None: create with one, leave an existing one as it is). Waits, bounded,
    while JetStream cannot answer yet (a cluster without its meta leader)."""
    give_up = time.monotonic() + within_s
    pause = FIRST_PAUSE_S
    while True:
        try:
            return await _ensure_once(js, config, replicas)
        except Exception as exc:
            if not passing(exc):
                raise
            if time.monotonic() + pause >= give_up:
                raise RuntimeError(
                    f"JetStream did not create stream {config.name} with {replicas or 1} "
                    f"replica(s) in {within_s:.0f}s: {exc!r}. Is every NATS server of the "
                    f"cluster up (a cluster elects its meta leader once most are), and "
                    f"SLINFER_STREAM_REPLICAS no more than the servers?") from exc
            log.info("stream %s not ready (%r); retrying in %.1fs", config.name, exc, pause)
        await asyncio.sleep(pause)
        pause = min(MAX_PAUSE_S * 2, pause * 2)


async def _ensure_once(js: JetStreamContext, config: StreamConfig, replicas: int | None) -> None:
    wanted = dataclasses.replace(config, num_replicas=replicas or 1)
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(wanted)
            return
        except BadRequestError:  # another service created it meanwhile
            info = await js.stream_info(config.name)
    if replicas is not None and (info.config.num_replicas or 1) != replicas:
        log.info("stream %s: %s -> %d replicas", config.name, info.config.num_replicas, replicas)
        await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))
        await _until_current(js, config.name, replicas)


async def _until_current(js: JetStreamContext, stream: str, replicas: int,
                         within_s: float = STREAM_SETUP_S) -> None:
    """Wait (bounded; logged, not raised) until the stream's added replicas caught up. Until
    then the stream's one old copy is its only one: a leader lost before that leaves a stream
    that elects no leader (measured: no publish for 30 s after R1 -> R3 and a kill at once)."""
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        cluster = (await js.stream_info(stream)).cluster
        if cluster is None:  # one server, not a cluster: nothing to catch up
            return
        if cluster.leader and sum(1 for p in cluster.replicas or [] if p.current) >= replicas - 1:
            return
        await asyncio.sleep(0.2)
    log.warning("stream %s: its %d replicas not current after %.0fs", stream, replicas, within_s)


async def ensure_streams(js: JetStreamContext, replicas: int | None = None) -> None:
    """The request stream (work queue for placers, dedup by Nats-Msg-Id), the
    reservation-station stream of memory-op completions, and the cancel stream (what placers
    replay at start, so a cancel sent while no placer ran still counts), each with `replicas`
    copies (SLINFER_STREAM_REPLICAS; see `ensure_stream`)."""
    # Limits retention with a max age: the placers' durable consumer tracks what is done, and a
    # day-old request is worthless anyway.
    await ensure_stream(js, StreamConfig(
        name=REQUEST_STREAM, subjects=[REQUEST_SUBJECT], duplicate_window=REQUEST_DEDUP_WINDOW_S,
        max_age=STREAM_MAX_AGE_S), replicas)
    await ensure_stream(js, StreamConfig(
        name=MEMOP_STREAM, subjects=[f"{MEMOP_SUBJECT_PREFIX}.>"], max_age=STREAM_MAX_AGE_S),
        replicas)
    # As long as the requests it may cancel: an older cancel can match nothing left to place.
    await ensure_stream(js, StreamConfig(name=CANCEL_STREAM, subjects=[CANCEL_SUBJECT],
                                         max_age=STREAM_MAX_AGE_S), replicas)

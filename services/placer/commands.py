"""The placer's node commands: one request-reply on a node's command subject, its answer or
None (no answer in time, an undecodable answer, or no node there). Callers decide what a
missing answer means."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeout

from shared import telemetry as tm
from shared import wire
from shared.cluster import decode_reply
from shared.core.startup import StartupChoice, StartupMethod
from shared.schemas import NodeCommand, NodeReply
from shared.subjects import node_command_subject

log = logging.getLogger("slinfer.placer")


async def send_command(nc: NATS, node_id: str, cmd: NodeCommand,
                       timeout_s: float) -> NodeReply | None:
    """The node's reply, or None; the current span's context rides the command's headers."""
    try:
        msg = await nc.request(node_command_subject(node_id), wire.encode(cmd),
                               timeout=timeout_s, headers=tm.inject_headers())
        return decode_reply(msg.data, time.time())  # its view on our clock
    except (NatsTimeout, asyncio.TimeoutError, wire.WireError) as exc:
        log.warning("node %s did not answer: %s", node_id, exc)
        return None
    except Exception as exc:  # e.g. no responders: the node is gone
        log.warning("node %s unreachable: %s", node_id, exc)
        return None


def with_startup(cmd: NodeCommand, startup: StartupChoice) -> NodeCommand:
    """A new instance's command with its startup: the multicast the node's load waits for
    (MULTICAST, or PIPELINE: serving through a pipeline meanwhile); TIER: unchanged."""
    if startup.method is StartupMethod.TIER:
        return cmd
    return replace(cmd, multicast_s=startup.arrive_s, pipeline=startup.pipeline)

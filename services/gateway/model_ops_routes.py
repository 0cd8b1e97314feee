"""Loading and unloading a registered model now (Ollama's preload and `keep_alive: 0`):
`POST /admin/models/{name}/preload` and `POST /admin/models/{name}/unload`, for whoever may
change the model (its owner, the operator).

Both leave the decisions to the core. A preload is a warm-up request (one prompt token, one
output token) placed and admitted like any request, so the instance it starts, or the one it
finds warm, is where the core would put a request; the answer names the model's instances once
it has run. An unload asks each node holding an instance of the model to unload it
(`NodeScheduler.unload_model`): idle instances go at once, busy ones when their requests end.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter

from services.gateway import errors
from services.gateway.admin_routes import changeable_model
from services.gateway.deps import Caller, Context, OptionalBody
from services.gateway.openapi_docs import ADMIN_ERRORS, json_body
from services.gateway.service import Prepared
from services.gateway.tokenization import tokenizer_eos_ids
from services.gateway.validation import SamplingParams, _Strict, keep_alive_seconds, parse_body
from shared import wire
from shared.cluster import PRELOAD_ID_PREFIX, decode_reply, read_nodes
from shared.core.types import InstanceStatus, NodeView
from shared.schemas import CommandKind, ModelRecord, NodeCommand
from shared.subjects import node_command_subject

log = logging.getLogger("slinfer.gateway")
router = APIRouter(prefix="/admin", responses=ADMIN_ERRORS)
UNLOAD_TIMEOUT_S = 5.0
VIEW_WAIT_S = 2.0  # a few node heartbeats


_OPTIONAL_BODY = json_body("PreloadModel")
_OPTIONAL_BODY["requestBody"]["required"] = False  # no body: the model's own keep-alive


class PreloadModel(_Strict):
    # The warm instance's keep-alive from now on (as a request's keep_alive; absent: the
    # model's registered one).
    keep_alive: float | str | None = None


@router.post("/models/{name:path}/preload", response_model=None,
             openapi_extra=_OPTIONAL_BODY)
async def preload_model(name: str, caller: Caller, raw: OptionalBody,
                        ctx: Context) -> dict[str, Any]:
    """Start (or keep warm) an instance of the model now, where the core places a request."""
    body = parse_body(PreloadModel, raw) if raw.strip() else PreloadModel()
    record = await changeable_model(ctx, name, caller, "preload")
    if record.base_model is not None:
        raise errors.invalid_request(f"{name!r} is a LoRA adapter: preload its base model.",
                                     param="name", code="invalid_value")
    service = ctx.service
    tokenizer = await service.tokenizer_for(record)
    params = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, seed=None, stop=(),
                            stream=False, include_usage=False, ignore_eos=True,
                            keep_alive_s=keep_alive_seconds(body.keep_alive))
    prompt = (list(record.eos_token_ids) or tokenizer_eos_ids(tokenizer) or [0])[:1]
    prepared = Prepared(record=record, tokenizer=tokenizer, prompt_ids=prompt, params=params,
                        max_tokens=1)
    choices = await service.start(prepared, f"{PRELOAD_ID_PREFIX}{uuid.uuid4().hex}",
                                  record.owner or caller.tenant, "preload")
    run = choices[0]
    try:
        async for _ in run.deltas():  # to its end; a failure is raised as the API error it is
            pass
    finally:
        await run.close("preload ended")
    log.info("preloaded model %s", record.name)
    return {"object": "model.preload", "model": name,
            "instances": await _instances_seen(ctx, record.name)}


async def _instances_seen(ctx: Context, model: str) -> list[dict[str, Any]]:
    """The model's instances once the nodes' views show one (they are published every
    heartbeat, so the admission may not be in them yet); after VIEW_WAIT_S, what they show."""
    deadline = time.monotonic() + VIEW_WAIT_S
    while True:
        found = _instances(await read_nodes(ctx.redis), model)
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


@router.post("/models/{name:path}/unload", response_model=None)
async def unload_model(name: str, caller: Caller, ctx: Context) -> dict[str, Any]:
    """Unload every instance of the model: idle ones now, busy ones when their requests end."""
    record = await changeable_model(ctx, name, caller, "unload")
    if record.min_instances > 0:
        raise errors.APIError(409, f"{name!r} is pinned (min_instances {record.min_instances}): "
                              "set min_instances to 0 first (PATCH /admin/models/{name}).",
                              param="name", code="model_pinned")
    holders = [n for n in await read_nodes(ctx.redis) if _instances([n], record.name)]
    views = [await _unload_on(ctx, n.node_id, record) for n in holders]
    left = _instances([v for v in views if v is not None], record.name)
    log.info("unloading model %s on %d node(s)", record.name, len(holders))
    return {"object": "model.unload", "model": name, "nodes": [n.node_id for n in holders],
            "instances": left}  # the ones that wait for their requests to end


async def _unload_on(ctx: Context, node_id: str, record: ModelRecord) -> NodeView | None:
    """The node's view after it unloaded what it could (None: it did not answer: its instances
    go when its heartbeat stops or it comes back and they idle out)."""
    cmd = NodeCommand(CommandKind.UNLOAD_MODEL, model=record)
    try:
        msg = await ctx.nc.request(node_command_subject(node_id), wire.encode(cmd),
                                   timeout=UNLOAD_TIMEOUT_S)
    except Exception:  # no responders, timeout
        log.warning("node %s did not answer the unload of %s", node_id, record.name)
        return None
    return decode_reply(msg.data, time.time()).node


def _instances(nodes: list[NodeView], model: str) -> list[dict[str, Any]]:
    """The model's instances that are (or will be) serving: not on their way out."""
    return [{"node_id": n.node_id, "instance_id": i.instance_id, "status": i.status.value,
             "keep_alive_s": i.keep_alive_s, "pinned": i.pinned, "batch_size": i.batch_size}
            for n in nodes for i in n.instances
            if i.model.name == model and i.status is not InstanceStatus.UNLOADING]


"""Admin API: register, list and delete models; read the cluster view (nodes, instances).

A tenant manages its own private models and the public ones; other tenants' private models do not
exist for it (404), and instances of them are left out of the cluster view it reads.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.gateway import errors
from services.gateway.deps import Context, RawBody, Registry, Tenant
from services.gateway.validation import _Strict, parse_body
from shared import wire
from shared.core.types import SLO_CLASSES, NodeView
from shared.registry import ModelDirError, ModelExistsError, model_record_from_dir, visible_to
from shared.subjects import NODES_SET, node_key

log = logging.getLogger("slinfer.gateway")
router = APIRouter(prefix="/admin")

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


class RegisterModel(_Strict):
    name: str
    path: str  # Hugging Face directory on the gateway's and nodes' filesystem
    engine: Literal["torch", "openvino", "vllm"] = "torch"
    slo_class: str = "standard"
    public: bool = False  # public: every tenant sees it; else private to the caller's tenant
    base_model: str | None = None  # set for a LoRA adapter: the model it applies to
    replace: bool = False  # overwrite an existing model of that name (one the caller may see)


@router.post("/models", status_code=201)
async def register_model(tenant: Tenant, raw: RawBody, ctx: Context) -> JSONResponse:
    body = parse_body(RegisterModel, raw)
    if not MODEL_NAME.fullmatch(body.name) or ".." in body.name:
        raise errors.invalid_request("name must be 1-128 characters of letters, digits and ._:/@+- "
                                     "starting with a letter or digit.", param="name", code="invalid_value")
    if body.slo_class not in SLO_CLASSES:
        raise errors.invalid_request(f"slo_class must be one of {sorted(SLO_CLASSES)}.", param="slo_class",
                                     code="invalid_value")
    base = None
    if body.base_model is not None:
        base = await ctx.registry.get_visible(body.base_model, tenant)
        if base is None:
            raise errors.APIError(404, f"The base model {body.base_model!r} does not exist or you do not "
                                  "have access to it.", param="base_model", code="model_not_found")
    try:
        record = await asyncio.to_thread(
            model_record_from_dir, body.name, body.path, engine=body.engine, slo_class=body.slo_class,
            owner=None if body.public else tenant, base=base)
    except ModelDirError as exc:
        raise errors.invalid_request(str(exc), param="path", code="invalid_model_dir") from None
    if body.replace:
        existing = await ctx.registry.get(body.name)
        if existing is not None and not visible_to(existing, tenant):
            raise _name_taken(body.name)
    try:
        await ctx.registry.register(record, replace=body.replace)
    except ModelExistsError:
        raise _name_taken(body.name) from None
    ctx.service.tokenizers.forget(record.path)
    log.info("tenant %s registered model %s (%s, %s)", tenant, record.name, record.engine, record.path)
    return JSONResponse(wire.to_plain(record), status_code=201)


def _name_taken(name: str) -> errors.APIError:
    return errors.APIError(409, f"A model named {name!r} is already registered; pick another name "
                           "(or set replace=true for your own model).", param="name", code="model_exists")


@router.get("/models")
async def list_registered(tenant: Tenant, registry: Registry) -> dict[str, Any]:
    return {"object": "list", "data": [wire.to_plain(r) for r in await registry.list(tenant)]}


@router.delete("/models/{name:path}")
async def delete_model(name: str, tenant: Tenant, ctx: Context) -> dict[str, Any]:
    record = await ctx.registry.get_visible(name, tenant)
    if record is None or not await ctx.registry.delete(name):
        raise errors.model_not_found(name)
    ctx.service.tokenizers.forget(record.path)
    log.info("tenant %s deleted model %s", tenant, name)
    return {"id": name, "object": "model", "deleted": True}


async def _nodes(ctx: Context, tenant: str) -> list[NodeView]:
    """Live node views (expired keys skipped), instances limited to models `tenant` may see."""
    ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await ctx.redis.smembers(NODES_SET))
    if not ids:
        return []
    raw = await ctx.redis.mget([node_key(i) for i in ids])
    visible = {r.name for r in await ctx.registry.list(tenant)}
    nodes = []
    for node_id, data in zip(ids, raw):
        if data is None:
            continue
        try:
            node = wire.decode(NodeView, data)
        except wire.WireError:
            log.warning("undecodable view of node %s skipped", node_id)
            continue
        node.instances = [i for i in node.instances if i.model.name in visible]
        nodes.append(node)
    return nodes


@router.get("/nodes")
async def list_nodes(tenant: Tenant, ctx: Context) -> dict[str, Any]:
    return {"object": "list", "data": [wire.to_plain(n) for n in await _nodes(ctx, tenant)]}


@router.get("/instances")
async def list_instances(tenant: Tenant, ctx: Context) -> dict[str, Any]:
    data = []
    for node in await _nodes(ctx, tenant):
        for inst in node.instances:
            data.append({"instance_id": inst.instance_id, "node_id": node.node_id,
                         "hardware": node.hardware.value, "model": inst.model.name,
                         "status": inst.status.value, "batch_size": inst.batch_size,
                         "kv_bytes": inst.kv_bytes, "weight_bytes": inst.model.weight_bytes,
                         "last_active": inst.last_active,
                         "requests": [r.request_id for r in inst.requests]})
    return {"object": "list", "data": data}

"""Admin API: register, list and delete models; read the cluster view (nodes, instances).

Who may do what:
- a tenant registers, replaces and deletes its own private models, from its own directory
  (`SLINFER_TENANT_MODELS_DIR/<tenant>`), under names private to it (two tenants may each own a
  "foo"); it lists its own and the public models, without their server paths;
- the operator (an operator key, or the caller of a gateway without auth) also registers,
  replaces and deletes public models, from `SLINFER_MODEL_ROOTS`, and sees and deletes any model.
Another tenant's private model does not exist for a tenant (404), and its instances are left out
of the cluster view.

Registering a model starts its lifecycle (`services.gateway.lifecycle`): it is converted and
profiled on each hardware kind of the cluster by the profiler services, and every model view
(`POST`, `GET /admin/models`, `GET /admin/models/{name}`) carries `lifecycle`: the state
(`converting`, `profiling`, `ready`, `failed`) per hardware kind with its progress and reason.

Aliases: `POST /admin/models/{name}/aliases` gives a model one more name that requests may call
it by (`GET /admin/aliases` lists them, `DELETE /admin/aliases/{alias}` removes one). An alias
belongs to its model's owner: whoever may change the model may alias it, and whoever sees the
model sees the alias. One name means one thing in each tenant's view: an alias may not take a
name a model or another alias holds there, nor a model an alias's. Model views list their
aliases; deleting a model deletes its aliases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.gateway import errors, lifecycle
from services.gateway.auth import Principal
from services.gateway.deps import Caller, Context, RawBody
from services.gateway.openapi_docs import (ADMIN_ERRORS, ALIAS, ALIAS_LIST, DELETED, INSTANCE_LIST,
                                           MODEL_RECORD, NODE_LIST, RECORD_LIST, json_body)
from services.gateway.paths import confined_model_dir
from services.gateway.record_cache import announce_change
from services.gateway.validation import _Strict, keep_alive_seconds, parse_body
from shared import wire
from shared.cluster import decode_node
from shared.core.types import SLO_CLASSES, NodeView
from shared.model_state import forget as forget_state
from shared.registry import (PRIVATE_SEPARATOR, ModelDirError, ModelExistsError, aliases_of,
                             display_name, model_id, model_record_from_dir, strip_owner)
from shared.schemas import ModelRecord
from shared.subjects import NODES_SET, node_key

log = logging.getLogger("slinfer.gateway")
router = APIRouter(prefix="/admin", responses=ADMIN_ERRORS)

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")  # no "~": see shared.registry


class RegisterModel(_Strict):
    name: str
    path: str  # Hugging Face directory on the gateway's and nodes' filesystem
    engine: Literal["torch", "openvino", "vllm"] = "torch"
    slo_class: str = "standard"
    public: bool = False  # public (operator only): every tenant sees it; else the caller's own
    base_model: str | None = None  # set for a LoRA adapter: the model it applies to
    replace: bool = False  # overwrite the caller's own model of that name
    # POST /v1/embeddings for this model: how its last hidden states pool into a vector (mean,
    # last token, first token), whether it is L2-normalised, and whether a request may ask for
    # a shorter vector (`dimensions`: only a matryoshka-trained model's prefixes are embeddings).
    pooling: Literal["mean", "last", "cls"] = "mean"
    normalize: bool = True
    matryoshka: bool = False
    # How long an idle instance stays loaded (seconds or a duration such as "5m"; 0: unload at
    # once; negative: never; absent: the cluster's default), and the warm instances the cluster
    # keeps of it (> 0: pinned, its instances are never reclaimed as idle).
    keep_alive: float | str | None = None
    min_instances: int = 0


class UpdateModel(_Strict):
    """PATCH /admin/models/{name}: the serving settings of a registered model. A field left
    out stays; `keep_alive: null` goes back to the cluster's default."""

    keep_alive: float | str | None = None
    min_instances: int | None = None
    slo_class: str | None = None  # its requests' SLOs from now on (no new profile needed)


class AddAlias(_Strict):
    alias: str  # the new name; owned, and so seen, as the model is


def _forbidden(message: str, param: str | None = None) -> errors.APIError:
    return errors.APIError(403, message, type="permission_error", param=param,
                           code="permission_denied")


def _check_slo_class(slo_class: str) -> None:
    if slo_class not in SLO_CLASSES:
        raise errors.invalid_request(f"slo_class must be one of {sorted(SLO_CLASSES)}.",
                                     param="slo_class", code="invalid_value")


def _check_name(body: RegisterModel) -> None:
    _check_model_name(body.name, "name")
    _check_slo_class(body.slo_class)


def _check_model_name(name: str, param: str) -> None:
    if not MODEL_NAME.fullmatch(name) or ".." in name:
        raise errors.invalid_request(f"{param} must be 1-128 characters of letters, digits and "
                                     "._:/@+- starting with a letter or digit.", param=param,
                                     code="invalid_value")


def _allowed_roots(ctx: Context, caller: Principal) -> list | None:
    """Where `caller` may register from; None: anywhere (an operator with no roots set)."""
    if caller.operator:
        return list(ctx.settings.model_roots) or None
    root = ctx.settings.tenant_model_root(caller.tenant)
    if root is None:
        raise _forbidden("Model registration by tenants is not enabled on this gateway; ask the "
                         "operator.")
    return [root]


@router.post("/models", status_code=201, response_model=None,
             openapi_extra=json_body("RegisterModel"), responses={201: MODEL_RECORD})
async def register_model(caller: Caller, raw: RawBody, ctx: Context) -> JSONResponse:
    body = parse_body(RegisterModel, raw)
    _check_name(body)
    if body.public and not caller.operator:
        raise _forbidden("Only the operator may register public models.", param="public")
    owner = None if body.public else caller.tenant
    path = confined_model_dir(body.path, _allowed_roots(ctx, caller))
    base = await _base_model(ctx, body.base_model, caller.tenant)
    try:
        record = await asyncio.to_thread(
            model_record_from_dir, model_id(body.name, owner), path, engine=body.engine,
            slo_class=body.slo_class, owner=owner, base=base)
    except ModelDirError as exc:
        raise errors.invalid_request(str(exc), param="path", code="invalid_model_dir") from None
    record = dataclasses.replace(record, pooling=body.pooling, normalize=body.normalize,
                                 matryoshka=body.matryoshka,
                                 keep_alive_s=keep_alive_seconds(body.keep_alive),
                                 min_instances=_min_instances(body.min_instances))
    await _check_no_clash(ctx, body.name, owner)
    previous = await ctx.registry.get(record.name)
    try:
        await ctx.registry.register(record, replace=body.replace)
    except ModelExistsError:
        raise _name_taken(body.name) from None
    await registry_changed(ctx)
    ctx.service.tokenizers.forget(record.path)
    log.info("%s registered model %s (%s, %s)", _who(caller), record.name, record.engine,
             record.path)
    status = await lifecycle.start(ctx.nc, ctx.redis, record, previous,
                                   ctx.settings.profile_hardware)
    view = model_view(record, caller, await ctx.registry.aliases())
    view["lifecycle"] = lifecycle.view(status, set(), None if caller.operator else record.path)
    return JSONResponse(view, status_code=201)


def _min_instances(value: int) -> int:
    if value < 0:
        raise errors.invalid_request(f"min_instances must be >= 0, got {value}.",
                                     param="min_instances", code="invalid_value")
    return value


@router.patch("/models/{name:path}", response_model=None, openapi_extra=json_body("UpdateModel"),
              responses={200: MODEL_RECORD})
async def update_model(name: str, caller: Caller, raw: RawBody, ctx: Context) -> dict[str, Any]:
    """Change a model's keep-alive, pinning or SLO class. New instances, and existing ones at their next
    request, follow it; `POST /admin/models/{name}/unload` unloads the loaded ones now."""
    body = parse_body(UpdateModel, raw)
    record = await changeable_model(ctx, name, caller, "change")
    changes: dict[str, Any] = {}
    if "keep_alive" in body.model_fields_set:
        changes["keep_alive_s"] = keep_alive_seconds(body.keep_alive)
    if body.min_instances is not None:
        changes["min_instances"] = _min_instances(body.min_instances)
    if body.slo_class is not None:
        _check_slo_class(body.slo_class)
        changes["slo_class"] = body.slo_class
    record = dataclasses.replace(record, **changes)
    await ctx.registry.register(record, replace=True)
    await registry_changed(ctx)
    log.info("%s changed model %s: %s", _who(caller), record.name, changes)
    states = await lifecycle.views(ctx.redis, [record], caller.operator)
    return {**model_view(record, caller, await ctx.registry.aliases()),
            "lifecycle": states[record.name]}


async def _base_model(ctx: Context, name: str | None, tenant: str) -> ModelRecord | None:
    if name is None:
        return None
    base = await ctx.registry.resolve(name, tenant)
    if base is None:
        raise errors.APIError(404, f"The base model {name!r} does not exist or you do not have "
                              "access to it.", param="base_model", code="model_not_found")
    return base


async def _check_no_clash(ctx: Context, name: str, owner: str | None, alias: bool = False) -> None:
    """One name, one meaning for every tenant: a private name (model or alias) may not shadow a
    public model or alias (public names are no secret), the operator may not publish a name a
    tenant already uses privately (the operator may know that), and a model and an alias never
    share a name. `alias`: `name` is to be an alias (another alias of that name is left to the
    registry's own check); else a model (a model of that name is left to `replace`)."""
    param = "alias" if alias else "name"
    aliases = await ctx.registry.aliases()
    if owner is not None:
        public = await ctx.registry.get(name)
        if (public is not None and public.owner is None) or name in aliases:
            raise _name_taken(name, public=True, param=param)
        own = model_id(name, owner)
        if not alias and own in aliases:
            raise _alias_taken(name)
        if alias and await ctx.registry.get(own) is not None:
            raise _name_taken(name, param=param)
        return
    private = [r.owner for r in await ctx.registry.list() if r.owner is not None
               and display_name(r) == name]
    private += [a.partition(PRIVATE_SEPARATOR)[0] for a in aliases
                if PRIVATE_SEPARATOR in a and a.partition(PRIVATE_SEPARATOR)[2] == name]
    if private:  # only the operator publishes, and the operator may see every name
        raise errors.APIError(409, f"Tenant {private[0]!r} has a private model or alias named "
                              f"{name!r}; pick another public name.", param=param,
                              code="model_exists")
    if not alias and name in aliases:
        raise _alias_taken(name)
    if alias and await ctx.registry.get(name) is not None:
        raise _name_taken(name, public=True, param=param)


def _name_taken(name: str, public: bool = False, param: str = "name") -> errors.APIError:
    what = "public model or alias" if public else "model or alias of yours"
    replace = "" if public or param != "name" else " (or set replace=true to overwrite it)"
    return errors.APIError(409, f"A {what} named {name!r} is already registered; pick another name"
                           f"{replace}.", param=param, code="model_exists")


def _alias_taken(name: str) -> errors.APIError:
    return errors.APIError(409, f"{name!r} is an alias already; pick another name, or remove the "
                           f"alias first (DELETE /admin/aliases/{name}).", param="name",
                           code="model_exists")


def _who(caller: Principal) -> str:
    return "the operator" if caller.operator else f"tenant {caller.tenant}"


def model_view(record: ModelRecord, caller: Principal, aliases: dict[str, str]) -> dict[str, Any]:
    """A record as `caller` may read it, with its aliases (`ModelRegistry.aliases`): the
    operator sees everything (names are registry ids); a tenant sees names as it calls them and
    no server paths."""
    plain = wire.to_plain(record)
    plain["aliases"] = [_as_called(a, caller) for a in aliases_of(aliases, record.name)]
    if caller.operator:
        return plain
    plain.pop("path")
    plain["name"] = display_name(record)
    if record.base_model is not None:
        plain["base_model"] = strip_owner(record.base_model, caller.tenant)
    return plain


def _as_called(name_or_id: str, caller: Principal) -> str:
    return name_or_id if caller.operator else strip_owner(name_or_id, caller.tenant)


@router.get("/models", response_model=None, responses={200: RECORD_LIST})
async def list_registered(caller: Caller, ctx: Context) -> dict[str, Any]:
    records = await ctx.registry.list(None if caller.operator else caller.tenant)
    states = await lifecycle.views(ctx.redis, records, caller.operator)
    aliases = await ctx.registry.aliases()
    return {"object": "list", "data": [{**model_view(r, caller, aliases), "lifecycle": states[r.name]}
                                       for r in records]}


@router.get("/models/{name:path}", response_model=None, responses={200: MODEL_RECORD})
async def get_registered(name: str, caller: Caller, ctx: Context) -> dict[str, Any]:
    """One model as the caller calls it (the operator also by registry id), with its lifecycle."""
    record = await _visible(ctx, name, caller)
    states = await lifecycle.views(ctx.redis, [record], caller.operator)
    return {**model_view(record, caller, await ctx.registry.aliases()),
            "lifecycle": states[record.name]}


@router.delete("/models/{name:path}", response_model=None, responses={200: DELETED})
async def delete_model(name: str, caller: Caller, ctx: Context) -> dict[str, Any]:
    record = await changeable_model(ctx, name, caller, "delete")
    if not await ctx.registry.delete(record.name):
        raise errors.model_not_found(name)
    await ctx.registry.remove_aliases(*aliases_of(await ctx.registry.aliases(), record.name))
    await registry_changed(ctx)
    ctx.service.tokenizers.forget(record.path)
    await forget_state(ctx.redis, record.name)  # its profiles stay: instances may still run
    log.info("%s deleted model %s", _who(caller), record.name)
    return {"id": name, "object": "model", "deleted": True}


async def registry_changed(ctx: Context) -> None:
    """After a registry write: the records requests resolved to are forgotten here at once and
    on the other gateways as the notice reaches them (record_cache.py)."""
    ctx.service.records.clear()
    await announce_change(ctx.nc)


async def _visible(ctx: Context, name: str, caller: Principal) -> ModelRecord:
    if caller.operator:  # by registry id (any tenant's), else as the operator's tenant calls it
        record = await ctx.registry.get(name) or await ctx.registry.resolve(name, caller.tenant)
    else:
        record = await ctx.registry.resolve(name, caller.tenant)
    if record is None:
        raise errors.model_not_found(name)
    return record


async def changeable_model(ctx: Context, name: str, caller: Principal, what: str) -> ModelRecord:
    record = await _visible(ctx, name, caller)
    if not caller.operator and record.owner != caller.tenant:
        raise _forbidden(f"Only the operator may {what} the public model {name!r}.")
    return record


@router.post("/models/{name:path}/aliases", status_code=201, response_model=None,
             openapi_extra=json_body("AddAlias"), responses={201: ALIAS})
async def add_alias(name: str, caller: Caller, raw: RawBody, ctx: Context) -> JSONResponse:
    """Another name for the model `name`; requests for the alias are served by the model."""
    body = parse_body(AddAlias, raw)
    _check_model_name(body.alias, "alias")
    record = await changeable_model(ctx, name, caller, "alias")
    await _check_no_clash(ctx, body.alias, record.owner, alias=True)
    try:
        alias_id = await ctx.registry.add_alias(body.alias, record)
    except ModelExistsError:
        raise _name_taken(body.alias, public=record.owner is None, param="alias") from None
    # No record cache to clear (record_cache.py keeps only names that resolved, and a new alias
    # shadows none of them: `_check_no_clash`).
    log.info("%s aliased model %s as %s", _who(caller), record.name, alias_id)
    return JSONResponse(alias_view(alias_id, record.name, caller), status_code=201)


def alias_view(alias_id: str, model: str, caller: Principal) -> dict[str, Any]:
    owner, _, _ = alias_id.rpartition(PRIVATE_SEPARATOR)
    return {"id": _as_called(alias_id, caller), "object": "model.alias",
            "model": _as_called(model, caller), "owned_by": owner or "public"}


def _alias_visible(alias_id: str, caller: Principal) -> bool:
    """An alias has its model's owner, so the model's visibility: public, or the caller's."""
    owner, _, _ = alias_id.rpartition(PRIVATE_SEPARATOR)
    return caller.operator or owner in ("", caller.tenant)


@router.get("/aliases", response_model=None, responses={200: ALIAS_LIST})
async def list_aliases(caller: Caller, ctx: Context) -> dict[str, Any]:
    aliases = await ctx.registry.aliases()
    return {"object": "list", "data": [alias_view(a, m, caller) for a, m in sorted(aliases.items())
                                       if _alias_visible(a, caller)]}


@router.delete("/aliases/{alias:path}", response_model=None, responses={200: DELETED})
async def delete_alias(alias: str, caller: Caller, ctx: Context) -> dict[str, Any]:
    """Remove an alias, by the name the caller calls it (the operator also by its id); its model
    stays."""
    aliases = await ctx.registry.aliases()
    candidates = [alias] if caller.operator else []
    if PRIVATE_SEPARATOR not in alias:
        candidates += [model_id(alias, caller.tenant), alias]
    found = next((a for a in candidates if a in aliases and _alias_visible(a, caller)), None)
    if found is None:
        raise errors.APIError(404, f"The alias {alias!r} does not exist or you do not have access "
                              "to it.", param="alias", code="model_not_found")
    if not caller.operator and PRIVATE_SEPARATOR not in found:
        raise _forbidden(f"Only the operator may remove the public alias {alias!r}.")
    await ctx.registry.remove_aliases(found)
    await registry_changed(ctx)
    log.info("%s removed alias %s (of %s)", _who(caller), found, aliases[found])
    return {"id": alias, "object": "model.alias", "deleted": True}


async def _nodes(ctx: Context, caller: Principal) -> list[NodeView]:
    """Live node views (expired keys skipped). A tenant sees the instances of models it may see,
    named as it calls them, without other requests' ids."""
    ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await ctx.redis.smembers(NODES_SET))
    if not ids:
        return []
    raw = await ctx.redis.mget([node_key(i) for i in ids])
    visible = {r.name: display_name(r) for r in await ctx.registry.list(caller.tenant)}
    nodes = []
    for node_id, data in zip(ids, raw):
        if data is None:
            continue
        try:
            node = decode_node(data, time.time())  # on the gateway's clock
        except wire.WireError:
            log.warning("undecodable view of node %s skipped", node_id)
            continue
        if not caller.operator:
            node.instances = [_tenant_instance(i, visible[i.model.name], visible)
                              for i in node.instances if i.model.name in visible]
            if node.storage is not None:  # which checkpoints it holds or receives: visible ones only
                node.storage = dataclasses.replace(
                    node.storage, holds=_visible_keys(node.storage.holds, visible),
                    arriving=_visible_keys(node.storage.arriving, visible),
                    pipelines=_visible_keys(node.storage.pipelines, visible))
        nodes.append(node)
    return nodes


def _visible_keys(by_model: dict, visible: dict[str, str]) -> dict:
    """A per-model map as a tenant sees it: the models it may see, under its own names."""
    return {visible[m]: v for m, v in by_model.items() if m in visible}


def _tenant_instance(instance, name: str, visible: dict[str, str]):
    # Request ids are the gateway's handles of other tenants' requests too: counted, not named.
    requests = [dataclasses.replace(r, request_id="", model=name) for r in instance.requests]
    # LoRA adapters on a shared backbone: only those the tenant may see, by its names for them.
    adapters = {visible[a]: n for a, n in instance.adapters.items() if a in visible}
    return dataclasses.replace(instance, model=dataclasses.replace(instance.model, name=name),
                               requests=requests, adapters=adapters)


@router.get("/nodes", response_model=None, responses={200: NODE_LIST})
async def list_nodes(caller: Caller, ctx: Context) -> dict[str, Any]:
    return {"object": "list", "data": [wire.to_plain(n) for n in await _nodes(ctx, caller)]}


@router.get("/instances", response_model=None, responses={200: INSTANCE_LIST})
async def list_instances(caller: Caller, ctx: Context) -> dict[str, Any]:
    data = []
    for node in await _nodes(ctx, caller):
        for inst in node.instances:
            data.append({"instance_id": inst.instance_id, "node_id": node.node_id,
                         "hardware": node.hardware.value, "model": inst.model.name,
                         "status": inst.status.value, "batch_size": inst.batch_size,
                         "kv_bytes": inst.kv_bytes, "weight_bytes": inst.model.weight_bytes,
                         "last_active": inst.last_active, "keep_alive_s": inst.keep_alive_s,
                         "pinned": inst.pinned,
                         "requests": [r.request_id for r in inst.requests],
                         "adapters": dict(inst.adapters)})
    return {"object": "list", "data": data}

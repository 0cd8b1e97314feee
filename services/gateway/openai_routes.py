"""OpenAI-compatible routes. Each handler: parse, validate, call the service, shape the answer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.deps import Call, Registry, Tenant
from services.gateway.errors import invalid_request, model_not_found
from services.gateway.logprobs import LogprobsRenderer, token_texts
from services.gateway.openapi_docs import (CHAT_COMPLETION, COMPLETION, INFERENCE_ERRORS, MODEL,
                                           MODEL_LIST, READ_ERRORS, json_body)
from services.gateway.responses import ChatFormat, CompletionFormat, Echo, ResponseFormat
from services.gateway.service import Prepared
from services.gateway.stream import respond
from services.gateway.tokenization import prompt_offsets
from services.gateway.tools import tool_use
from services.gateway.validation import (
    IGNORED_FIELDS_HEADER,
    ChatBody,
    CompletionBody,
    CompletionInput,
    chat_input,
    chat_max_tokens,
    completion_input,
    ignored_fields,
    ignored_fields_header,
    parse_body,
    sampling_params,
)
from shared.registry import display_name, strip_owner
from shared.schemas import ModelRecord

router = APIRouter()
log = logging.getLogger("slinfer.gateway")
LOGGED_NAMES = 32  # a log line names this many ignored fields at most


def model_object(record: ModelRecord, alias: str | None = None) -> dict[str, Any]:
    """A model as its callers name it (a private model by its owner's name for it), or one of
    its aliases (`alias`: as its callers name it). `root` names the model that serves it, as vLLM's cards do for the several
    names of one model (`--served-model-name`)."""
    parent = None if record.base_model is None else strip_owner(record.base_model, record.owner)
    name = display_name(record)
    return {"id": alias or name, "object": "model",
            "created": int(record.created_at), "owned_by": record.owner or "public",
            "parent": parent, "root": name}


@router.get("/v1/models", response_model=None, responses={200: MODEL_LIST, **READ_ERRORS})
async def list_models(tenant: Tenant, registry: Registry) -> dict[str, Any]:
    records = {r.name: r for r in await registry.list(tenant)}
    aliases = await registry.aliases()
    data = [model_object(r) for r in records.values()]
    data += [model_object(records[m], alias=strip_owner(a, records[m].owner))
             for a, m in sorted(aliases.items()) if m in records]
    return {"object": "list", "data": data}


@router.get("/v1/models/{name:path}", response_model=None, responses={200: MODEL, **READ_ERRORS})
async def get_model(name: str, tenant: Tenant, registry: Registry) -> dict[str, Any]:
    record = await registry.resolve(name, tenant)
    if record is not None:
        return model_object(record)
    record = await registry.resolve_served(name, tenant)  # an alias
    if record is None:
        raise model_not_found(name)
    return model_object(record, alias=strip_owner(name, tenant))


@router.post("/v1/completions", response_model=None, openapi_extra=json_body("CompletionBody"),
             responses={200: COMPLETION, **INFERENCE_ERRORS})
async def completions(request: Request, call: Call) -> Response:
    tenant, service = call.tenant, call.service
    body = parse_body(CompletionBody, call.body)
    params = sampling_params(body, body.max_tokens)
    prompt = completion_input(body)
    prepared = await service.prepare(body.model, tenant, params, prompt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = await service.start(prepared, request_id, tenant, "text_completion")
    renderer = _renderer(prepared.tokenizer, params.logprobs)
    echo = await _echo(prepared, prompt) if params.echo else None
    fmts: list[ResponseFormat] = [
        CompletionFormat(id=request_id, model=body.model, include_usage=params.include_usage,
                         continuous_usage=params.continuous_usage, logprobs=renderer,
                         created=choices.created, index=i, echo=echo)
        for i in range(params.n)]
    response = await respond(request, choices, fmts, len(prepared.prompt_ids), params.stream,
                             params.include_usage)
    return name_ignored_fields(response, body, request_id)


@router.post("/v1/chat/completions", response_model=None, openapi_extra=json_body("ChatBody"),
             responses={200: CHAT_COMPLETION, **INFERENCE_ERRORS})
async def chat_completions(request: Request, call: Call) -> Response:
    tenant, service = call.tenant, call.service
    body = parse_body(ChatBody, call.body)
    params = sampling_params(body, *chat_max_tokens(body))
    tools = tool_use(body)
    if tools.grammar is not None:
        if params.grammar is not None:
            raise invalid_request("response_format cannot be combined with a required or named "
                                  "tool_choice: both constrain the output.",
                                  param="response_format", code="invalid_value")
        params = dataclasses.replace(params, grammar=tools.grammar)
    chat = dataclasses.replace(chat_input(body), tools=tools.tools)
    prepared = await service.prepare(body.model, tenant, params, chat)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = await service.start(prepared, request_id, tenant, "chat")
    renderer = _renderer(prepared.tokenizer, params.logprobs)
    fmts: list[ResponseFormat] = [
        ChatFormat(id=request_id, model=body.model, include_usage=params.include_usage,
                   continuous_usage=params.continuous_usage, logprobs=renderer,
                   tools=tools.parse, created=choices.created, index=i)
        for i in range(params.n)]
    response = await respond(request, choices, fmts, len(prepared.prompt_ids), params.stream,
                             params.include_usage)
    return name_ignored_fields(response, body, request_id)


async def _echo(prepared: Prepared, prompt: CompletionInput) -> Echo:
    """The prompt as echo repeats it: its text as sent (decoded, for token ids), and where each
    of its tokens' text starts (off the event loop: one decode per token)."""
    decoded, offsets = await asyncio.to_thread(prompt_offsets, prepared.tokenizer,
                                               prepared.prompt_ids)
    text = prompt.text if prompt.text is not None else decoded
    return Echo(text, prepared.prompt_ids, offsets)


def _renderer(tokenizer, top: int | None) -> LogprobsRenderer | None:
    """How the answer shows logprobs; None where the request asked for none."""
    return None if top is None else LogprobsRenderer(token_texts(tokenizer), top)


def name_ignored_fields(response: Response, body: ChatBody | CompletionBody,
                        request_id: str) -> Response:
    """Fields the request carried that slinfer does not know were ignored: say so in the log
    and in a response header, so a client that meant one of them can find out why it did
    nothing. A stream's headers go out with its first byte, after this."""
    names = ignored_fields(body)
    if names:
        log.info("request %s: ignored unknown fields %s%s", request_id, names[:LOGGED_NAMES],
                 f" (+{len(names) - LOGGED_NAMES} more)" if len(names) > LOGGED_NAMES else "")
        response.headers[IGNORED_FIELDS_HEADER] = ignored_fields_header(names)
    return response

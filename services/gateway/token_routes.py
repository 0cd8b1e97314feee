"""vLLM's tokenizer routes and version: POST /tokenize, POST /detokenize, GET /version.

Clients count tokens before sending (to fit a context window, to price a request) and turn ids
back into text; /tokenize answers with exactly the ids a completion or chat request with the same
prompt would run on (the same tokenizer, chat template and BOS rule), so `count` equals that
request's `usage.prompt_tokens`.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter

from services.gateway import errors
from services.gateway.deps import Call
from services.gateway.openapi_docs import (DETOKENIZED, READ_ERRORS, TOKENIZED, VERSION,
                                           errors_doc, json_body)
from services.gateway.tokenization import encode_chat, vocab_size
from services.gateway.validation import (DetokenizeBody, TokenizeBody, chat_input, parse_body)

router = APIRouter()
TOKEN_ERRORS = {**READ_ERRORS, **errors_doc(400, 413, 429)}


def slinfer_version() -> str:
    try:
        return version("slinfer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0.1.0"


@router.get("/version", response_model=None, openapi_extra={"security": []},
            responses={200: VERSION})
async def get_version() -> dict[str, str]:
    return {"version": slinfer_version()}


@router.post("/tokenize", response_model=None, openapi_extra=json_body("TokenizeBody"),
             responses={200: TOKENIZED, **TOKEN_ERRORS})
async def tokenize(call: Call) -> dict[str, Any]:
    tenant, service = call.tenant, call.service
    body = parse_body(TokenizeBody, call.body)
    if (body.prompt is None) == (body.messages is None):
        raise errors.invalid_request("Send either 'prompt' or 'messages' (one of them).",
                                     param="prompt", code="invalid_value")
    service.admission.check_rate(tenant)  # tokenizing costs the gateway's CPU like a request
    record = await service.visible_model(body.model, tenant)
    tokenizer = await service.tokenizer_for(record)
    if body.messages is not None:
        messages = chat_input(body).messages
        ids = await asyncio.to_thread(encode_chat, tokenizer, messages)
    else:
        ids = await asyncio.to_thread(
            lambda: list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": record.max_context, "tokens": ids,
            "token_strs": strs}


@router.post("/detokenize", response_model=None, openapi_extra=json_body("DetokenizeBody"),
             responses={200: DETOKENIZED, **TOKEN_ERRORS})
async def detokenize(call: Call) -> dict[str, str]:
    tenant, service = call.tenant, call.service
    body = parse_body(DetokenizeBody, call.body)
    service.admission.check_rate(tenant)
    record = await service.visible_model(body.model, tenant)
    tokenizer = await service.tokenizer_for(record)
    limit = vocab_size(tokenizer)
    if any(not 0 <= t < limit for t in body.tokens):
        raise errors.invalid_request(f"Token ids must be in [0, {limit}), the model's vocabulary.",
                                     param="tokens", code="invalid_value")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return {"prompt": text}

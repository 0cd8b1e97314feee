"""POST /v1/embeddings (OpenAI's shape): each input becomes a request that the cluster places
and schedules like a generation, a prefill with no decode (services/gateway/embeddings.py)."""

from __future__ import annotations

import asyncio
import uuid

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from services.gateway.deps import Call
from services.gateway.embeddings import (EmbeddingBody, check_dimensions, check_lengths,
                                         embedding_inputs, embedding_list, embedding_request,
                                         lost_vector, render_vector)
from services.gateway.generation import Generation
from services.gateway.openai_routes import name_ignored_fields
from services.gateway.openapi_docs import EMBEDDING_LIST, INFERENCE_ERRORS, json_body
from services.gateway.service import GatewayService
from services.gateway.tokenization import IncrementalDetokenizer, encode_text, vocab_size
from services.gateway.validation import parse_body
from shared.engine_features import EMBEDDINGS
from shared.schemas import ModelRecord

router = APIRouter()


@router.post("/v1/embeddings", response_model=None, openapi_extra=json_body("EmbeddingBody"),
             responses={200: EMBEDDING_LIST, **INFERENCE_ERRORS})
async def embeddings(call: Call) -> JSONResponse:
    tenant, service = call.tenant, call.service
    body = parse_body(EmbeddingBody, call.body)
    inputs = embedding_inputs(body)
    service.admission.check_rate(tenant)  # before any work is spent on the request
    record = await service.visible_model(body.model, tenant)
    await service.check_engine(record, [EMBEDDINGS])
    check_dimensions(record, body.dimensions)
    tokenizer = await service.tokenizer_for(record)
    prompts = await asyncio.to_thread(
        lambda: [encode_text(tokenizer, i.text) if i.text is not None else list(i.token_ids or [])
                 for i in inputs])
    check_lengths(record, prompts, vocab_size(tokenizer))
    response_id = f"embd-{uuid.uuid4().hex}"
    blobs = await _run(service, record, tokenizer, prompts, response_id, tenant)
    fmt = body.encoding_format or "float"
    vectors = [render_vector(b, body.dimensions, record.normalize, fmt) for b in blobs]
    response = JSONResponse(embedding_list(body.model, vectors, sum(len(p) for p in prompts)))
    return name_ignored_fields(response, body, response_id)  # type: ignore[arg-type]


async def _run(service: GatewayService, record: ModelRecord, tokenizer: PreTrainedTokenizerBase,
               prompts: list[list[int]], response_id: str, tenant: str) -> list[bytes]:
    """Submit every input's request together and wait for all their vectors; the first failure
    is the answer, and the other inputs' requests are cancelled."""
    timeout = service.settings.request_timeout_s
    requests = [embedding_request(record, ids, _input_id(response_id, i, len(prompts)), tenant,
                                  timeout) for i, ids in enumerate(prompts)]
    launched = await service.launch(requests, record, tenant, "embeddings",
                                    counts_prompt=[True] * len(requests), param="input",
                                    each="input")
    runs = [Generation(service.backend, stream, IncrementalDetokenizer(tokenizer), (), timeout,
                       observer, on_close=slot.release,
                       cause=lambda: service.files_cause(record))
            for stream, observer, slot in launched]
    tasks = [asyncio.ensure_future(_vector(run)) for run in runs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for run in runs:  # cancels on its node what has not finished
                await run.close("another input failed")


async def _vector(run: Generation) -> bytes:
    async for _ in run.deltas():  # an embedding request has no output tokens
        pass
    if not run.embedding:
        raise lost_vector()
    return run.embedding


def _input_id(response_id: str, index: int, count: int) -> str:
    return response_id if count == 1 else f"{response_id}-{index}"

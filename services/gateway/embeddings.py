"""POST /v1/embeddings, the pure part: the body, its inputs, the requests they become and the
answer's vectors.

Each input is a request of its own, placed and scheduled like any generation: a prefill with no
decode (`InferenceRequest.embedding`, max_tokens 0), whose node answers with the prompt's last
hidden states pooled as the model was registered (`ModelRecord.pooling`, `normalize`).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from services.gateway.errors import APIError, invalid_request
from services.gateway.validation import JSONInt, _Lenient
from shared.core.types import slo_for_class
from shared.registry import display_name
from shared.schemas import Embedding, InferenceRequest, ModelRecord

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


def _inputs_schema(schema: dict[str, Any]) -> None:
    """What embedding_inputs accepts, in the published schema: nothing empty, ids >= 0."""
    for variant in schema.get("anyOf", []):
        if variant.get("type") == "string":
            variant["minLength"] = 1
            continue
        variant["minItems"], variant["maxItems"] = 1, MAX_INPUTS
        items = variant.get("items", {})
        if items.get("type") == "string":
            items["minLength"] = 1
        elif items.get("type") == "integer":
            items["minimum"] = 0
        elif items.get("type") == "array":
            items["minItems"] = 1
            items.get("items", {})["minimum"] = 0


class EmbeddingBody(_Lenient):
    """OpenAI's embeddings request."""

    model: str
    # One text, several, one token-id list, or several.
    input: str | list[str] | list[JSONInt] | list[list[JSONInt]] = Field(
        json_schema_extra=_inputs_schema)
    encoding_format: Literal["float", "base64"] | None = None  # None: float
    # Only for a model registered as matryoshka: the vector's first `dimensions` entries.
    dimensions: JSONInt | None = Field(None, json_schema_extra={"minimum": 1})
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-monitoring id


@dataclass(frozen=True)
class EmbeddingInput:
    text: str | None  # exactly one of text / token_ids
    token_ids: list[int] | None


def embedding_inputs(body: EmbeddingBody) -> list[EmbeddingInput]:
    """The body's inputs, each one request's prompt; a 400 naming `input` when there are none,
    one is empty, or there are too many."""
    raw = body.input
    if isinstance(raw, str):
        inputs = [EmbeddingInput(raw, None)]
    elif raw and all(isinstance(x, int) for x in raw):
        inputs = [EmbeddingInput(None, list(raw))]  # type: ignore[arg-type]
    else:
        inputs = [EmbeddingInput(x, None) if isinstance(x, str) else EmbeddingInput(None, list(x))
                  for x in raw]  # type: ignore[union-attr]
    if not inputs:
        raise invalid_request("input must not be empty.", param="input", code="invalid_value")
    if len(inputs) > MAX_INPUTS:
        raise invalid_request(f"input may hold at most {MAX_INPUTS} items, got {len(inputs)}.",
                              param="input", code="invalid_value")
    for i, item in enumerate(inputs):
        if not (item.text or item.token_ids):
            raise invalid_request(f"input[{i}] is empty." if len(inputs) > 1 else
                                  "input must not be empty.", param="input", code="invalid_value")
        if item.token_ids is not None and min(item.token_ids) < 0:
            raise invalid_request("Token ids must be >= 0.", param="input", code="invalid_value")
    return inputs


def check_dimensions(record: ModelRecord, dimensions: int | None) -> None:
    """`dimensions` is for models whose vector's prefixes are embeddings too (matryoshka)."""
    if dimensions is None:
        return
    if not record.matryoshka:
        raise invalid_request(
            f"Unsupported parameter: 'dimensions' is not supported by model "
            f"{display_name(record)!r}: it was not registered as a matryoshka embedding model, "
            "so a shorter vector would not be an embedding.", param="dimensions",
            code="unsupported_parameter")
    if dimensions < 1:
        raise invalid_request(f"dimensions must be at least 1, got {dimensions}.",
                              param="dimensions", code="invalid_value")


def check_lengths(record: ModelRecord, prompts: list[list[int]], vocab: int) -> None:
    """Every input fits the model: its context (the prefill's length) and its vocabulary."""
    context = record.max_context
    for i, ids in enumerate(prompts):
        where = "input" if len(prompts) == 1 else f"input[{i}]"
        if not ids:
            raise invalid_request(f"{where} is empty after tokenization.", param="input",
                                  code="empty_prompt")
        if len(ids) >= context:
            raise invalid_request(
                f"This model's maximum context length is {context} tokens, so an input may have "
                f"at most {context - 1}; {where} has {len(ids)}.", param="input",
                code="context_length_exceeded")
        if max(ids) >= vocab:
            raise invalid_request(f"Token ids must be below the vocabulary size {vocab}.",
                                  param="input", code="invalid_value")


def embedding_request(record: ModelRecord, prompt_ids: list[int], request_id: str, tenant: str,
                      timeout_s: float) -> InferenceRequest:
    """One input's request: the prefill of its prompt, pooled as `record` says, and no output.
    A LoRA adapter runs on an instance of its backbone, which the request names."""
    slo = slo_for_class(record.slo_class, len(prompt_ids))
    arrival = time.time()
    adapter = record.name if record.base_model is not None else None
    return InferenceRequest(
        request_id=request_id, tenant=tenant, model=record.base_model or record.name,
        adapter=adapter, adapter_rank=max(1, record.lora_rank) if adapter else 0,
        prompt_token_ids=prompt_ids, max_tokens=0, arrival=arrival, ttft_slo_s=slo.ttft_s,
        tpot_slo_s=slo.tpot_s, deadline=arrival + timeout_s, temperature=0.0,
        embedding=Embedding(record.pooling, record.normalize))


def render_vector(data: bytes, dimensions: int | None, normalize: bool,
                  encoding_format: str) -> list[float] | str:
    """A node's vector (float32 little-endian) as the answer carries it: its first `dimensions`
    entries (re-normalised where the model normalises: a prefix of a unit vector is not one),
    as floats or as OpenAI's base64 of the float32 bytes."""
    vector = np.frombuffer(data, dtype="<f4")
    if dimensions is not None:
        if dimensions > len(vector):
            raise invalid_request(f"dimensions must be at most the model's {len(vector)}, got "
                                  f"{dimensions}.", param="dimensions", code="invalid_value")
        vector = vector[:dimensions]
        norm = float(np.linalg.norm(vector))
        if normalize and norm > 0:
            vector = vector / np.float32(norm)
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def lost_vector() -> APIError:
    return APIError(500, "Inference failed: the embedding was lost on the way from the node.",
                    type="server_error", code="inference_error")


def embedding_list(model: str, vectors: list[list[float] | str], prompt_tokens: int
                   ) -> dict[str, Any]:
    """OpenAI's answer: one embedding object per input, in input order, and the usage (an
    embedding has no completion tokens)."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

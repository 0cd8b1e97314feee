"""What `/openapi.json` declares: the real request bodies (the routes read raw bytes, so FastAPI
cannot see them), the real answers, and every error status in OpenAI's shape. FastAPI's own 422
is never sent (validation errors are 400 here) and is taken out (`finish_schema`).

The response models below document; the routes build their answers themselves.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

COMPONENTS = "#/components/schemas/"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the gateway answers, as the OpenAI API shapes it."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


_ERROR_TEXT = {
    400: "Invalid request (bad JSON, a bad or unsupported parameter, a prompt too long).",
    401: "Missing or unknown API key.",
    403: "The caller's key may not do this.",
    404: "No such model (or another tenant's private one), or no such route.",
    405: "Method not allowed on this route.",
    409: "A model of that name exists already.",
    413: "The request body is larger than the limit.",
    429: "A limit of the caller's tenant or of the model is reached; see Retry-After.",
    500: "The gateway or the inference backend failed, or the model failed to become "
         "servable (model_failed: its profiling failed, or its files are missing or broken).",
    503: "The inference backend or the registry is unavailable, the request was dropped "
         "(it could not meet its SLO), or the model is not ready yet (model_not_ready: still "
         "converting or profiling).",
    504: "The request did not finish within the gateway's timeout.",
}


def errors_doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERROR_TEXT[s]} for s in statuses}


_COMMON = (400, 401, 404, 405, 413, 500, 503)
INFERENCE_ERRORS = errors_doc(*_COMMON, 429, 504)
ADMIN_ERRORS = errors_doc(*_COMMON, 403, 409)
READ_ERRORS = errors_doc(401, 404, 405, 500, 503)


def json_body(component: str) -> dict[str, Any]:
    """`openapi_extra` declaring the JSON body a route parses itself."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": COMPONENTS + component}}}}}


# -- the answers ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Parallel lists, one entry per output token; each top_logprobs map holds the chosen
    token too."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None  # with the request's logprobs: k
    finish_reason: str


class Completion(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(BaseModel):
    id: str
    type: str  # "function"
    function: CalledFunctionOut


class ChatMessageOut(BaseModel):
    role: str
    content: str | None  # null when the answer is tool calls only
    refusal: None
    tool_calls: list[ToolCallOut] | None = None  # a request with tools: the calls it made


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's exact UTF-8 bytes (part of a character, maybe)


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]  # the request's top_logprobs most likely, likeliest first


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None  # with the request's logprobs: true
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelObject(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    parent: str | None
    root: str  # the model that serves it: its own id, or an alias's model


class ModelList(BaseModel):
    object: str
    data: list[ModelObject]


class Health(BaseModel):
    status: str
    nats: bool
    redis: bool
    auth: bool


class LifecycleStep(BaseModel):
    state: str  # converting | profiling | ready | failed
    progress: float  # 0..1 of the step that runs now
    reason: str  # failed: why; otherwise what runs now
    updated: float


class Lifecycle(BaseModel):
    """Whether the model is servable: converted and profiled per hardware kind."""

    state: str  # converting | profiling | ready | failed | not_profiled
    hardware: dict[str, LifecycleStep]


class RegisteredModel(BaseModel):
    """A registry record; `path` only for the operator, names as the caller calls them."""

    name: str
    path: str | None = None
    engine: str
    slo_class: str
    owner: str | None
    base_model: str | None
    max_context: int
    weight_bytes: int
    kv_bytes_per_token: int
    eos_token_ids: list[int]
    created_at: float
    pooling: str | None = None  # POST /v1/embeddings: mean | last | cls
    normalize: bool | None = None
    matryoshka: bool | None = None
    keep_alive_s: float | None = None  # None: the cluster's default; negative: never unloaded
    min_instances: int = 0  # warm instances kept (pinned)
    lifecycle: Lifecycle | None = None
    aliases: list[str] = []  # its other names, as the caller calls them


class RegisteredList(BaseModel):
    object: str
    data: list[RegisteredModel]


class Alias(BaseModel):
    id: str  # the alias, as the caller calls it
    object: str  # "model.alias"
    model: str  # the model it names
    owned_by: str  # its model's owner, or "public"


class AliasList(BaseModel):
    object: str
    data: list[Alias]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool


class NodeList(BaseModel):
    object: str
    data: list[dict[str, Any]]  # the placer's node views (shared.core.types.NodeView)


class InstanceRow(BaseModel):
    instance_id: str
    node_id: str
    hardware: str
    model: str
    status: str
    batch_size: int
    kv_bytes: int
    weight_bytes: int
    last_active: float
    keep_alive_s: float | None = None  # its idle window (None: the cluster's; negative: never)
    pinned: bool = False  # its model keeps warm instances: never reclaimed as idle
    requests: list[str]
    adapters: dict[str, int]  # LoRA adapters attached to this backbone instance -> their bytes


class InstanceList(BaseModel):
    object: str
    data: list[InstanceRow]


class Tokenized(BaseModel):
    count: int  # len(tokens)
    max_model_len: int  # the model's context, prompt and completion together
    tokens: list[int]
    token_strs: list[str] | None  # each token's vocabulary entry, when asked for


class Detokenized(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


class EmbeddingObject(BaseModel):
    object: str  # "embedding"
    index: int  # the input's position
    embedding: list[float] | str  # floats, or base64 of float32 little-endian (encoding_format)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: str  # "list"
    model: str
    data: list[EmbeddingObject]
    usage: EmbeddingUsage


def _ok(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"model": model, "description": description}


# Each server-sent event (OpenAPI 3.1 has `schema` describe one event): its data is a JSON chunk,
# an error object, or the closing "[DONE]".
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}
COMPLETION = {**_ok(Completion, "The completion; with stream=true, server-sent events."),
              "content": _SSE}
CHAT_COMPLETION = {**_ok(ChatCompletion, "The chat completion; with stream=true, server-sent "
                         "events of chat.completion.chunk objects."), "content": _SSE}
MODEL_LIST = _ok(ModelList, "The models this key's tenant may call.")
MODEL = _ok(ModelObject, "The model.")
HEALTH = _ok(Health, "NATS and Redis are reachable.")
HEALTH_DOWN = _ok(Health, "NATS or Redis is unreachable.")
MODEL_RECORD = _ok(RegisteredModel, "The registered model.")
RECORD_LIST = _ok(RegisteredList, "The models the caller may see.")
DELETED = _ok(Deleted, "The model (or alias) was deleted.")
ALIAS = _ok(Alias, "The alias.")
ALIAS_LIST = _ok(AliasList, "The aliases the caller may see.")
NODE_LIST = _ok(NodeList, "The live nodes, with the instances the caller may see.")
INSTANCE_LIST = _ok(InstanceList, "The instances the caller may see.")
TOKENIZED = _ok(Tokenized, "The token ids the model would be given for this prompt.")
DETOKENIZED = _ok(Detokenized, "The text of the token ids.")
VERSION = _ok(Version, "slinfer's version.")
EMBEDDING_LIST = _ok(EmbeddingList, "One embedding per input, in input order.")


def finish_schema(schema: dict[str, Any], bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """Add the request-body schemas and bearer auth; drop FastAPI's 422 (never sent)."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name, model in bodies.items():
        body = model.model_json_schema(ref_template=COMPONENTS + "{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[name] = body
    if "ChatMessage" in schemas:
        schemas["ChatMessage"] = chat_message_by_role(schemas["ChatMessage"])
    for key in ("HTTPValidationError", "ValidationError"):
        schemas.pop(key, None)
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            operation.get("responses", {}).pop("422", None)
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    return schema


def chat_message_by_role(base: dict[str, Any]) -> dict[str, Any]:
    """The chat message's schema as one variant per role, as OpenAI publishes it, so that a
    message the schema calls valid is one the gateway takes (validation.py's `_chat_message`
    enforces the same): `tool_calls` only on an assistant message, which needs content or tool
    calls; `tool_call_id` only, and always, on a tool message; content on every other one."""
    props = base["properties"]
    text = {"anyOf": [a for a in props["content"]["anyOf"] if a.get("type") != "null"]}
    absent = {"type": "null", "default": None}

    def variant(roles: list[str], required: list[str], **override: Any) -> dict[str, Any]:
        properties = {**props, "role": {**props["role"], "enum": roles}, **override}
        return {**base, "title": f"ChatMessage ({', '.join(roles)})", "properties": properties,
                "required": ["role", *required]}

    calls = next(a for a in props["tool_calls"]["anyOf"] if a.get("type") == "array")
    assistant = variant(["assistant"], [], tool_call_id=absent)
    assistant["anyOf"] = [{"required": ["content"], "properties": {"content": text}},
                          {"required": ["tool_calls"],
                           "properties": {"tool_calls": {**calls, "minItems": 1}}}]
    return {"oneOf": [
        variant(["system", "developer", "user"], ["content"], content=text, tool_calls=absent,
                tool_call_id=absent),
        assistant,
        variant(["tool"], ["content", "tool_call_id"], content=text, tool_calls=absent,
                tool_call_id={"type": "string"}),
    ]}

"""OpenAI request bodies: strict schemas, then the checks a schema cannot express.

Parsing is strict (a string is not a number, `true` is not 1). Keys slinfer does not know are
ignored, not refused: real clients send their own (OpenWebUI's `num_ctx`, vLLM's
`chat_template_kwargs`, a message's `id`, stream options newer than ours), and refusing them broke
those clients where vLLM, after its users' reports, stopped refusing them too. `ignored_fields`
names them, for a log line and a response header. Parameters the OpenAI API has but slinfer does
not implement are declared, so a value slinfer cannot honour is a 400 naming it, never silently
dropped. The checks that need the model (context length, vocabulary) live with the tokenizer, in
`openai_routes.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from urllib.parse import quote
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from services.gateway.errors import invalid_request, validation_error
from services.gateway.settings import MAX_CHOICES_LIMIT
from shared.core.keepalive import parse_keep_alive
from shared.engine_features import asked_features
from shared.grammar import ANY_JSON_OBJECT, GrammarError, compile_grammar, json_schema_grammar
from shared.schemas import OutputGrammar

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and the engines')
MAX_LOGIT_BIAS = 300  # entries; OpenAI's bound
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI
PENALTY_RANGE = 2.0  # presence and frequency penalties in [-2, 2], as OpenAI
MAX_STOP_TOKEN_IDS = 256
IGNORED_FIELDS_HEADER = "x-slinfer-ignored-fields"
HEADER_MAX_CHARS = 512  # the header names the first ignored fields that fit, then a count
NAME_MAX_CHARS = 64  # one name's share of it (names are the client's, of any length)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema counts them: 2.0 is one (a strict int refuses it); "2" and true stay
# refused.
JSONInt = Annotated[int, BeforeValidator(_integral)]


def _one_prompt(schema: dict[str, Any]) -> None:
    for variant in schema.get("anyOf", []):
        if variant.get("type") == "string":
            variant["minLength"] = 1
        elif variant.get("items", {}).get("type") in ("string", "array"):
            variant["minItems"] = variant["maxItems"] = 1  # one prompt per request
        else:
            variant["minItems"] = 1
            variant["items"]["minimum"] = 0


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    """Strict about the fields it declares; other keys are kept aside (`model_extra`) to be
    named by `ignored_fields`, and nothing reads them."""

    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


def _doc(**schema: Any) -> Any:
    """A field whose published JSON schema says what the checks below accept (the checks, not
    pydantic, enforce it, so their 400s name the parameter the same way)."""
    return Field(None, json_schema_extra=schema)


def _neutral(*values: Any) -> Any:
    """An OpenAI parameter slinfer does not implement: only its neutral values are accepted."""
    return _doc(enum=[None, *values])


class JsonSchemaFormat(_Lenient):
    """response_format's json_schema: the output must be a JSON document valid against `schema`
    (enforced whether `strict` is true or not: decoding is constrained either way)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # absent: any JSON object
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema


class _Common(_Lenient):
    # OpenAI parameters a body type implements although _Common declares them unimplemented.
    implemented: ClassVar[frozenset[str]] = frozenset()
    model: str
    max_tokens: JSONInt | None = _doc(minimum=1)
    temperature: float | None = _doc(minimum=0, maximum=2)
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    seed: JSONInt | None = _doc(minimum=-(2**63), maximum=2**64 - 1)
    stop: str | list[str] | None = _doc(minLength=1, maxLength=MAX_STOP_CHARS,
                                        maxItems=MAX_STOP_SEQUENCES,
                                        items={"type": "string", "minLength": 1,
                                               "maxLength": MAX_STOP_CHARS})
    stream: bool | None = False
    stream_options: StreamOptions | None = None  # only with stream: true
    user: str | None = None
    # vLLM's sampling extensions, which load generators (guidellm, vllm bench, aiperf) send.
    ignore_eos: bool | None = None
    min_tokens: JSONInt | None = _doc(minimum=0)  # at most max_tokens
    top_k: JSONInt | None = _doc(minimum=-1, maximum=2**31 - 1)  # -1 or 0: no limit
    repetition_penalty: float | None = _doc(exclusiveMinimum=0)
    min_p: float | None = _doc(minimum=0, maximum=1)
    stop_token_ids: list[JSONInt] | None = _doc(maxItems=MAX_STOP_TOKEN_IDS,
                                                items={"type": "integer", "minimum": 0})
    # OpenAI's penalties and logit_bias (only engines that honour them: shared/engine_features.py)
    presence_penalty: float | None = _doc(minimum=-PENALTY_RANGE, maximum=PENALTY_RANGE)
    frequency_penalty: float | None = _doc(minimum=-PENALTY_RANGE, maximum=PENALTY_RANGE)
    logit_bias: dict[str, float] | None = _doc(
        maxProperties=MAX_LOGIT_BIAS, propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -LOGIT_BIAS_RANGE,
                              "maximum": LOGIT_BIAS_RANGE})
    # Ollama's keep_alive: how long the model's instance stays loaded once idle after this
    # request: seconds, or a duration ("5m", "1h30m", "30s"); 0: unload at once; negative:
    # never (`shared.core.keepalive.parse_keep_alive`).
    keep_alive: float | str | None = None
    # How many choices to generate (each its own request; at most the gateway's
    # SLINFER_MAX_CHOICES, checked with the settings).
    n: JSONInt | None = _doc(minimum=1, maximum=MAX_CHOICES_LIMIT)
    # In the OpenAI API, not implemented here: any value other than the neutral one is refused
    # by `reject_unsupported`, which names the parameter.
    best_of: Any = _neutral(1)
    echo: Any = _neutral(False)
    suffix: Any = _neutral("")
    # Constrained decoding (shared/grammar.py): text, any JSON object, or a JSON Schema.
    response_format: ResponseFormat | None = None
    tools: Any = _neutral([])  # chat only (ChatBody)
    tool_choice: Any = _neutral("none")
    parallel_tool_calls: Any = _neutral()
    functions: Any = _neutral([])
    function_call: Any = _neutral("none")
    service_tier: Any = _neutral("auto", "default")
    store: Any = _neutral(False)
    metadata: Any = _neutral({})
    prediction: Any = _neutral()
    modalities: Any = _neutral(["text"])
    audio: Any = _neutral()
    reasoning_effort: Any = _neutral()
    web_search_options: Any = _neutral()


class CompletionBody(_Common):
    implemented: ClassVar[frozenset[str]] = frozenset({"echo"})
    # 0 only with echo: the prompt scored, nothing generated (OpenAI's legacy scoring mode).
    max_tokens: JSONInt | None = _doc(minimum=0)
    # The prompt repeated before each choice's text; with logprobs, the prompt tokens' too.
    echo: bool | None = None
    # Text, or token ids; a list of one of those is one prompt too (batches are refused).
    prompt: str | list[JSONInt] | list[str] | list[list[JSONInt]] = Field(
        json_schema_extra=_one_prompt)
    # The k most likely tokens' log-probabilities beside each chosen token's (OpenAI allows 5;
    # vLLM, and this, up to 20).
    logprobs: JSONInt | None = _doc(minimum=0, maximum=MAX_TOP_LOGPROBS)


def _require(*names: str) -> Any:
    """Model-level schema: `names` documented as required (the checks below refuse their absence
    with a message of their own)."""
    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = sorted({*schema.get("required", ()), *names})
    return extra


def _not_null(schema: dict[str, Any]) -> None:
    """A field documented without null: the checks below refuse a null."""
    schema["anyOf"] = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    schema.pop("default", None)


class TextPart(_Lenient):
    model_config = ConfigDict(strict=True, extra="allow",  # image_url etc., refused below
                              json_schema_extra=_require("text"))
    type: str = Field(json_schema_extra={"enum": ["text"]})  # the only kind supported
    text: str | None = Field(None, json_schema_extra=_not_null)


class CalledFunction(_Lenient):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Lenient):
    """A call an earlier assistant message made (sent back with the tool's answer)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    # content may be null or absent on an assistant message that made tool calls; the checks
    # in chat_input require it everywhere else.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers
    function_call: Any = _neutral()
    refusal: Any = None


class FunctionDef(_Lenient):
    name: str = Field(json_schema_extra={"pattern": "^[A-Za-z0-9_-]{1,64}$"})
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; absent: no parameters
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class ChatBody(_Common):
    implemented: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice",
                                                       "parallel_tool_calls"})
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    # Function tools (services/gateway/tools.py): described to the model by its chat template,
    # its calls parsed into tool_calls; a required or named tool_choice is a grammar.
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # default true: several calls in one answer
    max_completion_tokens: JSONInt | None = _doc(minimum=1)
    logprobs: bool | None = None
    top_logprobs: JSONInt | None = _doc(minimum=0, maximum=MAX_TOP_LOGPROBS)  # with logprobs


class TokenizeBody(_Lenient):
    """vLLM's POST /tokenize: a completion's `prompt` or a chat's `messages` (one of them)."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: BOS where the model wants one, as completions
    return_token_strs: bool = False


class DetokenizeBody(_Lenient):
    """vLLM's POST /detokenize."""

    model: str
    tokens: list[JSONInt] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


# value is acceptable (neutral) -> True
_NEUTRAL = {
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: v is None,
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v is None or v is False,
    "metadata": lambda v: v in (None, {}),
    "prediction": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}

MAX_TOP_K = 2**31 - 1  # beyond any vocabulary; keeps the value a plain int32 on every engine


@dataclass(frozen=True)
class SamplingParams:
    """What the request asks of generation, normalised and range-checked."""

    max_tokens: int | None  # None: the gateway's default, capped by the context left
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final chunk with usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    top_k: int = 0  # 0: no limit
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's and the k most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()  # end the output like EOS (their text is not shown)
    grammar: OutputGrammar | None = None  # the output must match it (constrained decoding)
    n: int = 1  # choices, each generated as its own request
    echo: bool = False  # completions: the prompt before the text (and its logprobs, if asked)
    keep_alive_s: float | None = None  # its instance's idle window after it (None: the model's)

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: only the prompt is answered, with its logprobs if asked (how
        lm-evaluation-harness and OpenAI's legacy API score a text). The engine still makes one
        token, which carries the prompt's logprobs back; the gateway drops it, as vLLM does."""
        return self.echo and self.max_tokens == 0

    @property
    def prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprobs carry; None: none asked."""
        return self.logprobs if self.echo else None

    def features(self) -> list[str]:
        """What it asks of the engine beyond plain sampling (shared/engine_features.py)."""
        return asked_features(self.logprobs, self.presence_penalty, self.frequency_penalty,
                              self.logit_bias, self.min_p,
                              self.grammar.param if self.grammar else None, self.prompt_logprobs)


@dataclass(frozen=True)
class CompletionInput:
    text: str | None  # exactly one of text / token_ids
    token_ids: list[int] | None


@dataclass(frozen=True)
class ChatInput:
    # {"role", "content"} (+ "name"), content flattened to text; an assistant message's
    # "tool_calls" and a tool message's "tool_call_id" as OpenAI writes them
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions the model is shown


B = TypeVar("B", bound=BaseModel)


def parse_body(cls: type[B], raw: bytes) -> B:
    try:
        return cls.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None


def ignored_fields(body: BaseModel, where: str = "") -> list[str]:
    """The keys of `body` that no field declares, by their path in the request (`num_ctx`,
    `messages[0].id`, `stream_options.include_obfuscation`): the body's own, then its fields'."""
    names = [where + key for key in (body.model_extra or {})]
    for field_name in type(body).model_fields:
        value = getattr(body, field_name)
        path = where + field_name
        if isinstance(value, BaseModel):
            names += ignored_fields(value, path + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    names += ignored_fields(item, f"{path}[{i}].")
    return names


def ignored_fields_header(names: list[str]) -> str:
    """The header's value: the names percent-encoded (a client's key can hold anything, a line
    break included, and must not become a header of its own), as many as fit, then a count."""
    shown: list[str] = []
    used = 0
    for name in names:
        encoded = quote(name, safe="._-[]")[:NAME_MAX_CHARS]
        if used + len(encoded) + 2 > HEADER_MAX_CHARS:
            break
        shown.append(encoded)
        used += len(encoded) + 2
    rest = len(names) - len(shown)
    return ", ".join(shown + ([f"+{rest} more"] if rest else []))


def reject_unsupported(body: _Common) -> None:
    for name, neutral in _NEUTRAL.items():
        value = getattr(body, name, None)
        if name in body.implemented:
            continue
        if name in body.model_fields_set and not neutral(value):
            raise invalid_request(f"Unsupported parameter: {name!r} is not supported by slinfer "
                                  f"(got {value!r}).", param=name, code="unsupported_parameter")


def sampling_params(body: _Common, max_tokens: int | None,
                    max_tokens_param: str = "max_tokens") -> SamplingParams:
    reject_unsupported(body)
    echo = isinstance(body, CompletionBody) and bool(body.echo)
    _check_max_tokens(max_tokens, max_tokens_param, isinstance(body, CompletionBody), echo)
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise invalid_request(f"temperature must be in [0, 2], got {temperature}.", param="temperature",
                              code="invalid_value")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise invalid_request(f"top_p must be in (0, 1], got {top_p}.", param="top_p", code="invalid_value")
    if body.seed is not None and not -(2**63) <= body.seed < 2**64:
        raise invalid_request("seed must fit in 64 bits.", param="seed", code="invalid_value")
    stop = _stop_sequences(body.stop)
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise invalid_request("stream_options is only allowed when stream is true.",
                              param="stream_options", code="invalid_value")
    options = body.stream_options or StreamOptions()
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.seed,
                          stop=stop, stream=stream, include_usage=options.include_usage,
                          continuous_usage=options.continuous_usage_stats, n=_choices(body),
                          echo=echo,
                          **_extensions(body))


def _check_max_tokens(value: int | None, param: str, completion: bool, echo: bool) -> None:
    """At least 1; 0 is a completion's with echo (the prompt scored, nothing generated)."""
    if value is None or value >= 1 or (value == 0 and echo):
        return
    hint = " (0 only with echo: the prompt scored, nothing generated)" if (
        completion and value == 0) else ""
    raise invalid_request(f"{param} must be at least 1, got {value}{hint}.", param=param,
                          code="invalid_value")


def _choices(body: _Common) -> int:
    """`n`, at least 1 (its upper bound is a gateway setting: GatewayService checks it). The
    neutral best_of (1) cannot pick the best of fewer candidates than n."""
    n = 1 if body.n is None else body.n
    if n < 1:
        raise invalid_request(f"n must be at least 1, got {n}.", param="n", code="invalid_value")
    if body.best_of is not None and body.best_of < n:
        raise invalid_request(f"best_of ({body.best_of}) must be at least n ({n}).",
                              param="best_of", code="invalid_value")
    return n


def _extensions(body: _Common) -> dict[str, Any]:
    """vLLM's sampling extensions, range-checked as vLLM checks them."""
    top_k = 0 if body.top_k is None else body.top_k
    if not (top_k in (-1, 0) or 1 <= top_k <= MAX_TOP_K):
        raise invalid_request(f"top_k must be -1 or 0 (no limit) or at least 1, got {top_k}.",
                              param="top_k", code="invalid_value")
    penalty = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    if not (math.isfinite(penalty) and penalty > 0):
        raise invalid_request(f"repetition_penalty must be a number > 0, got {penalty}.",
                              param="repetition_penalty", code="invalid_value")
    min_tokens = 0 if body.min_tokens is None else body.min_tokens
    if min_tokens < 0:
        raise invalid_request(f"min_tokens must be >= 0, got {min_tokens}.", param="min_tokens",
                              code="invalid_value")
    min_p = 0.0 if body.min_p is None else body.min_p
    if not 0.0 <= min_p <= 1.0:
        raise invalid_request(f"min_p must be in [0, 1], got {min_p}.", param="min_p",
                              code="invalid_value")
    return {"top_k": max(top_k, 0), "repetition_penalty": penalty, "min_tokens": min_tokens,
            "ignore_eos": bool(body.ignore_eos), "min_p": min_p,
            "stop_token_ids": _stop_token_ids(body.stop_token_ids),
            "presence_penalty": _penalty(body.presence_penalty, "presence_penalty"),
            "frequency_penalty": _penalty(body.frequency_penalty, "frequency_penalty"),
            "logit_bias": _logit_bias(body.logit_bias), "logprobs": _logprobs(body),
            "grammar": _response_format(body.response_format),
            "keep_alive_s": keep_alive_seconds(body.keep_alive)}


def keep_alive_seconds(value: float | str | None, param: str = "keep_alive") -> float | None:
    """A keep_alive as seconds (negative: never; None: not given), or a 400 naming `param`."""
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise invalid_request(f"{exc}.", param=param, code="invalid_value") from None


def _response_format(fmt: ResponseFormat | None) -> OutputGrammar | None:
    """The grammar response_format asks for: none for text, any JSON object for json_object,
    the schema's documents for json_schema (a schema it cannot compile is a 400 saying why)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT)
    if fmt.json_schema is None:
        raise invalid_request("response_format of type json_schema needs its json_schema.",
                              param="response_format.json_schema",
                              code="missing_required_parameter")
    grammar = json_schema_grammar(fmt.json_schema.json_schema or ANY_JSON_OBJECT)
    check_grammar(grammar, "response_format.json_schema.schema")
    return grammar


def check_grammar(grammar: OutputGrammar, param: str) -> None:
    """A 400 naming `param` for a grammar that cannot constrain an output."""
    try:
        compile_grammar(grammar)
    except GrammarError as exc:
        raise invalid_request(f"{param} cannot be enforced: {exc}", param=param,
                              code="invalid_value") from None


def check_grammar_fits(params: SamplingParams) -> None:
    """A constrained output ends when its grammar is complete, with an end token: ignore_eos
    and min_tokens would keep it going where the grammar allows nothing more."""
    if params.grammar is None:
        return
    for name, on in (("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens > 0)):
        if on:
            raise invalid_request(f"{name} cannot be combined with {params.grammar.param}: a "
                                  "constrained output ends when its grammar is complete.",
                                  param=name, code="invalid_value")


def _penalty(value: float | None, name: str) -> float:
    value = 0.0 if value is None else value
    if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
        raise invalid_request(f"{name} must be in [-2, 2], got {value}.", param=name,
                              code="invalid_value")
    return value


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (JSON keys, so strings) to biases in [-100, 100]. The ids are
    checked against the model's vocabulary with the tokenizer."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid_request(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got "
                              f"{len(bias)}.", param="logit_bias", code="invalid_value")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid_request(f"logit_bias keys must be token ids, got {key!r}.",
                                  param="logit_bias", code="invalid_value")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise invalid_request(f"logit_bias values must be in [-100, 100], got {value} for "
                                  f"token {key}.", param="logit_bias", code="invalid_value")
        out.append((int(key), value))
    return tuple(out)


def _stop_token_ids(ids: list[int] | None) -> tuple[int, ...]:
    if not ids:
        return ()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid_request(f"At most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed.",
                              param="stop_token_ids", code="invalid_value")
    if any(t < 0 for t in ids):
        raise invalid_request("stop_token_ids must be non-negative token ids.",
                              param="stop_token_ids", code="invalid_value")
    return tuple(dict.fromkeys(ids))


def _logprobs(body: _Common) -> int | None:
    """How many alternatives each output token's logprobs carry; None: no logprobs. Chat asks
    with `logprobs: true` and `top_logprobs: k`; completions with `logprobs: k`."""
    if isinstance(body, ChatBody):
        k, name = body.top_logprobs, "top_logprobs"
        if not body.logprobs:
            if k:
                raise invalid_request("top_logprobs needs logprobs: true.", param="top_logprobs",
                                      code="invalid_value")
            return None
        k = k or 0
    elif isinstance(body, CompletionBody):
        k, name = body.logprobs, "logprobs"
        if k is None:
            return None
    else:
        return None
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise invalid_request(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}.", param=name,
                              code="invalid_value")
    return k


def _stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > MAX_STOP_SEQUENCES:
        raise invalid_request(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", param="stop",
                              code="invalid_value")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise invalid_request(f"Each stop sequence must have 1 to {MAX_STOP_CHARS} characters.",
                                  param="stop", code="invalid_value")
    return tuple(dict.fromkeys(items))


def completion_input(body: CompletionBody) -> CompletionInput:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise invalid_request("Batched prompts (a list of several prompts) are not supported; "
                                  "send one prompt per request.", param="prompt",
                                  code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_request("The prompt must not be empty.", param="prompt", code="empty_prompt")
        return CompletionInput(text=prompt, token_ids=None)
    if not prompt:
        raise invalid_request("The prompt must not be empty.", param="prompt", code="empty_prompt")
    if any(t < 0 for t in prompt):
        raise invalid_request("Prompt token ids must be non-negative.", param="prompt", code="invalid_value")
    return CompletionInput(text=None, token_ids=list(prompt))


def chat_input(body: ChatBody | TokenizeBody) -> ChatInput:
    if not body.messages:
        raise invalid_request("'messages' must contain at least one message.", param="messages",
                              code="empty_messages")
    out = [_chat_message(m, f"messages[{i}]") for i, m in enumerate(body.messages)]
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise invalid_request("'messages' must contain some text.", param="messages", code="empty_messages")
    return ChatInput(messages=out)


def _chat_message(m: ChatMessage, where: str) -> dict[str, Any]:
    """One message as the prompt builder takes it: text content (None only on an assistant
    message that made tool calls), and the tool-call fields where the role has them."""
    if m.function_call is not None:
        raise invalid_request(f"Unsupported parameter: {where}.function_call (the deprecated "
                              "functions API; use tools).", param=f"{where}.function_call",
                              code="unsupported_parameter")
    for name, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
        if getattr(m, name) is not None and m.role != role:
            raise invalid_request(f"{where}.{name} belongs on a message of role {role!r}, not "
                                  f"{m.role!r}.", param=f"{where}.{name}", code="invalid_value")
    if m.role == "tool" and m.tool_call_id is None:
        raise invalid_request(f"{where}.tool_call_id is required on a tool message.",
                              param=f"{where}.tool_call_id", code="missing_required_parameter")
    if m.content is None and not m.tool_calls:
        raise invalid_request(f"{where}.content is required.", param=f"{where}.content",
                              code="missing_required_parameter")
    message: dict[str, Any] = {"role": m.role, "content": _text(m.content, where)}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [_called(call, f"{where}.tool_calls[{j}]")
                                 for j, call in enumerate(m.tool_calls)]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _text(content: str | list[TextPart] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid_request(f"Unsupported content part type {part.type!r} in "
                                  f"{where}.content[{j}]: only text is supported.",
                                  param=f"{where}.content[{j}]", code="unsupported_parameter")
        pieces.append(part.text)
    return "".join(pieces)


def _called(call: ToolCall, where: str) -> dict[str, Any]:
    """An earlier tool call, its arguments JSON checked (a chat template writes them out)."""
    try:
        json.loads(call.function.arguments)
    except ValueError:
        raise invalid_request(f"{where}.function.arguments must be JSON text.",
                              param=f"{where}.function.arguments", code="invalid_value") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}


def chat_max_tokens(body: ChatBody) -> tuple[int | None, str]:
    """The completion-token limit and the parameter it came from."""
    if body.max_completion_tokens is not None and body.max_tokens is not None \
            and body.max_completion_tokens != body.max_tokens:
        raise invalid_request("max_tokens and max_completion_tokens disagree; send one of them.",
                              param="max_completion_tokens", code="invalid_value")
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"

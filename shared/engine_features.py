"""What each engine honours of a request beyond the sampling every engine does (temperature,
top-p, top-k, seed, repetition penalty, min_tokens, EOS and stop token ids).

The gateway reads this table to refuse, by name and before the request is queued, a parameter
the model's engine would not honour; each engine checks it again when a request is added (a
model can be re-registered on another engine while requests are in flight), so a request never
runs with a parameter silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized

LOGPROBS = "logprobs"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
LOGIT_BIAS = "logit_bias"
MIN_P = "min_p"
# The prompt's own log-probabilities (the completions API's `echo` with `logprobs`): computed
# from the prefill's logits at every prompt position, not only the last.
ECHO = "echo"
# Constrained decoding (a token mask each step): asked by response_format json_object/json_schema,
# or by a required or named tool_choice. The request's OutputGrammar says which one asked.
RESPONSE_FORMAT = "response_format"
TOOL_CHOICE = "tool_choice"
GRAMMAR_FEATURES = frozenset({RESPONSE_FORMAT, TOOL_CHOICE})
# POST /v1/embeddings: the prefill's last hidden states pooled into a vector, not a token.
EMBEDDINGS = "embeddings"

ALL_FEATURES = frozenset({LOGPROBS, PRESENCE_PENALTY, FREQUENCY_PENALTY, LOGIT_BIAS, MIN_P,
                          ECHO, *GRAMMAR_FEATURES, EMBEDDINGS})

ENGINE_FEATURES: dict[str, frozenset[str]] = {
    "torch": ALL_FEATURES,
    # OpenVINO GenAI and vLLM have their own versions of some of these (vLLM's guided decoding
    # and pooling runner, OpenVINO GenAI's structured output and TextEmbeddingPipeline among
    # them); their adapters here do not pass them on yet, so they refuse them rather than
    # sample without them.
    "openvino": frozenset(),
    "vllm": frozenset(),
}
# "auto" is the node's default engine for its device kind, torch on every kind there is
# (services/node/engines DEFAULT_ENGINES; a test keeps the two in step).
ENGINE_FEATURES["auto"] = ENGINE_FEATURES["torch"]


def asked_features(logprobs: int | None, presence_penalty: float, frequency_penalty: float,
                   logit_bias: Sized, min_p: float, grammar_param: str | None = None,
                   prompt_logprobs: int | None = None, embedding: bool = False) -> list[str]:
    """The features a request's values ask for (a neutral value asks for none); `grammar_param`:
    the parameter whose output grammar the request carries (None: none); `embedding`: it asks
    for the prompt's embedding instead of output tokens."""
    asked = {LOGPROBS: logprobs is not None, PRESENCE_PENALTY: presence_penalty != 0,
             FREQUENCY_PENALTY: frequency_penalty != 0, LOGIT_BIAS: len(logit_bias) > 0,
             MIN_P: min_p != 0, ECHO: prompt_logprobs is not None, EMBEDDINGS: embedding}
    return [name for name, on in asked.items() if on] + ([grammar_param] if grammar_param else [])


def unsupported(engine: str, asked: Iterable[str]) -> list[str]:
    """The features in `asked` that `engine` does not honour (an unknown engine honours none)."""
    have = ENGINE_FEATURES.get(engine, frozenset())
    return [name for name in asked if name not in have]

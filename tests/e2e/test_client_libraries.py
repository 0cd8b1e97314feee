"""The client libraries applications are built on, unmodified, against the whole stack serving
the default real model (SmolLM2-135M-Instruct), greedy: LangChain's `ChatOpenAI`, LlamaIndex's
`OpenAILike`, litellm, and the openai client where tests/e2e/test_structured_output.py does not
already cover it (`parse` with a Pydantic model and a strict named tool are there). Each library
is used the way its documentation shows, pointed at slinfer by base URL, key and model name.

Every forced tool call here uses the schema Pydantic writes, which lists its properties but does
not close the object: the grammar closes it (shared/grammar.py), else this model goes on
inventing arguments until max_tokens and LangChain reports an invalid tool call.
"""

from __future__ import annotations

import json
import os

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

# litellm fetches its model price list from the internet when imported, three tries with
# back-off; the copy it ships is enough for an OpenAI-compatible endpoint.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.llms.openai_like import OpenAILike  # noqa: E402

from shared.default_model import NAME  # noqa: E402
from tests.e2e.clients import openai_client  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600),
              # pydantic's notes on litellm's ReadOnly TypedDicts, at its first call
              pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")]
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # this model's greedy answer
LIMIT = 40  # tokens; every answer below ends well before
TIMEOUT_S = 300  # a prompt that describes a tool is ~140 tokens of prefill on a busy CPU


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="The city's name")


class City(BaseModel):
    name: str
    country: str


def base_url(stack) -> str:
    return f"{stack.url}/v1"


# -- openai ------------------------------------------------------------------------------------


def test_openai_streamed_chat_is_the_greedy_answer(real_stack):
    client = openai_client(real_stack, timeout=TIMEOUT_S)
    ask = dict(model=NAME, messages=[{"role": "user", "content": QUESTION}], temperature=0,
               max_tokens=LIMIT)
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert whole.message.content == ANSWER and whole.finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_openai_named_tool_with_an_open_schema(real_stack):
    """A tool as a user writes it by hand: Pydantic's schema, no `strict`, no
    additionalProperties. The call's arguments are JSON with exactly the declared keys."""
    schema = GetWeather.model_json_schema()
    completion = openai_client(real_stack, timeout=TIMEOUT_S).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        temperature=0, max_tokens=LIMIT, tool_choice={"type": "function",
                                                      "function": {"name": "GetWeather"}},
        tools=[{"type": "function", "function": {
            "name": "GetWeather", "description": GetWeather.__doc__, "parameters": schema}}])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema_rs.validate({**schema, "additionalProperties": False}, arguments)
    assert "Paris" in arguments["city"]


# -- LangChain -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(real_stack) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url(real_stack), api_key="unused", model=NAME,
                      temperature=0, max_tokens=LIMIT, max_retries=0, timeout=TIMEOUT_S)


def test_langchain_invoke_and_stream(chat_model):
    message = chat_model.invoke(QUESTION)
    assert message.content == ANSWER
    assert message.response_metadata["finish_reason"] == "stop"
    assert "".join(chunk.content for chunk in chat_model.stream(QUESTION)) == ANSWER


def test_langchain_bind_tools_with_a_forced_choice(chat_model):
    message = chat_model.bind_tools([GetWeather], tool_choice="GetWeather").invoke(
        "What is the weather in Paris?")
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    assert "Paris" in GetWeather.model_validate(call["args"]).city


def test_langchain_structured_output(chat_model):
    city = chat_model.with_structured_output(City).invoke(
        "Describe Paris as JSON with its name and country.")
    assert isinstance(city, City)
    assert city.name == "Paris"


# -- LlamaIndex ----------------------------------------------------------------------------------


def test_llamaindex_openai_like_complete_and_chat(real_stack):
    llm = OpenAILike(model=NAME, api_base=base_url(real_stack), api_key="unused",
                     is_chat_model=True, temperature=0, max_tokens=LIMIT, max_retries=0,
                     timeout=TIMEOUT_S)
    assert llm.complete(QUESTION).text == ANSWER
    answer = llm.chat([ChatMessage(role="user", content=QUESTION)]).message
    assert (answer.role, answer.content) == ("assistant", ANSWER)


# -- litellm -------------------------------------------------------------------------------------


def test_litellm_completion_plain_and_streamed(real_stack):
    ask = dict(model=f"openai/{NAME}", api_base=base_url(real_stack), api_key="unused",
               messages=[{"role": "user", "content": QUESTION}], temperature=0,
               max_tokens=LIMIT, timeout=TIMEOUT_S, num_retries=0)
    response = litellm.completion(**ask)
    assert response.choices[0].message.content == ANSWER
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens > 0
    chunks = list(litellm.completion(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER


# -- a model slinfer does not serve: each library raises its own not-found error -----------------


def test_an_unknown_model_raises_each_librarys_not_found_error(real_stack):
    url, missing, ask = base_url(real_stack), "no-such-model", [("user", QUESTION)]
    with pytest.raises(openai.NotFoundError):
        ChatOpenAI(base_url=url, api_key="unused", model=missing, max_retries=0).invoke(QUESTION)
    with pytest.raises(openai.NotFoundError):
        OpenAILike(model=missing, api_base=url, api_key="unused", is_chat_model=True,
                   max_retries=0).chat([ChatMessage(role=r, content=c) for r, c in ask])
    with pytest.raises(litellm.NotFoundError):
        litellm.completion(model=f"openai/{missing}", api_base=url, api_key="unused",
                           messages=[{"role": "user", "content": QUESTION}], num_retries=0)

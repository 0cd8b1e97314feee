"""Tools without a server. The tool-call parser (services/gateway/tool_calls.py): a streamed
output, cut into pieces anywhere, must give what the whole output gives; content around blocks,
blocks that are no call, other layouts of a call, and outputs that end inside a block. The prompt
(services/gateway/tools.py): a template that renders tools gets Hugging Face's shapes, one that
does not gets them written out."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_calls import ToolCallStream, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"}ris", "days": [1, {"n": 2}]}}\n</tool_call>'
OUTPUTS = [
    "Just text, no call.",
    CALL,
    f"Let me check.\n{CALL}\n",
    f'{CALL}\n<tool_call>\n{{"arguments": {{"x": 1}}, "name": "other"}}\n</tool_call>',
    f"Before {CALL} between {CALL} after",
    "a <tool_call>not json</tool_call> b <tool",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',  # no close tag
    '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2',  # cut by max_tokens
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as text
]


def _streamed(text: str, cuts: list[int]) -> tuple[str | None, list[dict]]:
    """Content and calls from the stream's pieces, accumulated as a client does."""
    stream = ToolCallStream()
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    answers = [stream.feed(p) for p in pieces] + [stream.finish()]
    calls: dict[int, dict] = {}
    for _, deltas in answers:
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = d.get("id", call["id"])
            call["name"] = d["function"].get("name", call["name"])
            call["arguments"] += d["function"]["arguments"]
    content = "".join(c for c, _ in answers)
    return (content if content or not calls else None), [calls[i] for i in sorted(calls)]


def _plain(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text", OUTPUTS)
def test_any_cutting_of_a_stream_gives_the_whole_answer(text):
    content, calls = parse(text)
    expected = (content, _plain(calls))
    for size in (1, 2, 5, 13):
        got_content, got_calls = _streamed(text, list(range(size, len(text), size)))
        assert (got_content, [(c["name"], c["arguments"]) for c in got_calls]) == expected
        assert all(c["id"].startswith("call_") for c in got_calls)


def test_calls_and_their_content():
    content, calls = parse(f"Let me check.\n{CALL}\n")
    assert content == "Let me check."
    assert _plain(calls) == [("get_weather", '{"city": "Pa\\"}ris", "days": [1, {"n": 2}]}')]
    assert json.loads(calls[0]["function"]["arguments"])["city"] == 'Pa"}ris'
    assert parse(CALL)[0] is None  # calls only: content null
    assert parse(f"Before {CALL} between {CALL} after")[0] == "Beforebetweenafter"


def test_other_layouts_and_text_that_is_no_call():
    _, calls = parse('<tool_call>{"arguments": {"x": 1}, "name": "other"}</tool_call>')
    assert _plain(calls) == [("other", '{"x": 1}')]
    _, calls = parse('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')
    assert _plain(calls) == [("f", '{"x": 1}')]  # Llama 3.1's key for the arguments
    _, calls = parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert _plain(calls) == [("f", '{"a": 1}')]  # arguments already text
    text = "a <tool_call>not json</tool_call> b <tool"
    assert parse(text) == (text, [])


def test_an_output_cut_inside_a_call():
    content, calls = parse('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
    assert content is None and _plain(calls) == [("f", '{"a": [1, 2')]  # as OpenAI's length
    assert _plain(parse('<tool_call>\n{"name": "f", "arguments": {}}')[1]) == [("f", "{}")]
    assert parse("x <tool_call>\n{\"na") == ("x <tool_call>\n{\"na", [])


def test_arguments_stream_before_the_block_closes():
    stream = ToolCallStream()
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, deltas = stream.feed(head)
    assert content == "" and deltas[0]["function"] == {"name": "get_weather",
                                                       "arguments": '{"city": "Pa'}
    assert stream.feed('ris"}')[1] == [{"index": 0, "function": {"arguments": 'ris"}'}}]
    assert stream.feed("}\n</tool_call>") == ("", [])


# -- the prompt (services/gateway/tools.py) ----------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object"}, "strict": True}}]
# A template that renders tools itself, reading a call's arguments as an object (as Qwen2.5's).
TOOL_TEMPLATE = (
    "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}\n{% endfor %}")


def test_a_template_that_renders_tools_gets_them_in_hugging_faces_shapes():
    from services.gateway.tools import prompt_messages

    messages, tools = prompt_messages(TOOL_TEMPLATE, CONVERSATION, TOOLS)
    assert tools == TOOLS
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["content"] == "" and messages[2]["role"] == "tool"


def test_a_template_without_tools_gets_them_written_out():
    from services.gateway.tools import CALL_OPEN, RESULT_OPEN, prompt_messages

    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    messages, tools = prompt_messages(plain, CONVERSATION, TOOLS)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"]
    assert '"strict"' not in messages[0]["content"]  # only name, description, parameters
    assert messages[2]["content"].startswith(CALL_OPEN) and "Paris" in messages[2]["content"]
    assert messages[3]["content"].startswith(RESULT_OPEN) and "sunny" in messages[3]["content"]
    # a system message of the client's keeps its text, the tools follow it
    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    assert prompt_messages(plain, with_system, TOOLS)[0][0]["content"].startswith("Be brief.\n\n")
    # no tools and no calls: the messages as they came
    assert prompt_messages(plain, CONVERSATION[:1], None) == (CONVERSATION[:1], None)


def test_the_rendered_prompt_through_a_tokenizer(hf_tokenizer):
    from services.gateway.tokenization import render_chat

    hf_tokenizer.chat_template, saved = TOOL_TEMPLATE, hf_tokenizer.chat_template
    try:
        text = render_chat(hf_tokenizer, CONVERSATION, TOOLS)
    finally:
        hf_tokenizer.chat_template = saved
    assert text.startswith("TOOL get_weather\n") and "CALL get_weather(Paris)" in text
    assert "tool: sunny" in text

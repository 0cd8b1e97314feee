"""Function tools in chat requests: what the model is shown, and the grammar that forces a call.

The model sees the tools through its chat template: a template that renders tools itself (it
reads `tools`, as Qwen2.5's, Llama 3.1's and Hermes' do) gets them and the conversation's
tool calls in Hugging Face's shapes. A template that knows nothing of tools (SmolLM2's, the
demo model's) gets them described in a system message written here, earlier calls written into
the assistant's text, and tool results as user messages; both ask for the same output.

The output format slinfer asks for, parses (tool_calls.py) and, for a required or named
tool_choice, enforces by constrained decoding is Hermes' (also Qwen2.5's and SmolLM3's): one
block per call,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

tool_choice: `none` shows the model no tools and parses nothing; `auto` (the default with
tools) lets it choose, and parses what it writes; `required` constrains the output to one or
more calls (exactly one with parallel_tool_calls false) of the given tools; a named function
constrains it to exactly one call of that function. A forced call's arguments are generated
against the function's `parameters` schema, its objects closed (shared/grammar.py): a caller
passes them to its function, which has no use for keys it does not declare.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import invalid_request
from services.gateway.validation import ChatBody, FunctionDef, check_grammar
from shared.engine_features import TOOL_CHOICE
from shared.grammar import LARK, closed_objects, with_layout
from shared.schemas import OutputGrammar

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"
NEWLINE = "\n"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
SHOWN = ("name", "description", "parameters")  # of a function, in the tools system prompt
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}

# For templates that do not render tools: short, since every request with tools pays its prefill.
# The function list is JSON, one function per line.
TOOLS_SYSTEM_PROMPT = (
    "You can call these functions (JSON Schema arguments):\n<tools>\n{tools}\n</tools>\n"
    f"To call one, answer only with\n{CALL_OPEN}\n"
    '{"name": "<function name>", "arguments": {<arguments>}}'
    f"\n{CALL_CLOSE}\nfor each call. Otherwise answer in text."
)


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools ask for."""

    tools: list[dict[str, Any]]  # OpenAI tool definitions to show the model ([]: none)
    parse: bool  # parse tool calls out of the output
    grammar: OutputGrammar | None = None  # a forced call (required or named tool_choice)


def tool_use(body: ChatBody) -> ToolUse:
    """The request's tools, checked: names OpenAI would accept and unique, a tool_choice that
    names one of them, and (for a forced call) parameter schemas that can be enforced."""
    functions = [t.function for t in body.tools or []]
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if not NAME_PATTERN.fullmatch(name):
            raise invalid_request(f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                                  f"'_' or '-', got {name!r}.",
                                  param=f"tools[{i}].function.name", code="invalid_value")
        if name in names[:i]:
            raise invalid_request(f"Two tools are named {name!r}.",
                                  param=f"tools[{i}].function.name", code="invalid_value")
    choice = body.tool_choice or ("auto" if functions else "none")
    if choice != "none" and choice != "auto" and not functions:
        raise invalid_request("tool_choice requires tools.", param="tool_choice",
                              code="invalid_value")
    if choice == "none" or not functions:
        return ToolUse(tools=[], parse=False)
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions]
    if choice == "auto":
        return ToolUse(tools=tools, parse=True)
    if choice == "required":
        forced, several = functions, body.parallel_tool_calls is not False
    else:
        forced = [f for f in functions if f.name == choice.function.name]
        if not forced:
            raise invalid_request(f"tool_choice names function {choice.function.name!r}, which "
                                  "is not among the tools.", param="tool_choice",
                                  code="invalid_value")
        several = False
    grammar = call_grammar(forced, several)
    check_grammar(grammar, "tool_choice")
    return ToolUse(tools=tools, parse=True, grammar=grammar)


def call_grammar(functions: list[FunctionDef], several: bool) -> OutputGrammar:
    """The Lark grammar of one call (or, with `several`, one or more calls on their own lines)
    of one of `functions`, each block laid out as the module docstring shows, its arguments a
    JSON document of the function's parameters schema (a `%json` block: its $refs resolve
    inside it)."""
    rules = ["start: call" + (f" ({_literal(NEWLINE)} call)*" if several else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    tail = _literal("}\n" + CALL_CLOSE)
    for i, f in enumerate(functions):
        head = _literal(f'{CALL_OPEN}\n{{"name": {json.dumps(f.name)}, "arguments": ')
        rules.append(f"call_{i}: {head} args_{i} {tail}")
        parameters = closed_objects(f.parameters or NO_PARAMETERS)
        rules.append(f"args_{i}: %json {json.dumps(with_layout(parameters))}")
    return OutputGrammar(LARK, "\n".join(rules) + "\n", TOOL_CHOICE)


def _literal(text: str) -> str:
    """A Lark string literal of `text` (Lark strings take JSON's escapes)."""
    return json.dumps(text)


# -- the prompt --------------------------------------------------------------------------------


def renders_tools(template: str) -> bool:
    """The chat template reads the `tools` variable itself."""
    return re.search(r"\btools\b", template) is not None


def prompt_messages(template: str, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]],
                                                                   list[dict[str, Any]] | None]:
    """The messages (and tools) to give `template`: in Hugging Face's shapes where it renders
    tools, else with the tools, the calls and their results written out as text."""
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_calls:
        return messages, None
    if renders_tools(template):
        return [_hf_message(m) for m in messages], tools or None
    return _described(messages, tools or []), None


def _hf_message(message: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's chat shape: a call's arguments as an object (templates serialise them)."""
    out = {**message, "content": message["content"] or ""}
    if "tool_calls" in message:
        out["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                "arguments": json.loads(c["function"]["arguments"])}}
                             for c in message["tool_calls"]]
    return out


def call_text(name: str, arguments: Any) -> str:
    """One call written as the model is asked to write it."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _described(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"{RESULT_OPEN}\n{m['content'] or ''}\n{RESULT_CLOSE}"})
        elif m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_call_id"})
    if not tools:
        return out
    listed = "\n".join(json.dumps({k: t["function"][k] for k in SHOWN if k in t["function"]},
                                   ensure_ascii=False) for t in tools)
    system = TOOLS_SYSTEM_PROMPT.replace("{tools}", listed)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out

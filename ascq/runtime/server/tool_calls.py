"""Tool calling for chat: tools into the prompt, tool calls out of the text (the hermes format), as vLLM does.

Prompt: a chat template that renders `tools` itself gets them as `apply_chat_template(tools=...)`. One that
does not (SmolLM2's, most small models') gets the hermes system prompt below, which lists the tools as JSON
inside <tools></tools> and asks for each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
earlier assistant tool calls and tool results in the conversation are written back in the same tags.

Output, by `tool_choice`:
- "auto" (the default when tools are given): needs `--enable-auto-tool-choice --tool-call-parser hermes`, else
  400. The model decides; `<tool_call>` blocks become `tool_calls`, the rest stays `content`.
- "required": structured outputs force a JSON array of one or more {"name", "arguments"} objects (one of the
  tools).
- {"type": "function", "function": {"name": X}}: structured outputs force X's `parameters` schema.
- "none": tools are neither shown nor called.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ascq.runtime.sampling.structured_output import StructuredOutputsParams
from ascq.runtime.server.protocol import (
    APIError,
    ChatCompletionRequest,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)

TOOL_CALL_PARSERS = ("hermes",)
HERMES_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each "
    "function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    'follows:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tool_mode(body: ChatCompletionRequest, enable_auto_tool_choice: bool) -> str | None:
    """None (no tools in play), "auto", "required" or "named"; a 400 for auto without the server flags."""
    if not body.tools or body.tool_choice == "none":
        return None
    if isinstance(body.tool_choice, NamedToolChoice):
        return "named"
    if body.tool_choice == "required":
        return "required"
    if not enable_auto_tool_choice:
        raise APIError(
            400,
            '"auto" tool choice needs the server started with --enable-auto-tool-choice '
            '--tool-call-parser hermes (or send tool_choice "required", "none" or a named '
            "function)",
            param="tool_choice",
        )
    return "auto"


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the hermes tool prompt and tool calls / results written as text."""
    prompt = HERMES_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = [
                f"<tool_call>\n{json.dumps(call_dict(c), ensure_ascii=False)}\n</tool_call>"
                for c in message.pop("tool_calls")
            ]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *calls]))
        if message["role"] == "tool":
            message = {"role": "tool", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        out.append(message)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def call_dict(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    try:
        arguments = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        pass
    return {"name": call["function"]["name"], "arguments": arguments}


def forced_tool_structure(body: ChatCompletionRequest, mode: str | None) -> StructuredOutputsParams | None:
    """The JSON schema that makes the output a tool call, for tool_choice "required" or a named function."""
    if mode == "named":
        name = body.tool_choice.function.name
        function = next(t.function for t in body.tools if t.function.name == name)
        return StructuredOutputsParams(json=function.parameters or {"type": "object"})
    if mode == "required":
        definitions: dict[str, Any] = {}
        variants = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": _hoist_definitions(t.function.parameters or {"type": "object"}, definitions),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in body.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if definitions:
            schema["$defs"] = definitions
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    return None


def _hoist_definitions(parameters: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """`parameters` without its `$defs`, which move into `definitions`: a tool's `$ref: "#/$defs/X"` points
    at the root of the schema, and in the "required" schema the tool's parameters are no longer the root (as
    vLLM does). Two tools defining one name differently is a 400."""
    if "$defs" not in parameters:
        return parameters
    parameters = dict(parameters)
    hoisted = parameters.pop("$defs")
    if not isinstance(hoisted, dict):
        raise APIError(400, "a tool's parameters.$defs must be an object", param="tools")
    for name, definition in hoisted.items():
        if definitions.setdefault(name, definition) != definition:
            raise APIError(
                400,
                f"tools define the schema '$defs/{name}' differently; give each definition one name",
                param="tools",
            )
    return parameters


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


def parse_tool_calls(
    text: str, body: ChatCompletionRequest, mode: str | None
) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of one generated message."""
    if mode is None:
        return text, []
    if mode == "named":
        return None, [new_call(body.tool_choice.function.name, text)]
    if mode == "required":
        try:
            calls = [new_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):  # cut short by max_tokens
            return text, []
        return None, calls
    return parse_hermes(text, {t.function.name for t in body.tools}, body.parallel_tool_calls is not False)


def parse_hermes(text: str, names: set[str], parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks -> tool calls; anything else is
    content. A block that is not valid JSON naming one of the tools stays in the content."""
    calls, spans = [], []
    for match in TOOL_CALL_RE.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        calls.append(new_call(call["name"], call.get("arguments", call.get("parameters", {}))))
        spans.append(match.span())
    if not parallel:
        calls = calls[:1]
    content = text
    for start, end in reversed(spans):
        content = content[:start] + content[end:]
    content = content.strip()
    return (content or None) if calls else text, calls

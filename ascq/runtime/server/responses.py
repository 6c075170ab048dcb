"""POST /v1/responses, the OpenAI Responses API for text, as vLLM serves it for a chat model: the request
becomes a chat completion (instructions -> system message, input -> messages, max_output_tokens ->
max_tokens), and the answer a Response object, or for `stream: true` the Responses event stream (created,
output item and content part added, output_text deltas, done events, completed)."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ascq.runtime.server.protocol import APIError, ChatCompletionRequest, random_id

# Responses fields with a chat equivalent; the rest are refused or ignored by the chat request model
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
)


# Responses features beyond text: refused unless their value asks for nothing
TEXT_ONLY = frozenset({"tools", "tool_choice", "previous_response_id", "reasoning", "text"})


def chat_body(data: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request a Responses request asks for."""
    messages: list[dict[str, Any]] = []
    if data.get("instructions"):
        messages.append({"role": "system", "content": data["instructions"]})
    given = data.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += [_message(item, i) for i, item in enumerate(given)]
    else:
        raise APIError(400, "input must be a string or a list of messages", param="input")
    body: dict[str, Any] = {"messages": messages, "stream": bool(data.get("stream"))}
    if data.get("model") is not None:
        body["model"] = data["model"]
    if data.get("max_output_tokens") is not None:
        body["max_tokens"] = data["max_output_tokens"]
    body |= {k: data[k] for k in SAMPLING_FIELDS if data.get(k) is not None}
    unsupported = sorted(TEXT_ONLY & set(data))
    for name in unsupported:
        if data[name] not in (None, [], {}, "auto", "none"):
            raise APIError(
                400, f"{name} is not supported by this server's /v1/responses (text only)", param=name
            )
    # every other field goes to the chat request model, which implements, refuses or names it in its warning
    consumed = {"instructions", "input", "stream", "model", "max_output_tokens", *SAMPLING_FIELDS, *TEXT_ONLY}
    return {k: v for k, v in data.items() if k not in consumed} | body


def _message(item: Any, index: int) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("role") not in ("system", "developer", "user", "assistant"):
        raise APIError(400, f"input[{index}] must be a message with a role", param=f"input.{index}")
    content = item.get("content")
    if isinstance(content, list):  # input_text / output_text parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):
        raise APIError(400, f"input[{index}].content must be text", param=f"input.{index}.content")
    return {"role": item["role"], "content": content}


def response_object(
    response_id: str, model: str, text: str, finish_reason: str | None, usage: dict[str, int], created: int
) -> dict[str, Any]:
    complete = finish_reason != "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": "completed" if complete else "incomplete",
        "incomplete_details": None if complete else {"reason": "max_output_tokens"},
        "error": None,
        "output": [_message_item(response_id, text, "completed")],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _message_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {
        "type": "message",
        "id": f"msg_{response_id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def chat_request_data(data: dict[str, Any]) -> dict[str, Any]:
    """`chat_body`, streaming with usage (the completed event reports it)."""
    body = chat_body(data)
    return body | ({"stream_options": {"include_usage": True}} if body["stream"] else {})


async def create_response(serving: Any, body: ChatCompletionRequest, request: Request) -> Response:
    """`body` (a validated `chat_request_data`) answered as a Response object or event stream."""
    response_id = random_id("resp")
    created = int(time.time())
    chat = await serving.chat_completions(body, request)
    if not body.stream:
        answer = json.loads(chat.body)
        choice = answer["choices"][0]
        text = choice["message"]["content"] or ""
        return JSONResponse(
            response_object(
                response_id, answer["model"], text, choice["finish_reason"], answer["usage"], created
            )
        )
    return StreamingResponse(
        _events(chat, response_id, serving.model_name, created),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _events(chat: StreamingResponse, response_id: str, model: str, created: int):
    """The chat stream's chunks as Responses events."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence, **fields})}\n\n"

    item_id = f"msg_{response_id}"
    pending = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": "in_progress",
        "output": [],
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
    }
    yield event("response.created", response=pending)
    yield event(
        "response.output_item.added", output_index=0, item=_message_item(response_id, "", "in_progress")
    )
    yield event(
        "response.content_part.added",
        item_id=item_id,
        output_index=0,
        content_index=0,
        part={"type": "output_text", "text": "", "annotations": []},
    )
    text, finish, usage = "", None, None
    async for raw in chat.body_iterator:
        for line in (raw if isinstance(raw, str) else raw.decode()).splitlines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                yield event("error", message=chunk["error"]["message"], code=chunk["error"].get("code"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or ""
                if delta:
                    text += delta
                    yield event(
                        "response.output_text.delta",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        delta=delta,
                        logprobs=[],
                    )
                finish = choice.get("finish_reason") or finish
    yield event(
        "response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text, logprobs=[]
    )
    yield event(
        "response.content_part.done",
        item_id=item_id,
        output_index=0,
        content_index=0,
        part={"type": "output_text", "text": text, "annotations": []},
    )
    yield event(
        "response.output_item.done", output_index=0, item=_message_item(response_id, text, "completed")
    )
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    final = response_object(response_id, model, text, finish, usage, created)
    yield event(
        "response.completed" if final["status"] == "completed" else "response.incomplete", response=final
    )

"""Checks run by the `openai` package in its own venv (this file imports nothing from ascq): the Responses API
plain and streamed, and streamed chat tool calls under a named tool_choice and under "required". Prints one
JSON line per check: {"name", "ok", "detail"}.

    python openai_checks.py --base-url http://127.0.0.1:8000/v1 --model zoo/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from openai import OpenAI

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
QUESTION = "Answer in one short sentence: what is the capital of France?"


def responses_plain(client: OpenAI, model: str) -> tuple[bool, str]:
    response = client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=512)
    text = response.output_text
    ok = response.status == "completed" and bool(text.strip())
    return ok, f"status {response.status}, {len(text)} chars: {text[:60]!r}"


def responses_stream(client: OpenAI, model: str) -> tuple[bool, str]:
    deltas: list[str] = []
    final = None
    for event in client.responses.create(
        model=model, input=QUESTION, temperature=0, max_output_tokens=512, stream=True
    ):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event
    if final is None:
        return False, f"{len(deltas)} text deltas, no final response event"
    text = "".join(deltas)
    ok = final.type == "response.completed" and bool(text.strip()) and final.response.output_text == text
    return ok, f"{len(deltas)} text deltas, final {final.type} ({final.response.status}): {text[:60]!r}"


def tool_call_stream(client: OpenAI, model: str, tool_choice: str | dict) -> tuple[bool, str]:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=128,
        stream=True,
    )
    tool_chunks, names, arguments, finish = 0, [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                tool_chunks += 1
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    arguments.append(call.function.arguments)
    joined = "".join(arguments)
    try:
        parsed = json.loads(joined)
    except json.JSONDecodeError as e:
        return False, f"{tool_chunks} tool-call chunks, arguments not JSON ({e}): {joined[:80]!r}"
    ok = tool_chunks > 1 and names == ["get_weather"] and isinstance(parsed, dict)
    return ok, f"{tool_chunks} tool-call chunks, names {names}, finish {finish}, arguments {joined}"


def run_checks(base_url: str, model: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    named = {"type": "function", "function": {"name": "get_weather"}}
    checks: dict[str, Callable[[], tuple[bool, str]]] = {
        "responses": lambda: responses_plain(client, model),
        "responses stream": lambda: responses_stream(client, model),
        "chat tool_choice named stream": lambda: tool_call_stream(client, model, named),
        "chat tool_choice required stream": lambda: tool_call_stream(client, model, "required"),
    }
    for name, check in checks.items():
        try:
            ok, detail = check()
        except Exception as e:  # a client-side error is this check's failure, the others still run
            ok, detail = False, f"{type(e).__name__}: {e}"
        print(json.dumps({"name": name, "ok": ok, "detail": detail}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    run_checks(args.base_url, args.model)

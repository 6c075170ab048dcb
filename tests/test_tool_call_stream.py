"""Streamed tool calls against the non-streamed parse of the same text: the text arrives cut at every
character, and the deltas must add up to the calls and content the whole message gives."""

from __future__ import annotations

import json

import pytest

from ascq.runtime.server.tool_call_stream import ToolCallStream
from ascq.runtime.server.tool_calls import parse_hermes

NAMES = {"get_weather", "search"}

HERMES_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>",
    '<tool_call>{"name": "search", "arguments": {"q": "a } tricky \\" {string", "n": [1, {"x": 2}]}}'
    "</tool_call>\n"
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
    "no calls here, only a <tool_ that never opens",
    '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>',
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> then text',
    "<tool_call>not json</tool_call> and <tool_call>\n"
    '{"name": "search", "arguments": {"q": "ok"}}</tool_call>',
    '<tool_call>{"name": "search", "parameters": {"q": "y"}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": "a string"}</tool_call>',
]


def decoded(arguments: str) -> object:
    """Arguments compared as JSON values; a model's non-JSON arguments string is passed on as written."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def stream_char_by_char(stream: ToolCallStream, text: str) -> tuple[str, list[dict], int]:
    """(content, [{"id", "name", "arguments"}] per call, number of feeds that carried arguments)."""
    content, calls, num_argument_feeds = "", [], 0
    for end in range(1, len(text) + 1):
        piece, deltas = stream.feed(text[:end], end == len(text))
        content += piece
        num_argument_feeds += any(d.function.arguments for d in deltas)
        for delta in deltas:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.function.name
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            calls[delta.index]["arguments"] += delta.function.arguments
    return content, calls, num_argument_feeds


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_stream_adds_up_to_the_parsed_message(text: str, parallel: bool) -> None:
    content, calls, _ = stream_char_by_char(ToolCallStream("auto", NAMES, parallel), text)
    expected_content, expected_calls = parse_hermes(text, NAMES, parallel)
    assert [c["name"] for c in calls] == [c.function.name for c in expected_calls]
    for call, expected in zip(calls, expected_calls, strict=True):
        assert decoded(call["arguments"]) == decoded(expected.function.arguments)
    assert len({c["id"] for c in calls}) == len(calls)
    assert (content.strip() or None if calls else content) == expected_content


def test_arguments_arrive_as_they_are_written() -> None:
    text = HERMES_TEXTS[0]
    content, calls, num_argument_feeds = stream_char_by_char(ToolCallStream("auto", NAMES), text)
    assert calls[0]["arguments"] == '{"city": "Paris", "unit": "c"}'  # the model's own text, piece by piece
    assert num_argument_feeds == len(calls[0]["arguments"])
    assert content == "Let me check."  # whitespace before a call is not sent, as the whole message strips it


def test_a_call_cut_short_streams_what_was_written() -> None:
    text = '<tool_call>{"name": "search", "arguments": {"q": "cut sh'
    _, calls, _ = stream_char_by_char(ToolCallStream("auto", NAMES), text)
    assert calls == [{"id": calls[0]["id"], "name": "search", "arguments": '{"q": "cut sh'}]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_array_streams_each_call(parallel: bool) -> None:
    items = [
        {"name": "search", "arguments": {"q": "[x]", "k": {"a": 1}}},
        {"name": "get_weather", "arguments": {}},
    ]
    text = " [ " + ",\n ".join(json.dumps(item) for item in items) + " ] "
    content, calls, num_argument_feeds = stream_char_by_char(
        ToolCallStream("required", NAMES, parallel), text
    )
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (i["name"], i["arguments"]) for i in items
    ]
    assert num_argument_feeds > 2


def test_named_streams_the_text_as_arguments() -> None:
    text = '{"city": "Oslo"}'
    _, calls, num_argument_feeds = stream_char_by_char(
        ToolCallStream("named", NAMES, named="get_weather"), text
    )
    assert calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": text}]
    assert num_argument_feeds == len(text)


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode 'none'"):
        ToolCallStream("none", NAMES)

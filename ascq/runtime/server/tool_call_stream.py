"""Tool calls streamed as they are decoded, as vLLM's tool parsers stream them.

Fed a message's whole text so far, a `ToolCallStream` returns the content and the tool-call deltas not yet
sent: each call's id and name first, then its arguments' JSON in the pieces the model writes (the object is
scanned brace by brace with strings and escapes respected, so the pieces concatenate to the arguments). The
text it reads, by `tool_choice` (see tool_calls.py):
- "auto": hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks inside content. A block
  whose head is written another way is sent whole once it closes; one that does not parse as a call naming a
  tool stays content, as in the non-streamed reply.
- "required": the forced JSON array `[{"name": ..., "arguments": {...}}, ...]`.
- a named function: the forced arguments object itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ascq.runtime.server.protocol import ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall
from ascq.runtime.server.tool_calls import new_call, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
ARRAY_OPEN = re.compile(r"\s*\[")
OBJECT_CLOSE = re.compile(r"\s*\}")
ITEM_END = re.compile(r"\s*([,\]])")


def tool_call_stream(body: ChatCompletionRequest, mode: str) -> ToolCallStream:
    named = body.tool_choice.function.name if mode == "named" else None
    names = {tool.function.name for tool in body.tools}
    return ToolCallStream(mode, names, body.parallel_tool_calls is not False, named)


class ToolCallStream:
    def __init__(self, mode: str, names: set[str], parallel: bool = True, named: str | None = None) -> None:
        if mode not in ("auto", "required", "named"):
            raise ValueError(f"no streamed tool calls for mode {mode!r}")
        self.mode = mode
        self.names = names
        self.parallel = parallel
        self.named = named
        self.state = {"auto": "content", "required": "array", "named": "named"}[mode]
        self.pos = 0  # text before this is handled
        self.block_start = 0  # where the current <tool_call> began
        self.num_calls = 0
        self.depth = 0  # of the arguments object being scanned
        self.in_string = False
        self.escaped = False
        self.pending_space = ""  # whitespace-only content, sent only if more content follows it
        self._new_content: list[str] = []
        self._new_calls: list[DeltaToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content, tool-call deltas) that `text`, the message so far, adds to what was already returned."""
        self._new_content, self._new_calls = [], []
        while getattr(self, f"_{self.state}")(text, final):
            pass
        if final and self.state == "content" and not self.num_calls:
            self._new_content.append(self.pending_space)
        return "".join(self._new_content), self._new_calls

    # ---- deltas ------------------------------------------------------------------------------------------

    def _send_content(self, piece: str) -> None:
        if not piece.strip():
            self.pending_space += piece
            return
        self._new_content.append(self.pending_space + piece)
        self.pending_space = ""

    def _start_call(self, name: str) -> None:
        function = DeltaFunctionCall(name=name, arguments="")
        call = DeltaToolCall(index=self.num_calls, id=new_call_id(), type="function", function=function)
        self._new_calls.append(call)
        self.num_calls += 1

    def _send_arguments(self, piece: str) -> None:
        if not piece:
            return
        index = self.num_calls - 1
        if self._new_calls and self._new_calls[-1].index == index:
            self._new_calls[-1].function.arguments += piece
        else:
            self._new_calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)))

    # ---- states: each handles what it can and says whether another state should look at the text ---------

    def _named(self, text: str, final: bool) -> bool:
        self._start_call(self.named)
        self.state = "raw"
        return True

    def _raw(self, text: str, final: bool) -> bool:
        self._send_arguments(text[self.pos :])
        self.pos = len(text)
        return False

    def _content(self, text: str, final: bool) -> bool:
        start = text.find(OPEN, self.pos)
        if start < 0:
            end = len(text) if final else len(text) - _partial_tag_length(text, self.pos)
            self._send_content(text[self.pos : end])
            self.pos = end
            return False
        self._send_content(text[self.pos : start])
        self.block_start, self.pos = start, start + len(OPEN)
        self.state = "head" if self.parallel or not self.num_calls else "block"
        return True

    def _array(self, text: str, final: bool) -> bool:
        return self._expect(ARRAY_OPEN, text, "head")

    def _head(self, text: str, final: bool) -> bool:
        match = CALL_HEAD.match(text, self.pos)
        name = _json_string(match.group(1)) if match else None
        if name is None or name not in self.names:
            closed = self.mode == "auto" and text.find(CLOSE, self.pos) >= 0
            if match is None and not closed and not final:
                return False  # the head may still be coming
            self.state = "block" if self.mode == "auto" else "done"
            return True
        self._start_call(name)
        self.pos = match.end()
        self.state, self.depth, self.in_string, self.escaped = "arguments", 0, False, False
        return True

    def _arguments(self, text: str, final: bool) -> bool:
        i = self.pos
        if self.depth == 0:
            while i < len(text) and text[i].isspace():
                i += 1
            self.pos = i
            if i == len(text):
                return False
            if text[i] != "{":  # not an object: sent whole when the block closes
                self.state = "whole_arguments" if self.mode == "auto" else "done"
                return True
        while i < len(text):
            if self._scan(text[i]):
                self._send_arguments(text[self.pos : i + 1])
                self.pos = i + 1
                self.state = "close_tag" if self.mode == "auto" else "close_object"
                return True
            i += 1
        self._send_arguments(text[self.pos :])
        self.pos = len(text)
        return False

    def _scan(self, char: str) -> bool:
        """Advance the JSON scan by one character; True when it closes the arguments object."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False

    def _close_tag(self, text: str, final: bool) -> bool:
        end = text.find(CLOSE, self.pos)
        if end < 0:
            return False
        self.pos, self.state = end + len(CLOSE), "content"
        return True

    def _close_object(self, text: str, final: bool) -> bool:
        return self._expect(OBJECT_CLOSE, text, "item_end")

    def _item_end(self, text: str, final: bool) -> bool:
        match = ITEM_END.match(text, self.pos)
        if match is None:
            return False
        self.pos, self.state = match.end(), "head" if match.group(1) == "," else "done"
        return True

    def _block(self, text: str, final: bool) -> bool:
        """A <tool_call> block that could not be streamed: a call once it closes, or content."""
        body, after = self._closed_block(text, final)
        if body is None:
            return False
        call = _parse_call(body, self.names)
        if call is not None and (self.parallel or not self.num_calls):
            self._start_call(call["name"])
            self._send_arguments(_arguments_text(call))
        elif call is None:
            self._send_content(text[self.block_start : after])
        self.pos, self.state = after, "content"
        return True

    def _whole_arguments(self, text: str, final: bool) -> bool:
        """A started call whose arguments are not an object: sent in one piece once its block closes."""
        body, after = self._closed_block(text, final)
        if body is None:
            return False
        call = _parse_call(body, self.names)
        if call is not None:
            self._send_arguments(_arguments_text(call))
        self.pos, self.state = after, "content"
        return True

    def _done(self, text: str, final: bool) -> bool:
        return False

    def _expect(self, pattern: re.Pattern[str], text: str, next_state: str) -> bool:
        match = pattern.match(text, self.pos)
        if match is None:
            return False
        self.pos, self.state = match.end(), next_state
        return True

    def _closed_block(self, text: str, final: bool) -> tuple[str | None, int]:
        """(the current block's text between the tags, where the text after it starts); None until closed."""
        end = text.find(CLOSE, self.pos)
        if end < 0:
            return (text[self.block_start + len(OPEN) :], len(text)) if final else (None, 0)
        return text[self.block_start + len(OPEN) : end], end + len(CLOSE)


def _partial_tag_length(text: str, pos: int) -> int:
    """Length of the longest end of text[pos:] that could be the start of <tool_call>."""
    for length in range(min(len(OPEN) - 1, len(text) - pos), 0, -1):
        if text.endswith(OPEN[:length]):
            return length
    return 0


def _json_string(escaped: str) -> str | None:
    try:
        return json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return None


def _parse_call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) and call.get("name") in names else None


def _arguments_text(call: dict[str, Any]) -> str:
    return new_call(call["name"], call.get("arguments", call.get("parameters", {}))).function.arguments

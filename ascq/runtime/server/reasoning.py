"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's `<think>...</think>` text goes to the
chat message's `reasoning_content`, the rest to `content`, non-streaming and streaming alike.

- deepseek_r1: DeepSeek-R1's template opens `<think>` in the prompt, so text before `</think>` is reasoning
  whether or not the output repeats `<think>`; without `</think>` everything is reasoning.
- qwen3: reasoning only between `<think>` and `</think>`; an output without `</think>` is all content. Like
  vLLM, a non-streamed output with `</think>` but no `<think>` is split at `</think>`, while a stream is
  content until it sees `<think>`.

Streams work on the cumulative text: a trailing piece that could still become a tag is held back until the
next chunk (or the end), so a tag is never split across the two fields.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    reasoning_without_start: bool  # text before </think> is reasoning even when <think> is not in the output

    def split(self, text: str, streaming: bool = False) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None where there is none."""
        before, start, after = text.partition(START)
        body = after if start else before
        in_reasoning = bool(start) or self.reasoning_without_start or (not streaming and END in body)
        if not in_reasoning:
            return None, text
        reasoning, end, content = body.partition(END)
        if not end:
            return reasoning, None
        return reasoning, content or None


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", reasoning_without_start=True),
    "qwen3": ReasoningParser("qwen3", reasoning_without_start=False),
}


def _held_back(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a tag (it may still become one)."""
    for size in range(min(len(text), len(END) - 1), 0, -1):
        tail = text[-size:]
        if START.startswith(tail) or END.startswith(tail):
            return size
    return 0


class ReasoningStream:
    """One streamed choice: each call gets the cumulative text and returns the (reasoning, content) deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        safe = text if finished else text[: len(text) - _held_back(text)]
        reasoning, content = self.parser.split(safe, streaming=True)
        delta_reasoning = _delta(self.reasoning, reasoning or "")
        delta_content = _delta(self.content, content or "")
        self.reasoning, self.content = reasoning or "", content or ""
        return delta_reasoning or None, delta_content or None


def _delta(sent: str, now: str) -> str:
    return now[len(sent) :] if now.startswith(sent) else now

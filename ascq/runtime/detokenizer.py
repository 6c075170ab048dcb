"""Incremental detokenization (vLLM's offsets scheme) and stop-string matching."""

from __future__ import annotations

from typing import Any

NUM_PROMPT_CONTEXT_TOKENS = 5  # decode with a little prompt context so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """The text this token completes (empty while a multi-byte character is still incomplete)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full_text[len(prefix_text):]
        return ""


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string ending in the last `num_new_chars` characters, if any."""
    found = []
    for s in stop:
        index = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if index != -1:
            found.append((index, s))
    return min(found) if found else None

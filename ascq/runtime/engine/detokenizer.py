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
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full_text[len(prefix_text) :]
        return ""


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string ending in the last `num_new_chars` characters, if
    any."""
    found = []
    for s in stop:
        index = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if index != -1:
            found.append((index, s))
    return min(found) if found else None


def stop_token_reason(
    token_id: int, num_output_tokens: int, params: Any, eos_token_ids: set[int]
) -> tuple[bool, int | None]:
    """Whether generation stops on this token, and its stop_reason: EOS (unless ignore_eos; reason None) or
    one of stop_token_ids (reason: the id), once min_tokens are out. The engine and the serving process's
    output processor both apply this rule, so they agree on which token ended a sequence."""
    if num_output_tokens < params.min_tokens:
        return False, None
    if token_id in eos_token_ids and not params.ignore_eos:
        return True, None
    if token_id in params.stop_token_ids:
        return True, token_id
    return False, None


class OutputText:
    """One sequence's output text: incremental detokenisation, stop strings, and the partial stop string held
    back while the sequence is still running."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: Any) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.params = params
        self.text = ""

    def add_token(self, token_id: int, num_output_tokens: int, stop_token: bool) -> str | None:
        """Adds the text of output token number `num_output_tokens`; returns the stop string it completed (the
        text then ends before it, or after it with include_stop_str_in_output). `stop_token`: generation
        stopped on this token (stop_token_reason), whose text is dropped unless include_stop_str_in_output."""
        delta = self.detokenizer.add_token(token_id)
        self.text += delta
        params = self.params
        if stop_token:
            if not params.include_stop_str_in_output:
                self.text = self.text[: len(self.text) - len(delta)]
            return None
        if num_output_tokens < params.min_tokens or not delta or not params.stop:
            return None
        match = find_stop_string(self.text, len(delta), params.stop)
        if match is None:
            return None
        index, stop = match
        self.text = self.text[: index + len(stop) if params.include_stop_str_in_output else index]
        return stop

    def visible(self, finished: bool) -> str:
        """The text to show: while running, without a tail that may still become a stop string."""
        if finished or not self.params.stop:
            return self.text
        return self.text[: max(0, len(self.text) - max(len(s) for s in self.params.stop) + 1)]

"""Engine logprobs (one `{token_id: logprob}` per generated token, sampled token plus top-n) in OpenAI's
shapes."""

from __future__ import annotations

from typing import Any

from ascq.runtime.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
)

MISSING_LOGPROB = -9999.0  # vLLM's stand-in when the sampled token's logprob is not known


class LogprobFormatter:
    def __init__(self, tokenizer: Any, tokens_as_ids: bool = False) -> None:
        """`tokens_as_ids`: vLLM's --return-tokens-as-token-ids: logprob tokens are 'token_id:N' (tokens that
        do not decode to valid UTF-8 on their own stay identifiable)."""
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids

    def completion(
        self, token_ids: list[int], steps: list[dict[int, float]] | None, top_n: int | None, text_offset: int
    ) -> CompletionLogprobs | None:
        """/v1/completions `logprobs`: token strings, their logprobs, top-n dicts and character offsets."""
        if top_n is None:
            return None
        result = CompletionLogprobs()
        for token_id, step in zip(token_ids, _padded(steps, len(token_ids)), strict=True):
            text = self._text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(finite(step[token_id]) if step and token_id in step else None)
            result.top_logprobs.append(self._top_dict(step, top_n, token_id) if step else None)
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result

    def prompt(
        self, steps: list[dict[int, float] | None] | None
    ) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, decoded_token}}; the first is
        None."""
        if steps is None:
            return None
        return [
            None
            if step is None
            else {
                str(t): PromptLogprob(logprob=finite(lp), decoded_token=self._text(t))
                for t, lp in step.items()
            }
            for step in steps
        ]

    @staticmethod
    def concat(
        first: CompletionLogprobs | None, second: CompletionLogprobs | None
    ) -> CompletionLogprobs | None:
        if first is None or second is None:
            return first or second
        return CompletionLogprobs(
            tokens=first.tokens + second.tokens,
            token_logprobs=first.token_logprobs + second.token_logprobs,
            top_logprobs=first.top_logprobs + second.top_logprobs,
            text_offset=first.text_offset + second.text_offset,
        )

    def chat(
        self, token_ids: list[int], steps: list[dict[int, float]] | None, top_n: int | None
    ) -> ChatLogprobs | None:
        """/v1/chat/completions `logprobs.content`: one entry per token with its top-n alternatives."""
        if top_n is None:
            return None
        content = []
        for token_id, step in zip(token_ids, _padded(steps, len(token_ids)), strict=True):
            top = [self._entry(t, finite(lp)) for t, lp in _top(step, top_n)]
            sampled = self._entry(token_id, finite((step or {}).get(token_id, MISSING_LOGPROB)))
            content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top_dict(self, step: dict[int, float], top_n: int, sampled: int) -> dict[str, float]:
        """The top-n alternatives and, as vLLM's completions do, the sampled token when it is not among
        them."""
        top: dict[str, float] = {}
        # distinct ids may decode alike (partial UTF-8): keep the best
        for token_id, logprob in _top(step, top_n):
            top.setdefault(self._text(token_id), finite(logprob))
        if sampled in step:
            top.setdefault(self._text(sampled), finite(step[sampled]))
        return top

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self.tokenizer.decode([token_id])

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self._text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def finite(logprob: float) -> float:
    """JSON has no -inf: a token masked out (structured outputs, bans) reports vLLM's -9999.0."""
    return max(logprob, MISSING_LOGPROB)


def _padded(steps: list[dict[int, float]] | None, length: int) -> list[dict[int, float] | None]:
    return (list(steps or []) + [None] * length)[:length]


def _top(step: dict[int, float] | None, top_n: int) -> list[tuple[int, float]]:
    return sorted((step or {}).items(), key=lambda item: -item[1])[:top_n]

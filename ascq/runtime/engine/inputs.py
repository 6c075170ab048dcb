"""vLLM's prompt shapes (vllm/inputs/data.py): a string, a token id list, `TextPrompt` or `TokensPrompt`."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from ascq.core.errors import UnsupportedError


class TextPrompt(TypedDict):
    """vLLM's text prompt: `{"prompt": str}`, optionally with a `cache_salt`."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's pre-tokenized prompt: `{"prompt_token_ids": [...]}`, optionally with a `cache_salt`."""

    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt | dict[str, Any]
PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def parse_prompt(prompt: PromptType) -> str | list[int] | dict[str, Any]:
    """The text or token ids of one vLLM-style prompt (a dict with its `cache_salt` when it has one)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise ValueError(
                f"prompt dict keys {sorted(unknown)} are not supported; supported: "
                f"{', '.join(sorted(PROMPT_KEYS))}"
            )
        if prompt.get("cache_salt") is not None:
            if not isinstance(prompt["cache_salt"], str) or not prompt["cache_salt"]:
                raise ValueError("cache_salt must be a non-empty string")
            inner = parse_prompt({k: v for k, v in prompt.items() if k != "cache_salt"})
            key = "prompt" if isinstance(inner, str) else "prompt_token_ids"
            return {key: inner, "cache_salt": prompt["cache_salt"]}
        if "prompt_token_ids" in prompt:
            return parse_prompt(list(prompt["prompt_token_ids"]))
        if "prompt" in prompt:
            return parse_prompt(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt)")
    if isinstance(prompt, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise ValueError(
        f"unsupported prompt type {type(prompt).__name__}: give a str, a list of token ids, or a "
        "TextPrompt / TokensPrompt dict"
    )


def as_prompt_list(prompts: PromptType | list[PromptType]) -> list[str | list[int] | dict[str, Any]]:
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    return [parse_prompt(p) for p in prompts]


def check_request_options(
    lora_request: Any = None,
    tokenization_kwargs: dict[str, Any] | None = None,
    trace_headers: Any = None,
    priority: int = 0,
) -> None:
    """vLLM's per-request keywords of `add_request` / `generate` beyond prompt and params: their defaults are
    what ascq does; anything else is refused in one line."""
    if lora_request is not None:
        raise UnsupportedError("lora_request: LoRA adapters are not supported")
    if tokenization_kwargs:
        raise UnsupportedError("tokenization_kwargs are not supported (pass token ids as a TokensPrompt)")
    if trace_headers:
        raise UnsupportedError("trace_headers: OpenTelemetry tracing is not supported")
    if priority:
        raise UnsupportedError("priority: ascq schedules first come, first served (priority 0 only)")

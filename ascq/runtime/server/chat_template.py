"""Chat prompts: the tokenizer's chat template, or one given with --chat-template (a file or an inline
template).

Rendered prompts are tokenized without adding special tokens, as vLLM does: the template writes BOS itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from ascq.core.errors import AscqError
from ascq.runtime.server.protocol import APIError


def load_chat_template(value: str | Path | None) -> str | None:
    """--chat-template: a path to a Jinja file, or the template text itself (it contains '{')."""
    if value is None:
        return None
    text = str(value)
    if "{" in text:
        return text
    path = Path(text)
    if not path.is_file():
        raise AscqError(f"--chat-template {text} is neither a file nor a Jinja template")
    return path.read_text(encoding="utf-8")


class ChatPrompter:
    """Renders chat messages to prompt token ids with one template."""

    def __init__(self, tokenizer: Any, template: str | None) -> None:
        self.tokenizer = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The prompt's token ids: the template rendered (vLLM's chat fields: `continue_final_message`,
        `documents`, `chat_template_kwargs` as `template_kwargs`), then tokenized with special tokens only
        when `add_special_tokens` (the template writes its own)."""
        if not self.template:
            raise APIError(
                400,
                "this model has no chat template; start the server with --chat-template",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                **(template_kwargs or {}),
            )
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
        ) as exc:  # templates reject conversations (role order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

"""vLLM's LAST pooling for a decoder model's embeddings: the final hidden state of the prompt's last token,
L2-normalized, read from the step that computes it (prefix caching never skips a prompt's last token)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def last_token_embedding(hidden_state: torch.Tensor) -> list[float]:
    return F.normalize(hidden_state.float(), dim=-1).tolist()


def record_prompt_embeddings(
    scheduled: Any, recorded: dict[int, list[float] | None], hidden_states: torch.Tensor
) -> None:
    """Set `recorded[id(request)]` for each request whose last prompt token this step computed."""
    start = 0
    for request, num_new in zip(scheduled.requests, scheduled.num_scheduled_tokens, strict=True):
        last = request.num_prompt_tokens - 1 - request.num_computed_tokens  # its row in this chunk
        if id(request) in recorded and recorded[id(request)] is None and 0 <= last < num_new:
            recorded[id(request)] = last_token_embedding(hidden_states[start + last])
        start += num_new

"""vLLM's prompt_logprobs: the log-softmax of the raw logits at every newly computed prompt position, read
from the step's hidden states (requests asking for them skip prefix-cache hits, so every position is
computed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def record_prompt_logprobs(
    scheduled: Any,
    recorded: dict[int, list[dict[int, float] | None]],
    hidden_states: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Append to `recorded[id(request)]` (first entry None) one {token_id: logprob} per prompt token this step
    computed the prediction of: the prompt's own token plus the top `prompt_logprobs`."""
    start = 0
    for request, num_new in zip(scheduled.requests, scheduled.num_scheduled_tokens, strict=True):
        entries = recorded.get(id(request))
        first = request.num_computed_tokens  # predicts token first + 1
        if (
            entries is not None
            and first < len(entries) <= first + num_new
            and len(entries) < request.num_prompt_tokens
        ):
            last = min(num_new, request.num_prompt_tokens - 1 - first)
            rows = torch.arange(start + len(entries) - 1 - first, start + last)
            logprobs = compute_logits(hidden_states[rows]).float().log_softmax(-1).cpu()
            top_n = request.params.prompt_logprobs
            prompt_ids = request.token_ids[len(entries) : request.num_prompt_tokens]
            for row, token_id in zip(logprobs, prompt_ids, strict=False):
                entry = {token_id: float(row[token_id])}
                if top_n:
                    values, ids = row.topk(top_n)
                    entry.update(zip(ids.tolist(), values.tolist(), strict=True))
                entries.append(entry)
        start += num_new

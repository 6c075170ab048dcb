"""Prompt-lookup proposer (vLLM's `ngram`): find the longest suffix of the sequence (prompt + output), between
prompt_lookup_min and prompt_lookup_max tokens, that occurred earlier, and propose the tokens that followed
its most recent earlier occurrence."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ascq.runtime.sched.request import Request


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest matching suffix n-gram."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        windows = sliding_window_view(tokens[: total - 1], n)  # windows starting before the suffix itself
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return tokens[follow : follow + k].tolist()
    return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[tuple[list[int], None]]:
        """(proposed tokens, no draft distribution) per request, at most max_tokens[i] each."""
        return [
            (propose_ngram(r.token_ids, self.min_n, self.max_n, min(self.k, m)) if m > 0 else [], None)
            for r, m in zip(requests, max_tokens, strict=True)
        ]

    def forget(self, request: Request) -> None:
        pass

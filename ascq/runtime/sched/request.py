"""One sequence being served: its tokens, progress through the KV cache, sampling state and output so far."""

from __future__ import annotations

import enum

import torch

from ascq.runtime.sampling.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        index: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        # vLLM's: requests share cached prefix blocks only with the same salt
        self.cache_salt = cache_salt
        self.first_scheduled_time: float | None = None  # time.monotonic() when it first left the queue
        self.prompt = prompt
        self.params = params
        self.generator = generator
        self.index = index  # which of the parent's n completions this is
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # sha256 key chain over this request's full blocks, grown lazily
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # speculative decoding: tokens proposed for the next step, and the draft's distribution over each
        # (None: a proposer without one, n-gram); they become extra query rows when the scheduler fits them
        self.spec_token_ids: list[int] = []
        self.spec_token_probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

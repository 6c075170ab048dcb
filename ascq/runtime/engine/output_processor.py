"""Serving-process side of the engine core (vLLM v1's OutputProcessor): token-id deltas from the core become
cumulative `RequestOutput`s with text.

The engine core ships token ids only; detokenisation, stop strings and the hold-back of a partial stop string
happen here, with the same rules the in-process engine applies (ascq/runtime/engine/detokenizer.py). A stop
string found here finishes the sequence at once (later tokens the core already made are dropped) and is
reported back, so the core stops generating it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascq.runtime.engine.detokenizer import OutputText, stop_token_reason
from ascq.runtime.engine.engine_core import OutputDelta
from ascq.runtime.engine.outputs import CompletionOutput, RequestOutput


@dataclass
class _Sequence:
    text: OutputText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any
    sequences: list[_Sequence]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_embedding: list[float] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any) -> None:
        sequences = [
            _Sequence(
                OutputText(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
            )
            for _ in range(params.n)
        ]
        self.requests[request_id] = _Request(prompt, list(prompt_token_ids), params, sequences)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, delta: OutputDelta) -> tuple[RequestOutput | None, list[tuple[int, str]]]:
        """The request's new cumulative output (None when it was forgotten meanwhile), and (index, stop
        string) for each sequence a stop string finished here: the core has to finish those too."""
        request = self.requests.get(delta.request_id)
        if request is None:
            return None, []
        if delta.prompt_logprobs is not None:
            request.prompt_logprobs = delta.prompt_logprobs
        if delta.prompt_embedding is not None:
            request.prompt_embedding = delta.prompt_embedding
        stopped = []
        for d in delta.completions:
            sequence = request.sequences[d.index]
            if sequence.finish_reason is None:
                stop_string = self._add_tokens(sequence, request.params, d.token_ids, d.logprobs)
                if stop_string is not None:
                    stopped.append((d.index, stop_string))
                elif sequence.finish_reason is None and d.finish_reason is not None:  # length, grammar, abort
                    sequence.finish_reason, sequence.stop_reason = d.finish_reason, d.stop_reason
        finished = all(s.finish_reason is not None for s in request.sequences)
        if finished:
            del self.requests[delta.request_id]
        completions = [
            CompletionOutput(
                index,
                s.text.visible(s.finish_reason is not None),
                list(s.token_ids),
                s.cumulative_logprob if s.logprobs is not None else None,
                list(s.logprobs) if s.logprobs is not None else None,
                s.finish_reason,
                s.stop_reason,
            )
            for index, s in enumerate(request.sequences)
        ]
        output = RequestOutput(
            delta.request_id,
            request.prompt,
            request.prompt_token_ids,
            completions,
            finished,
            delta.num_cached_tokens,
            request.prompt_logprobs,
            delta.first_scheduled_time,
            request.prompt_embedding,
        )
        return output, stopped

    def _add_tokens(
        self, sequence: _Sequence, params: Any, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> str | None:
        """Appends tokens until one ends the sequence; returns the stop string if one did."""
        for k, token_id in enumerate(token_ids):
            sequence.token_ids.append(token_id)
            if sequence.logprobs is not None:
                sequence.logprobs.append(logprobs[k])
                sequence.cumulative_logprob += logprobs[k][token_id]
            num_output_tokens = len(sequence.token_ids)
            on_token, token_reason = stop_token_reason(
                token_id, num_output_tokens, params, self.eos_token_ids
            )
            stop_string = sequence.text.add_token(token_id, num_output_tokens, on_token)
            if on_token:
                sequence.finish_reason, sequence.stop_reason = "stop", token_reason
                return None
            if stop_string is not None:
                sequence.finish_reason, sequence.stop_reason = "stop", stop_string
                return stop_string
        return None

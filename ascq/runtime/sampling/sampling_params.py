"""Per-request sampling settings, with vLLM's names, defaults and semantics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ascq.runtime.sampling.structured_output import StructuredOutputsParams

# fn(output_token_ids, logits [vocab]) -> logits, or fn(prompt_token_ids, output_token_ids, logits) -> logits,
# applied per request before everything else (vLLM v0's plug-in point)
LogitsProcessor = Callable[..., torch.Tensor]
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range; vLLM clamps to it too


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM < 0.11's name for structured_outputs
    # "last": also return the prompt's embedding, its last token's final hidden state L2-normalized (vLLM's
    # LAST pooling for a decoder model's /v1/embeddings; vLLM carries it in PoolingParams)
    pooling: str | None = None
    # set by the engine from the tokenizer (vLLM's update_from_tokenizer): token ids of each bad word variant
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = {
                int(t): max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))
                for t, b in self.logit_bias.items()
            }
        for message in self._errors():
            raise ValueError(message)

    def _errors(self) -> list[str]:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            ),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                f"logprobs must be non-negative, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}",
            ),
            (self.pooling in (None, "last"), f"pooling must be None or 'last', got {self.pooling!r}"),
            (self.pooling is None or self.n == 1, "pooling needs n = 1"),
            (all(isinstance(s, str) for s in self.stop), "stop must be a string or a list of strings"),
            (
                all(isinstance(s, str) and s for s in self.bad_words),
                "bad_words must be a list of non-empty strings",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be token ids",
            ),
            (
                self.allowed_token_ids is None
                or (
                    bool(self.allowed_token_ids)
                    and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)
                ),
                "allowed_token_ids must be a non-empty list of token ids",
            ),
            (all(t >= 0 for t in (self.logit_bias or {})), "logit_bias keys must be token ids"),
            (
                self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs must be a StructuredOutputsParams",
            ),
        ]
        return [message for ok, message in checks if not ok]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def token_ids_in_range(self, vocab_size: int) -> str | None:
        """An error message when a token id parameter lies outside the vocabulary, else None."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            bad = [t for t in ids or [] if t >= vocab_size]
            if bad:
                return f"{name} has token ids outside [0, {vocab_size}): {bad[:5]}"
        return None

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize bad_words as vLLM does: each word alone and, where it differs, with a leading space."""
        self.bad_words_token_ids = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            self.bad_words_token_ids.append(plain)
            if spaced and spaced != plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                self.bad_words_token_ids.append(spaced)

"""vLLM's `PoolingParams`: what an embedding request asks of the pooler."""

from __future__ import annotations

from dataclasses import dataclass

from ascq.core.errors import UnsupportedError
from ascq.runtime.sampling.sampling_params import SamplingParams

POOLING_TASKS = (None, "embed", "encode")


@dataclass
class PoolingParams:
    """ascq pools a decoder model the way vLLM's `embed` task does for one: the last prompt token's final
    hidden state, L2-normalised. Anything else is refused rather than ignored."""

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    task: str | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            raise UnsupportedError("PoolingParams(dimensions=...): Matryoshka embeddings are not supported")
        if self.normalize is False:
            raise UnsupportedError("PoolingParams(normalize=False): embeddings are always L2-normalised")
        if self.activation is not None:
            raise UnsupportedError("PoolingParams(activation=...): classification heads are not supported")
        if self.task not in POOLING_TASKS:
            raise UnsupportedError(
                f"PoolingParams(task={self.task!r}) is not supported; supported: embed (last-token pooling)"
            )
        if self.truncate_prompt_tokens is not None:
            raise UnsupportedError("PoolingParams(truncate_prompt_tokens=...) is not supported")

    def to_sampling_params(self) -> SamplingParams:
        """The engine request that computes the embedding: a one-token prefill with last-token pooling."""
        return SamplingParams(max_tokens=1, temperature=0.0, pooling="last")


def as_sampling_params(params: SamplingParams | PoolingParams | None) -> SamplingParams:
    """vLLM's `params` argument (sampling or pooling) as the engine's SamplingParams."""
    if params is None:
        return SamplingParams()
    if isinstance(params, PoolingParams):
        return params.to_sampling_params()
    return params

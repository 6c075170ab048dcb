"""Turn each request's next-token logits into a token: greedy or temperature with top-k / top-p / min-p.

Plug-in points: per-request `SamplingParams.logits_processors` (fn(output_token_ids, logits) -> logits, run before
everything else), or a whole custom sampler passed to `LLMEngine(..., sampler=...)` with this `__call__`.
Logprobs are those of the (processed) logits before temperature and truncation, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascq.runtime.request import Request
from ascq.runtime.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None  # sampled token + top-n, when requested


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [S, V] outside each row's top_k (0 = off) tokens and outside its top_p probability mass."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before > top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution random sampling draws from, per row [S, V]: temperature, top-k / top-p, min-p, softmax.

    Shared with speculative decoding's rejection sampler, so both sample the same distribution."""
    logits = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    if bool((top_k > 0).any() or (top_p < 1).any()):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    min_p = torch.tensor([p.min_p for p in params])
    if bool((min_p > 0).any()):
        logits = apply_min_p(logits, min_p)
    return logits.softmax(dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> dict[int, float]:
    """{token: logprob} of the sampled token plus the `num_top` most likely, from one row of log-softmax."""
    top = {token_id: float(logprobs[token_id])}
    if num_top > 0:
        values, ids = logprobs.topk(num_top)
        top.update(zip(ids.tolist(), values.tolist(), strict=True))
    return top


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        """logits: fp32 [len(requests), vocab] on any device; sampling runs on the CPU."""
        logits = logits.float().cpu()
        for i, request in enumerate(requests):
            for processor in request.params.logits_processors:
                logits[i] = processor(request.output_token_ids, logits[i])
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample(logits[random_rows], [requests[i] for i in random_rows])
        logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            logprobs = logits.log_softmax(dim=-1)
        results = []
        for i, request in enumerate(requests):
            token_id = int(token_ids[i])
            top = None
            if request.params.logprobs is not None:
                top = token_logprobs(logprobs[i], token_id, request.params.logprobs)
            results.append(SampleResult(token_id, top))
        return results

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = sampling_probs(logits, [r.params for r in requests])
        return torch.cat([
            torch.multinomial(probs[i], 1, generator=request.generator or self.generator)
            for i, request in enumerate(requests)
        ])

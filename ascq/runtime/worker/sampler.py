"""Turn each request's next-token logits into a token, as one batch: vLLM's logits pipeline, then greedy or
temperature with top-k / top-p / min-p.

Order (vLLM v1): per-request `logits_processors` (offline plug-in, fn(output_token_ids, logits) -> logits) ->
structured-output token bitmask -> allowed_token_ids, bad_words, min_tokens (stop tokens banned), logit_bias
-> repetition / frequency / presence penalties -> logprobs -> temperature, min-p, top-k / top-p -> sample.
Every step is a tensor op over the whole batch; Python only walks each request's own sparse entries (bias
items, banned ids), never the vocabulary. A custom sampler can be passed to `LLMEngine(..., sampler=...)` with
this `__call__`. Logprobs are those of the processed logits before temperature and truncation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sampling.structured_output import apply_token_bitmask
from ascq.runtime.sched.request import Request


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
    """The distribution random sampling draws from, per row [S, V]: temperature, top-k / top-p, min-p,
    softmax.

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


def padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(
        len(rows), width
    )


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] occurrence counts of the token ids [S, L]; ids == vocab_size are padding."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on logits [S, V]. prompt_ids / output_ids [S, L] are padded with V.

    repetition: tokens seen in prompt or output are divided by it when positive, multiplied when negative;
    frequency: minus penalty x count in the output; presence: minus penalty once if in the output.
    """
    vocab = logits.shape[-1]
    output_counts = token_counts(output_ids, vocab)
    seen = (token_counts(prompt_ids, vocab) > 0) | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * (output_counts > 0)


def bad_word_bans(request: Request) -> list[int]:
    """Tokens that would complete one of the request's bad words given its output so far (vLLM's rule)."""
    output = request.output_token_ids
    bans = []
    for word in request.params.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
            bans.append(word[-1])
    return bans


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed
        self.eos_token_ids = sorted(eos_token_ids)  # banned before min_tokens

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, requests: list[Request], token_bitmask: torch.Tensor | None = None
    ) -> list[SampleResult]:
        """logits: fp32 [len(requests), vocab] on any device; sampling runs on the CPU. token_bitmask:
        xgrammar's int32 [len(requests), ceil(vocab / 32)] allowed-token bits (structured outputs)."""
        logits = self.process(logits, requests, token_bitmask)
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

    def process(
        self, logits: torch.Tensor, requests: list[Request], token_bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits pipeline up to (not including) temperature: fp32 on the CPU. Rows need only `params`,
        `prompt_token_ids`, `output_token_ids` and `num_output_tokens` (speculative decoding passes views
        whose output includes the proposed tokens before that row)."""
        logits = logits.float().cpu()
        for i, request in enumerate(requests):
            for processor in request.params.logits_processors:
                logits[i] = _call_processor(processor, request, logits[i])
        if token_bitmask is not None:
            apply_token_bitmask(logits, token_bitmask)
        logits = self._apply_bans_and_bias(logits, requests)
        penalized = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if penalized:
            logits[penalized] = self._penalize(logits[penalized], [requests[i] for i in penalized])
        return logits

    def _apply_bans_and_bias(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """allowed_token_ids, bad_words, min_tokens and logit_bias as sparse (row, token) updates of the
        batch."""
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        only_rows: list[int] = []
        only_ids: list[int] = []
        for i, request in enumerate(requests):
            params = request.params
            bans = bad_word_bans(request) if params.bad_words_token_ids else []
            if request.num_output_tokens < params.min_tokens:
                bans += params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
            ban_rows += [i] * len(bans)
            ban_ids += bans
            if params.logit_bias:
                bias_rows += [i] * len(params.logit_bias)
                bias_ids += list(params.logit_bias)
                bias_values += list(params.logit_bias.values())
            if params.allowed_token_ids:
                only_rows += [i] * len(params.allowed_token_ids)
                only_ids += params.allowed_token_ids
        if only_rows:
            rows = sorted(set(only_rows))
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[only_rows, only_ids] = True
            keep[[i for i in range(len(requests)) if i not in rows]] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        if bias_rows:
            logits.index_put_(
                (torch.tensor(bias_rows), torch.tensor(bias_ids)), torch.tensor(bias_values), accumulate=True
            )
        if ban_rows:
            logits[ban_rows, ban_ids] = float("-inf")
        return logits

    def _penalize(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        return apply_penalties(
            logits,
            padded([r.prompt_token_ids for r in requests], vocab),
            padded([r.output_token_ids for r in requests], vocab),
            torch.tensor([r.params.repetition_penalty for r in requests]),
            torch.tensor([r.params.frequency_penalty for r in requests]),
            torch.tensor([r.params.presence_penalty for r in requests]),
        )

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = sampling_probs(logits, [r.params for r in requests])
        return torch.cat(
            [
                torch.multinomial(probs[i], 1, generator=request.generator or self.generator)
                for i, request in enumerate(requests)
            ]
        )


def _call_processor(processor, request: Request, logits: torch.Tensor) -> torch.Tensor:
    """vLLM accepts fn(output_ids, logits) and fn(prompt_ids, output_ids, logits)."""
    import inspect

    try:
        num_args = len(inspect.signature(processor).parameters)
    except (TypeError, ValueError):
        num_args = 2
    if num_args == 3:
        return processor(request.prompt_token_ids, request.output_token_ids, logits)
    return processor(request.output_token_ids, logits)

"""Verify proposed tokens against the target model's distribution (Leviathan et al. 2023; vLLM's rejection_sampler).

Per sequence the target produced 1 + k rows of logits: row j is the distribution after the j first proposed tokens.
Greedy sequences accept proposed tokens while they equal the target's argmax and then emit the target's argmax.
Random sequences accept proposed token d_j with probability min(1, p(d_j) / q(d_j)) and, at the first rejection,
emit a token drawn from the normalized max(p - q, 0); when all k are accepted a bonus token is drawn from the last
row. p is the target's sampling distribution (the sampler's `sampling_probs`: temperature, top-k/top-p, min-p);
q is the draft model's, or one-hot on d_j for proposers without a distribution (n-gram). Every emitted token is
therefore distributed exactly as without speculation.
"""

from __future__ import annotations

import torch

from ascq.runtime.request import Request
from ascq.runtime.sampler import SampleResult, sampling_probs, token_logprobs


def apply_logits_processors(logits: torch.Tensor, request: Request, draft_token_ids: list[int]) -> torch.Tensor:
    """Row j sees the output so far plus the j first proposed tokens as its history."""
    if not request.params.logits_processors:
        return logits
    logits = logits.clone()
    for j in range(logits.shape[0]):
        history = request.output_token_ids + draft_token_ids[:j]
        for processor in request.params.logits_processors:
            logits[j] = processor(history, logits[j])
    return logits


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, draft_token_id: int) -> torch.Tensor:
    """Normalized max(p - q, 0); q None means one-hot on the draft token."""
    if q is None:
        residual = p.clone()
        residual[draft_token_id] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


class RejectionSampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without their own seed

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> list[list[SampleResult]]:
        """logits [sum(1 + k_i), V]: 1 + k_i rows per request, in order -> the tokens each request emits."""
        logits = logits.float().cpu()
        results = []
        row = 0
        for request, drafts, q in zip(requests, draft_token_ids, draft_probs, strict=True):
            rows = apply_logits_processors(logits[row:row + len(drafts) + 1], request, drafts)
            row += len(drafts) + 1
            if request.params.greedy:
                token_ids = self._greedy(rows, drafts)
            else:
                token_ids = self._random(rows, request, drafts, q)
            num_logprobs = request.params.logprobs
            logprobs = rows.log_softmax(dim=-1) if num_logprobs is not None else None
            results.append([
                SampleResult(t, token_logprobs(logprobs[j], t, num_logprobs) if logprobs is not None else None)
                for j, t in enumerate(token_ids)
            ])
        return results

    @staticmethod
    def _greedy(rows: torch.Tensor, drafts: list[int]) -> list[int]:
        target = rows.argmax(dim=-1).tolist()
        out = []
        for j, draft in enumerate(drafts):
            if draft != target[j]:
                break
            out.append(draft)
        out.append(target[len(out)])
        return out

    def _random(self, rows: torch.Tensor, request: Request, drafts: list[int], q: torch.Tensor | None) -> list[int]:
        generator = request.generator or self.generator
        p = sampling_probs(rows, [request.params] * rows.shape[0])
        uniform = torch.rand(len(drafts), generator=generator, dtype=torch.float64).tolist()
        out = []
        for j, draft in enumerate(drafts):
            p_draft = float(p[j, draft])
            q_draft = 1.0 if q is None else float(q[j, draft])
            if q_draft > 0 and uniform[j] < min(1.0, p_draft / q_draft):
                out.append(draft)
                continue
            residual = residual_distribution(p[j], None if q is None else q[j], draft)
            out.append(int(torch.multinomial(residual, 1, generator=generator)))
            return out
        out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
        return out

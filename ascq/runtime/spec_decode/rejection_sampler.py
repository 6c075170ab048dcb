"""Verify proposed tokens against the target model's distribution (Leviathan et al. 2023; vLLM's
rejection_sampler).

Per sequence the target produced 1 + k rows of logits: row j is the distribution after the j first proposed
tokens. Greedy sequences accept proposed tokens while they equal the target's argmax and then emit the
target's argmax. Random sequences accept proposed token d_j with probability min(1, p(d_j) / q(d_j)) and, at
the first rejection, emit a token drawn from the normalized max(p - q, 0); when all k are accepted a bonus
token is drawn from the last row. p is the target's sampling distribution: the sampler's own logits pipeline
(`Sampler.process`: logits processors, bans, bias, penalties, with the proposed tokens before each row as
history) and `sampling_probs` (temperature, min-p, top-k/top-p); q is the draft model's, or one-hot on d_j for
proposers without a distribution (n-gram). Every emitted token is therefore distributed exactly as without
speculation.
"""

from __future__ import annotations

import torch

from ascq.runtime.sched.request import Request
from ascq.runtime.worker.sampler import Sampler, SampleResult, sampling_probs, token_logprobs


class DraftRow:
    """Row j of a request's verification: the request as seen after its j first proposed tokens (what the
    sampler's logits pipeline reads: penalties, bad words, min_tokens and logits processors see that
    history)."""

    def __init__(self, request: Request, proposed: list[int]) -> None:
        self.params = request.params
        self.generator = request.generator
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + proposed
        self.num_output_tokens = len(self.output_token_ids)


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
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # its logits pipeline, and its generator for requests without their own seed
        self.generator = sampler.generator

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> list[list[SampleResult]]:
        """logits [sum(1 + k_i), V]: 1 + k_i rows per request, in order -> the tokens each request emits."""
        views = [
            DraftRow(r, drafts[:j])
            for r, drafts in zip(requests, draft_token_ids, strict=True)
            for j in range(len(drafts) + 1)
        ]
        logits = self.sampler.process(logits, views)
        results = []
        row = 0
        for request, drafts, q in zip(requests, draft_token_ids, draft_probs, strict=True):
            rows = logits[row : row + len(drafts) + 1]
            row += len(drafts) + 1
            if request.params.greedy:
                token_ids = self._greedy(rows, drafts)
            else:
                token_ids = self._random(rows, request, drafts, q)
            num_logprobs = request.params.logprobs
            logprobs = rows.log_softmax(dim=-1) if num_logprobs is not None else None
            results.append(
                [
                    SampleResult(
                        t, token_logprobs(logprobs[j], t, num_logprobs) if logprobs is not None else None
                    )
                    for j, t in enumerate(token_ids)
                ]
            )
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

    def _random(
        self, rows: torch.Tensor, request: Request, drafts: list[int], q: torch.Tensor | None
    ) -> list[int]:
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

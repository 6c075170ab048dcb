"""Speculative decoding as the engine sees it: verify last step's proposals against this step's logits, roll
back what was rejected, propose the next tokens, and count drafts for the stats (vLLM's spec-decode
metrics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ascq.runtime.sched.request import Request
from ascq.runtime.spec_decode import make_proposer
from ascq.runtime.spec_decode.rejection_sampler import RejectionSampler


class Speculator:
    def __init__(self, config: Any, engine: Any, sampler: Any) -> None:
        self.proposer = make_proposer(config, engine)
        self.rejection_sampler = RejectionSampler(sampler)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def verify(
        self,
        logits: torch.Tensor,
        sampling: list[Request],
        spec_token_ids: list[list[int]],
        sample: Callable[[torch.Tensor, list[Request]], list[Any]],
    ) -> list[list[Any]]:
        """Tokens per sampled request: `sample`'s one for requests without proposals, the rejection sampler's
        accepted run + one for the others. `spec_token_ids[i]` are sampling[i]'s proposals."""
        starts = [0]
        for spec in spec_token_ids:
            starts.append(starts[-1] + 1 + len(spec))
        plain = [i for i, spec in enumerate(spec_token_ids) if not spec]
        verified = [i for i, spec in enumerate(spec_token_ids) if spec]
        results: list[list[Any]] = [[] for _ in sampling]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            for i, result in zip(plain, sample(logits[rows], [sampling[i] for i in plain]), strict=True):
                results[i] = [result]
        if verified:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in verified]).to(logits.device)
            requests = [sampling[i] for i in verified]
            probs = [
                r.spec_token_probs[: len(spec_token_ids[i])] if r.spec_token_probs is not None else None
                for i, r in zip(verified, requests, strict=True)
            ]
            accepted = self.rejection_sampler(
                logits[rows], requests, [spec_token_ids[i] for i in verified], probs
            )
            for i, tokens in zip(verified, accepted, strict=True):
                results[i] = tokens
                self.num_drafts += 1
                self.num_draft_tokens += len(spec_token_ids[i])
                self.num_accepted_tokens += len(tokens) - 1
        return results

    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Set each running request's next proposals, capped so the last emitted token plus the proposals stay
        within max_tokens and max_model_len."""
        if not running:
            return
        room = [
            min(r.params.max_tokens - r.num_output_tokens, max_model_len - r.num_tokens) - 1 for r in running
        ]
        for request, (tokens, probs) in zip(running, self.proposer.propose(running, room), strict=True):
            request.spec_token_ids, request.spec_token_probs = tokens, probs

    def forget(self, request: Request) -> None:
        self.proposer.forget(request)

    def stats(self) -> dict[str, float | int]:
        return spec_decode_stats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)


def spec_decode_stats(drafts: int = 0, proposed: int = 0, accepted: int = 0) -> dict[str, float | int]:
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": proposed,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }

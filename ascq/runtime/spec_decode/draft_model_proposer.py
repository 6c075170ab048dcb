"""Draft-model proposer: a smaller (or quantized) model with the target's vocabulary drafts k tokens per
sequence.

The draft keeps its own paged KV cache, block manager and block tables, one `DraftSequence` per target
request. Before drafting, each draft sequence is synced to its request: KV stays valid for the longest common
prefix of the tokens the draft ran and the request's tokens (accepted proposals keep theirs), everything after
is rolled back and its blocks freed. Then k batched steps: the first runs the request's not-yet-seen tokens
(the whole prompt the first time), each later one the previous draft token. Random-sampling requests draw from
the draft's `sampling_probs` (the same temperature/top-k/top-p as the target) and hand that distribution to
the rejection sampler; greedy ones take its argmax.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ascq.core.errors import AscqError
from ascq.kernels import torch_device as backend_torch_device
from ascq.runtime.sched.block_manager import BlockManager
from ascq.runtime.sched.request import Request
from ascq.runtime.sched.scheduler import SchedulerOutput
from ascq.runtime.worker.kv_cache import allocate_kv_cache
from ascq.runtime.worker.loader import load_model, read_config
from ascq.runtime.worker.model_runner import ModelRunner
from ascq.runtime.worker.sampler import sampling_probs


class DraftSequence:
    """The draft model's view of one request: the tokens it has run and where its KV ends."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_synced = 0  # leading tokens known equal to the request's
        self.block_table: list[int] = []
        self.num_registered_blocks = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def sync(self, token_ids: list[int]) -> None:
        """Adopt the request's tokens; KV stays valid for the common prefix (never the last token)."""
        n, limit = self.num_synced, min(len(self.token_ids), len(token_ids))
        while n < limit and self.token_ids[n] == token_ids[n]:
            n += 1
        self.token_ids = list(token_ids)
        self.num_synced = len(token_ids)
        self.num_computed_tokens = min(self.num_computed_tokens, n, len(token_ids) - 1)


def check_same_vocabulary(
    draft_dir: Path, draft_config: dict[str, Any], target_config: dict[str, Any], target_tokenizer: Any
) -> None:
    """The draft must tokenize exactly like the target: same vocab size, and the same vocabulary when both
    have one."""
    draft_vocab, target_vocab = int(draft_config["vocab_size"]), int(target_config["vocab_size"])
    if draft_vocab != target_vocab:
        raise AscqError(
            f"draft model {draft_dir} has a vocabulary of {draft_vocab} tokens, the target {target_vocab}: "
            "the draft must use the target's tokenizer"
        )
    has_tokenizer = any(
        (draft_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    )
    if not has_tokenizer or not hasattr(target_tokenizer, "get_vocab"):
        return
    from ascq.runtime.worker.loader import load_tokenizer

    draft_tokens = load_tokenizer(draft_dir).get_vocab()
    target_tokens = target_tokenizer.get_vocab()
    if draft_tokens != target_tokens:
        differing = len(set(draft_tokens.items()) ^ set(target_tokens.items()))
        raise AscqError(
            f"draft model {draft_dir} has a different tokenizer than the target ({differing} vocabulary "
            f"entries "
            "differ): the draft must use the target's tokenizer"
        )


class DraftModelProposer:
    def __init__(
        self,
        draft_dir: Path,
        num_speculative_tokens: int,
        *,
        target_config: dict[str, Any],
        target_tokenizer: Any,
        device: str,
        dtype: torch.dtype,
        cache_dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        generator: torch.Generator,
    ) -> None:
        draft_config = read_config(draft_dir)
        check_same_vocabulary(draft_dir, draft_config, target_config, target_tokenizer)
        self.k = num_speculative_tokens
        self.generator = generator  # for requests without their own seed
        self.model, _ = load_model(draft_dir, device, dtype, draft_config)
        torch_device = backend_torch_device(device)
        allocate_kv_cache(self.model, num_blocks, block_size, cache_dtype, torch_device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, block_size, torch_device)
        self.sequences: dict[int, DraftSequence] = {}  # id(request) -> its draft state

    def forget(self, request: Request) -> None:
        sequence = self.sequences.pop(id(request), None)
        if sequence is not None:
            self.block_manager.free(sequence)

    def propose(
        self, requests: list[Request], max_tokens: list[int]
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """(up to min(k, max_tokens[i]) drafted tokens, the draft distributions [n, V] for random
        requests)."""
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        limits = [min(self.k, m) for m in max_tokens]
        for request, limit in zip(requests, limits, strict=True):
            if limit > 0:
                sequence = self.sequences.setdefault(id(request), DraftSequence())
                sequence.sync(request.token_ids)
                self.block_manager.free_excess_slots(sequence)
        active = [i for i, limit in enumerate(limits) if limit > 0]
        while active:
            active = self._draft_step(requests, active, drafts, probs)
            active = [i for i in active if len(drafts[i]) < limits[i]]
        return [
            (d, torch.stack(p) if p and not r.params.greedy else None)
            for r, d, p in zip(requests, drafts, probs, strict=True)
        ]

    @torch.inference_mode()
    def _draft_step(
        self,
        requests: list[Request],
        active: list[int],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> list[int]:
        """One batched draft forward for the active requests; returns those that got a token."""
        out = SchedulerOutput()
        stepped = []
        for i in active:
            sequence = self.sequences[id(requests[i])]
            num_new = sequence.num_tokens - sequence.num_computed_tokens
            if self.block_manager.allocate_slots(sequence, num_new):  # out of draft blocks: stop drafting it
                out.requests.append(sequence)
                out.num_scheduled_tokens.append(num_new)
                stepped.append(i)
        if not stepped:
            return []
        logits, _ = self.runner.execute(out)
        logits = logits.float().cpu()
        params = [requests[i].params for i in stepped]
        random_rows = [j for j, p in enumerate(params) if not p.greedy]
        token_ids = logits.argmax(dim=-1).tolist()
        if random_rows:
            q = sampling_probs(logits[random_rows], [params[j] for j in random_rows])
            for row, j in enumerate(random_rows):
                request = requests[stepped[j]]
                token_ids[j] = int(
                    torch.multinomial(q[row], 1, generator=request.generator or self.generator)
                )
                probs[stepped[j]].append(q[row])
        for j, i in enumerate(stepped):
            sequence = out.requests[j]
            sequence.num_computed_tokens += out.num_scheduled_tokens[j]
            sequence.token_ids.append(token_ids[j])
            drafts[i].append(token_ids[j])
        return stepped

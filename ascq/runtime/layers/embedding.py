"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascq.kernels import cpu
from ascq.runtime.layers.loadable import assign_parameter
from ascq.runtime.parallel import all_gather_last_dim, all_reduce, divide, tp_rank, tp_world_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_world_size()
        self.shard_size = divide(vocab_size, self.tp_size)
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)

    def weight_loader(self, param_name: str, tensor: torch.Tensor) -> None:
        assign_parameter(self, param_name, tensor.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 [T, vocab]."""
        logits = cpu.bf16_small_m_linear(hidden, self.weight) if self.weight.device.type == "cpu" else None
        if logits is None:
            logits = F.linear(hidden, self.weight)
        return (all_gather_last_dim(logits) if self.tp_size > 1 else logits).float()

"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascq.core.architecture import divide
from ascq.kernels import cpu, native
from ascq.platforms import platform_for
from ascq.runtime.distributed.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_world_size
from ascq.runtime.layers.loadable import assign_parameter


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
    int8: native.PackedWeights | None = None  # opt-in int8 copy
    # a checkpoint's int8 per-row head (compressed-tensors, symmetric): its scales until `finalize`
    weight_scale: torch.Tensor | None = None

    def weight_loader(self, param_name: str, tensor: torch.Tensor) -> None:
        if param_name == "weight_scale":
            self.weight_scale = tensor.reshape(-1, 1).narrow(0, self.vocab_start, self.shard_size)
            return
        super().weight_loader(param_name, tensor)

    def finalize(self, backend, dtype: torch.dtype) -> None:
        """A quantized checkpoint head: the weight becomes its dequantized values (the embedding's path and
        large batches), and on the cpu backend the int8 values also run as `quantize_int8`'s copy."""
        if self.weight_scale is None:
            return
        q, scale = self.weight.data.to(torch.int8), self.weight_scale.float()
        self.weight = nn.Parameter(q.float() * scale, requires_grad=False)
        self.weight_scale = None
        if backend is cpu and cpu.native_per_channel_group_size(q.shape[1], 8) and native.load() is not None:
            self._pack_int8(q.contiguous(), scale)

    def quantize_int8(self) -> None:
        """Opt-in, and it changes the logits: keep an int8 per-row symmetric copy of the head (half the bytes
        per token of bf16; a tied head of a small model is a large share of its decode step's memory traffic)
        and run it through the native 8-bit kernel for batches below `cpu.NATIVE_MAX_M`. The bf16 weight stays
        (the embedding, large batches)."""
        w = self.weight.float()
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8).contiguous()
        k = w.shape[1]
        if cpu.native_per_channel_group_size(k, 8) is None or native.load() is None:
            raise ValueError(f"int8 LM head needs the native kernels and hidden size % 32 == 0 (got {k})")
        self._pack_int8(q, scale)

    def _pack_int8(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        k = q.shape[1]
        group = cpu.native_per_channel_group_size(k, 8)
        self.int8 = native.pack(q, 8, scale.repeat_interleave(k // group, 1), None, group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 [T, vocab]."""
        if self.int8 is not None and 0 < hidden.shape[0] < cpu.NATIVE_MAX_M:
            logits = native.weight_only_mm(None, hidden, self.int8)
            return all_gather_last_dim(logits) if self.tp_size > 1 else logits
        on_cpu = platform_for(self.weight.device).is_cpu
        native_max_m = cpu.BF16_GEMM_LM_HEAD_MIN_M if cpu.BF16_GEMM_FAST else cpu.LM_HEAD_BF16_MAX_M
        logits = cpu.bf16_small_m_linear(hidden, self.weight, native_max_m) if on_cpu else None
        if logits is None and on_cpu and self.weight.dtype == torch.bfloat16 and not cpu.BF16_GEMM_FAST:
            # AVX2 has no bf16 GEMM: fp32
            logits = F.linear(hidden.float(), self.weight.float())
        elif logits is None:
            logits = F.linear(hidden.to(self.weight.dtype), self.weight)
        return (all_gather_last_dim(logits) if self.tp_size > 1 else logits).float()

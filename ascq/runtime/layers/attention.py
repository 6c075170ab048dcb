"""Attention over the paged KV cache: write this step's keys/values, then attend through the kernel
backend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by every attention layer (see the kernel interface)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    max_query_len: int | None = None  # 1: a pure decode step (no host reads of the layout); None: unknown
    use_decode_graph: bool = (
        False  # run the decoder layers' compiled decode graphs (runtime/decode_graphs.py)
    )

    def windowed(self, sliding_window: int, block_size: int) -> AttentionMetadata:
        """This step's layout for a sliding-window layer: each sequence's block table starts at the first
        block that one of its query rows can see, and its length drops by the blocks left out, so blocks
        wholly past the window are never read. Positions move by whole blocks: the kernels' causal and window
        masks, which compare positions, are unchanged."""
        query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        first_visible = (self.seq_lens - query_lens - (sliding_window - 1)).clamp(min=0)
        skipped = (first_visible // block_size).to(self.block_tables.device)
        width = self.block_tables.shape[1]
        columns = torch.arange(width, device=self.block_tables.device)[None, :] + skipped[:, None].long()
        tables = self.block_tables.gather(1, columns.clamp(max=max(width - 1, 0)))
        seq_lens = self.seq_lens - (skipped * block_size).to(self.seq_lens)
        return dataclasses.replace(self, block_tables=tables, seq_lens=seq_lens)

    def to(self, device: torch.device) -> AttentionMetadata:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return AttentionMetadata(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        )


class Attention(nn.Module):
    """`scale`: the query scale (default head_dim ** -0.5); `sliding_window`: keys at most this many positions
    back (the query's own included) are seen, None: all (pass such a layer `AttentionMetadata.windowed`)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0  # fp8 cache: stored value = x / scale
        self.has_checkpoint_kv_scales = False
        self.backend: ModuleType | None = None

    def weight_loader(self, param_name: str, tensor: torch.Tensor) -> None:
        setattr(self, param_name, float(tensor.float().reshape(-1)[0]))
        self.has_checkpoint_kv_scales = True

    def finalize(self, backend: ModuleType, dtype: torch.dtype) -> None:
        self.backend = backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        self.backend.write_kv_cache(
            k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale
        )
        out = self.backend.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            self.k_scale,
            self.v_scale,
            max_query_len=meta.max_query_len,
            sliding_window=self.sliding_window,
        )
        return out.reshape(out.shape[0], -1)

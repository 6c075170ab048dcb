"""Paged KV cache sizing and allocation: one [num_blocks, block_size, num_kv_heads, head_dim] tensor per K and
V per layer. An fp8 cache (e4m3) stores x / scale with the checkpoint's per-layer k/v scales, so the same
memory holds twice the blocks of a bf16 cache (four times those of fp32)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ascq.core.errors import AscqError
from ascq.runtime.layers.attention import Attention

logger = logging.getLogger("ascq.runtime")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if kv_cache_dtype.startswith("fp8") else model_dtype


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def bytes_per_block(model: nn.Module, block_size: int, cache_dtype: torch.dtype) -> int:
    per_token = sum(2 * layer.num_kv_heads * layer.head_dim for layer in attention_layers(model))
    return per_token * block_size * cache_dtype.itemsize


def allocate_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int, cache_dtype: torch.dtype, device: torch.device
) -> None:
    """Give every attention layer its K and V cache; fp8 without checkpoint scales uses 1.0 (warned once)."""
    layers = attention_layers(model)
    if cache_dtype == torch.float8_e4m3fn and not all(layer.has_checkpoint_kv_scales for layer in layers):
        logger.warning("fp8 KV cache: the checkpoint has no k/v scales (kv_cache_scheme); using 1.0")
    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)


def num_blocks_for(memory_bytes: int, block_bytes: int, override: int | None) -> int:
    num_blocks = override if override is not None else memory_bytes // block_bytes
    if num_blocks < 1:
        raise AscqError(
            f"kv_cache_memory {memory_bytes} bytes holds no KV block (one block needs {block_bytes} bytes)"
        )
    return num_blocks

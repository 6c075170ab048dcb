"""Paged attention on Ascend: `_npu_reshape_and_cache` writes K/V, `npu_fused_infer_attention_score` reads
them.

One attention call serves a mixed batch (prefill chunks, prefix-cache hits, decodes) with input_layout "TND":
query rows of all sequences back to back, `actual_seq_lengths` = cumulative query ends,
`actual_seq_lengths_kv` = each sequence's context length, `block_table` over the cache viewed as (num_blocks,
block_size, KV_N * D), and sparse_mode 3 (right-down causal: query row i of a q_len-row sequence sees context
positions <= kv_len - q_len + i) with the op's fixed 2048 x 2048 upper-triangular mask. The op documents page
attention with query rows > 1 for block sizes that are multiples of 128 up to 512, so the engine must run with
`--block-size 128` on NPU.
"""

from __future__ import annotations

import torch

from ascq.core.errors import UnsupportedError
from ascq.kernels.npu.runtime import device, torch_npu

MASK_SIZE = 2048
_causal_masks: dict[torch.device, torch.Tensor] = {}


def _check_cache(cache: torch.Tensor) -> None:
    if cache.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedError(
            f"--device npu stores the KV cache in bfloat16/float16, not {cache.dtype} (no fp8 KV cache on "
            f"NPU)"
        )
    block_size = cache.shape[1]
    if block_size % 128 or block_size > 512:
        raise UnsupportedError(
            f"--device npu needs --block-size 128 (a multiple of 128 up to 512 for "
            f"npu_fused_infer_attention_score "
            f"page attention), got {block_size}"
        )


def causal_mask() -> torch.Tensor:
    """The sparse_mode 3 mask: bool 2048 x 2048, True above the diagonal (masked), one per device."""
    mask = _causal_masks.get(device())
    if mask is None:
        mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(diagonal=1).to(device())
        _causal_masks[device()] = mask
    return mask


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Store token t's key/value [T, Hkv, D] at flat slot slot_mapping[t] (scales unused: float caches
    only)."""
    _check_cache(k_cache)
    torch_npu()._npu_reshape_and_cache(
        key=key.to(k_cache.dtype).contiguous(),
        value=value.to(v_cache.dtype).contiguous(),
        key_cache=k_cache,
        value_cache=v_cache,
        slot_indices=slot_mapping.to(device=k_cache.device, dtype=torch.int32),
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its cached context; [T, H, D] in query.dtype
    (`max_query_len`, a hint for the cpu backend, is unused: the fused kernel takes the lengths as they
    are). Sliding-window layers are refused (not written against the op's band mode yet)."""
    if sliding_window is not None:
        raise UnsupportedError("sliding-window attention (Gemma 3) is not supported on --device npu")
    _check_cache(k_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    out, _ = torch_npu().npu_fused_infer_attention_score(
        query.to(k_cache.dtype).contiguous(),
        k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        v_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        atten_mask=causal_mask(),
        block_table=block_tables.to(device=k_cache.device, dtype=torch.int32),
        actual_seq_lengths=query_start_loc[1:].tolist(),
        actual_seq_lengths_kv=seq_lens.tolist(),
        num_heads=query.shape[1],
        num_key_value_heads=num_kv_heads,
        scale=float(scale),
        input_layout="TND",
        block_size=block_size,
        sparse_mode=3,
    )
    return out.to(query.dtype)

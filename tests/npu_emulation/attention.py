"""Emulated paged-KV ops: _npu_reshape_and_cache (ATB) and npu_fused_infer_attention_score.

npu_fused_infer_attention_score is modelled for the page-attention path with input_layout="TND" (ragged
query rows, cumulative `actual_seq_lengths`, per-sequence `actual_seq_lengths_kv`, `block_table`) and
sparse_mode 3 (rightDownCausal with the optimised 2048 x 2048 mask) or 0 without a mask.
"""

from __future__ import annotations

import torch

from .contract import require, require_dtype, sizes_from_ends

FLOAT_KV = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048
_checked_masks: set[int] = set()


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices) -> None:
    """key/value (T, KV_N, D) -> caches (num_blocks, block_size, KV_N, D) at flat slots slot_indices (T,)."""
    op = "_npu_reshape_and_cache"
    require(key.shape == value.shape and key.dim() == 3, op, "key and value must both be (T, KV_N, D)")
    require(
        key_cache.shape == value_cache.shape and key_cache.dim() == 4,
        op,
        "caches must both be (num_blocks, block_size, KV_N, D)",
    )
    require(tuple(key_cache.shape[2:]) == tuple(key.shape[1:]), op, "cache heads/dim must match key's")
    require(
        key.dtype == key_cache.dtype and value.dtype == value_cache.dtype,
        op,
        "key/value dtype must match the cache",
    )
    require_dtype(slot_indices, (torch.int32,), op, "slot_indices")
    require(tuple(slot_indices.shape) == (key.shape[0],), op, "slot_indices must be (T,)")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    require(bool(((slot_indices >= 0) & (slot_indices < num_slots)).all()), op, "slot index out of range")
    slots = slot_indices.long()
    key_cache.view(num_slots, *key.shape[1:])[slots] = key
    value_cache.view(num_slots, *value.shape[1:])[slots] = value


def _check_mask(atten_mask: torch.Tensor) -> None:
    op = "npu_fused_infer_attention_score"
    require(atten_mask is not None, op, "sparse_mode 3 needs the optimised atten_mask")
    require_dtype(atten_mask, (torch.bool, torch.int8, torch.uint8), op, "atten_mask")
    shape = tuple(atten_mask.shape)
    require(
        shape in ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE)),
        op,
        f"sparse_mode 3 needs a 2048 x 2048 mask, got {shape}",
    )
    if id(atten_mask) not in _checked_masks:
        expected = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(diagonal=1)
        require(
            bool((atten_mask.reshape(MASK_SIZE, MASK_SIZE).bool() == expected).all()),
            op,
            "the sparse_mode 3 mask must mask exactly the strict upper triangle",
        )
        _checked_masks.add(id(atten_mask))


def _kv_rows(cache: torch.Tensor, table_row: torch.Tensor, length: int, num_kv_heads: int) -> torch.Tensor:
    block_size = cache.shape[1] if cache.dim() == 3 else cache.shape[2]
    positions = torch.arange(length)
    blocks = table_row.long()[positions // block_size]
    if cache.dim() == 3:  # (blocknum, blocksize, H)
        rows = cache[blocks, positions % block_size]
        return rows.reshape(length, num_kv_heads, -1).float()
    return cache[blocks, :, positions % block_size].float()  # (blocknum, KV_N, blocksize, D)


def _check_paged(query, key, value, block_table, lens_q, lens_kv, block_size, num_heads, num_kv_heads):
    op = "npu_fused_infer_attention_score"
    require_dtype(query, FLOAT_KV, op, "query (page attention does not take int8 query)")
    require(
        query.is_contiguous() and key.is_contiguous() and value.is_contiguous(),
        op,
        "inputs must be contiguous",
    )
    require(
        key.shape == value.shape and key.dim() in (3, 4),
        op,
        "paged key/value must share shape (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D)",
    )
    require(
        key.dtype == query.dtype and value.dtype == query.dtype, op, "fp16/bf16 key/value must match query"
    )
    num_tokens, q_heads, head_dim = query.shape
    require(q_heads == num_heads, op, f"num_heads {num_heads} != query heads {q_heads}")
    require(
        num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64,
        op,
        "num_heads must be a multiple of num_key_value_heads, ratio <= 64",
    )
    require(head_dim % 16 == 0, op, f"head dim {head_dim} must be 16-aligned for fp16/bf16")
    cache_block = key.shape[1] if key.dim() == 3 else key.shape[2]
    require(block_size == cache_block, op, f"block_size {block_size} != cache block size {cache_block}")
    expected_h = (num_kv_heads * head_dim,) if key.dim() == 3 else (num_kv_heads, head_dim)
    require(
        tuple(key.shape[-1:] if key.dim() == 3 else (key.shape[1], key.shape[3])) == expected_h,
        op,
        f"cache shape {tuple(key.shape)} does not hold {num_kv_heads} kv heads of dim {head_dim}",
    )
    require(
        0 < block_size <= 512 and block_size % 16 == 0,
        op,
        f"block_size {block_size}: 16-aligned, at most 512",
    )
    q_lens = sizes_from_ends(lens_q)
    if max(q_lens) > 1:
        require(
            block_size % 128 == 0,
            op,
            f"page attention with Q_S > 1 needs block_size a multiple of 128, got {block_size}",
        )
    require_dtype(block_table, (torch.int32,), op, "block_table")
    require(
        block_table.dim() == 2 and block_table.shape[0] == len(lens_q),
        op,
        "block_table must be (B, max_blocks)",
    )
    require(
        len(lens_kv) == len(lens_q), op, "actual_seq_lengths_kv needs one length per batch in page attention"
    )
    require(
        min(q_lens) >= 0 and lens_q[-1] == num_tokens,
        op,
        "TND actual_seq_lengths must be non-decreasing cumulative ends, the last equal to T",
    )
    max_blocks = max(-(-n // block_size) for n in lens_kv)
    require(block_table.shape[1] >= max_blocks, op, "block_table has fewer columns than maxBlockNumPerSeq")
    return q_lens


def npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    block_table=None,
    num_heads=1,
    scale=1.0,
    input_layout="BSH",
    num_key_value_heads=0,
    sparse_mode=0,
    block_size=0,
    softmax_lse_flag=False,
    **unmodelled,
):
    """softmax(scale * q k^T + mask) v per batch; returns (attention_out like query, softmax_lse [1]
    zeros)."""
    op = "npu_fused_infer_attention_score"
    used = [
        name
        for name, v in unmodelled.items()
        if isinstance(v, torch.Tensor) or v not in (None, 0, 2147483647)
    ]
    if input_layout != "TND" or block_table is None or used or softmax_lse_flag:
        raise NotImplementedError(f"{op} emulator: only the TND page-attention path is modelled (got {used})")
    require(actual_seq_lengths is not None, op, "TND needs actual_seq_lengths")
    require(actual_seq_lengths_kv is not None, op, "page attention needs actual_seq_lengths_kv")
    num_kv_heads = num_key_value_heads or num_heads
    lens_q, lens_kv = list(actual_seq_lengths), list(actual_seq_lengths_kv)
    q_lens = _check_paged(
        query, key, value, block_table, lens_q, lens_kv, block_size, num_heads, num_kv_heads
    )
    if sparse_mode == 3:
        _check_mask(atten_mask)
        require(
            all(q <= kv for q, kv in zip(q_lens, lens_kv, strict=True)),
            op,
            "sparse_mode 3 needs q_len <= kv_len per batch",
        )
    elif sparse_mode != 0 or atten_mask is not None:
        raise NotImplementedError(f"{op} emulator: sparse_mode {sparse_mode} with a mask is not modelled")
    out = torch.empty_like(query)
    group = num_heads // num_kv_heads
    for b, (start, q_len, kv_len) in enumerate(zip([0, *lens_q[:-1]], q_lens, lens_kv, strict=True)):
        if q_len == 0:
            continue
        keys = _kv_rows(key, block_table[b], kv_len, num_kv_heads).repeat_interleave(group, dim=1)
        values = _kv_rows(value, block_table[b], kv_len, num_kv_heads).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start : start + q_len].float(), keys) * scale
        if sparse_mode == 3:
            visible = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(
            query.dtype
        )
    return out, torch.zeros(1)

"""The cpu backend's paged attention: paged_sdpa's, except that decode rows (one query token per sequence)
read the paged cache in place through the native kernel (paged_decode_attention.c) when it builds here. At
batches of 16 and more that is several times torch's padded gathers + batched products, which were most of a
small model's decode step."""

from __future__ import annotations

import torch

from ascq.kernels import native, paged_sdpa


def _native_attend_decode(
    query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale
) -> torch.Tensor:
    out = native.paged_decode_attention(
        None, query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale
    )
    return out.to(query.dtype)


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
    same_dtype = k_cache.dtype == v_cache.dtype
    native_decode = native.available() and k_cache.dtype in native.CACHE_DTYPES and same_dtype
    return paged_sdpa.paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        k_scale,
        v_scale,
        attend_decode=_native_attend_decode if native_decode else paged_sdpa._attend_decode,
        max_query_len=max_query_len,
        sliding_window=sliding_window,
    )

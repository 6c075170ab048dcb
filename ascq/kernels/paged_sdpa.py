"""Paged KV cache write + attention built on torch's scaled_dot_product_attention; shared by the `cpu` and
`cuda` backends.

Decode rows (one query token per sequence, and each row of a short chunk, see SHORT_QUERY_MAX) run as one
batched fp32 attention over each sequence's gathered, padded context; longer prefill chunks run one SDPA per
sequence (plain causal when the chunk is the whole context, else an explicit mask, since SDPA's `is_causal`
aligns top-left). float8 caches are read and written through uint8 views, which index on every device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ascq.kernels.reference import FP8_DTYPES, causal_visible, from_cache, to_cache


def _store(
    cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, scale: float | torch.Tensor
) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype in FP8_DTYPES:  # fp8 rows move as uint8, which indexes on every device
        flat.view(torch.uint8)[slot_mapping] = to_cache(x, cache.dtype, scale).view(torch.uint8)
    else:
        flat[slot_mapping] = x.to(cache.dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    _store(k_cache, key, slots, k_scale)
    _store(v_cache, value, slots, v_scale)


def _gather(
    cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor
) -> torch.Tensor:
    """cache rows at `slots` (any shape) -> [*slots.shape, Hkv, D] in `dtype`, fp8 rescaled."""
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype in FP8_DTYPES:
        raw = flat.view(torch.uint8).index_select(0, slots.flatten()).view(cache.dtype)
        rows = from_cache(raw, scale).to(dtype)
    else:
        rows = flat.index_select(0, slots.flatten()).to(dtype)
    return rows.view(*slots.shape, *cache.shape[2:])


def _slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots [S, length] of each sequence's first `length` positions; past a sequence's own end
    they are slots of its table's padding blocks (valid, finite, and masked by the caller)."""
    num_blocks = -(-length // block_size)
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = block_tables[:, :num_blocks, None].long() * block_size + offsets
    return slots.flatten(1)[:, :length]


def _attend_decode(
    query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, sliding_window=None
):
    """query [B, H, D], one token per sequence at its last position -> [B, H, D]; with `sliding_window`, over
    its last `sliding_window` positions only.

    Plain fp32 math: for one query row it is faster than SDPA's CPU flash kernel.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, max_len = k_cache.shape[2], int(seq_lens.max())
    slots = _slots(block_tables, max_len, k_cache.shape[1])
    keys = _gather(k_cache, slots, torch.float32, k_scale)  # [B, L, Hkv, D]
    values = _gather(v_cache, slots, torch.float32, v_scale)
    q = query.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim) * scale
    scores = q @ keys.permute(0, 2, 3, 1)  # [B, Hkv, G, L]
    if num_seqs > 1 or sliding_window is not None:
        positions = torch.arange(max_len, device=query.device)[None, :]
        hidden = positions >= seq_lens[:, None]
        if sliding_window is not None:
            hidden |= positions < seq_lens[:, None] - sliding_window
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    out = scores.softmax(dim=-1) @ values.transpose(1, 2)  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _attend_prefill(
    query, k_cache, v_cache, block_table, seq_len, scale, k_scale, v_scale, sliding_window=None
):
    """query [Lq, H, D] = the last Lq positions of a seq_len-token context -> [Lq, H, D]."""
    query_len, block_size = query.shape[0], k_cache.shape[1]
    slots = _slots(block_table[None], seq_len, block_size)
    keys = _gather(k_cache, slots, query.dtype, k_scale).transpose(1, 2)
    values = _gather(v_cache, slots, query.dtype, v_scale).transpose(1, 2)
    q = query.transpose(0, 1)[None]  # [1, H, Lq, D]
    if query_len == seq_len and sliding_window is None:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = causal_visible(seq_len, query_len, query.device, sliding_window)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


_layout_cache: tuple[torch.Tensor, torch.Tensor, tuple[list[int], list[int], list[int]]] | None = None


def _step_layout(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[list[int], list[int], list[int]]:
    """(query starts, sequence lengths, query lengths) as host lists. Every layer of a step passes the same
    metadata tensors, so they are read back once per step, not once per layer (the cache holds the tensors
    themselves, so their identities cannot be reused by a later step's tensors while cached)."""
    global _layout_cache
    if _layout_cache is not None and _layout_cache[0] is query_start_loc and _layout_cache[1] is seq_lens:
        return _layout_cache[2]
    starts = query_start_loc.tolist()
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    layout = (starts, seq_lens.tolist(), query_lens)
    _layout_cache = (query_start_loc, seq_lens, layout)
    return layout


SHORT_QUERY_MAX = 8
"""Query chunks up to this long (speculative verification rows, short chunk tails) run as one-token rows: row
i of an n-row chunk ending at context length L is a decode row of context L - n + 1 + i. Each token then gets
exactly the attention it would get decoded alone (speculation changes no greedy token), and one
`attend_decode` call serves the whole step instead of one masked SDPA per sequence."""


def _one_token_rows(
    starts: list[int], lengths: list[int], query_lens: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(query rows, their context lengths, their sequence indices) of every chunk up to SHORT_QUERY_MAX
    rows."""
    rows, lens, seqs = [], [], []
    for s, (start, length, query_len) in enumerate(zip(starts, lengths, query_lens, strict=False)):
        if query_len <= SHORT_QUERY_MAX:
            rows.extend(range(start, start + query_len))
            lens.extend(range(length - query_len + 1, length + 1))
            seqs.extend([s] * query_len)
    return rows, lens, seqs


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
    attend_decode: Callable[..., torch.Tensor] = _attend_decode,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`attend_decode` serves the one-token rows (same arguments as `_attend_decode`); a backend may bring its
    own, except for a sliding-window layer, whose rows this module's masked `_attend_decode` serves. Keys
    more than `sliding_window` positions back are masked; blocks wholly past the window are left out by the
    caller (the model passes block tables that start at the window). `max_query_len` 1 says every row is a
    decode row: the layout is then not read back to the host (a captured decode graph has no host reads)."""
    if sliding_window is not None:
        attend_decode = functools.partial(_attend_decode, sliding_window=sliding_window)
    device = query.device
    if max_query_len == 1:
        lens = seq_lens.to(device=device, dtype=torch.long)
        return attend_decode(query, k_cache, v_cache, block_tables.to(device), lens, scale, k_scale, v_scale)
    starts, lengths, query_lens = _step_layout(query_start_loc, seq_lens)
    if all(n == 1 for n in query_lens):  # pure decode step: no scatter back needed
        lens = seq_lens.to(device=device, dtype=torch.long)
        return attend_decode(query, k_cache, v_cache, block_tables.to(device), lens, scale, k_scale, v_scale)
    rows, row_lens, row_seqs = _one_token_rows(starts, lengths, query_lens)
    tables = block_tables.to(device)
    if len(rows) == query.shape[0]:  # every chunk short: the rows are all rows, in order
        lens = torch.tensor(row_lens, device=device)
        return attend_decode(query, k_cache, v_cache, tables[row_seqs], lens, scale, k_scale, v_scale)
    out = torch.empty_like(query)
    if rows:
        index = torch.tensor(rows, device=device)
        lens = torch.tensor(row_lens, device=device)
        out[index] = attend_decode(
            query[index], k_cache, v_cache, tables[row_seqs], lens, scale, k_scale, v_scale
        )
    for s, query_len in enumerate(query_lens):
        if query_len > SHORT_QUERY_MAX:
            chunk = slice(starts[s], starts[s] + query_len)
            out[chunk] = _attend_prefill(
                query[chunk], k_cache, v_cache, tables[s], lengths[s], scale, k_scale, v_scale, sliding_window
            )
    return out

"""Reference backend: plain torch, fp32 math, written to be read. The ground truth every other backend is
tested against; slow on purpose (loops over sequences and experts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascq.core.qmath import quantize_per_token, quantize_static_input
from ascq.kernels import QuantLinearWeights

ACTIVATION_SCHEMES = ("w8a8_dynamic", "w8a8_static", "w4a8_dynamic")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_weight(w: QuantLinearWeights) -> torch.Tensor:
    """The layer's weight as fp32 [out, in]: (q - zero_point) * scale, broadcast per channel or per group."""
    if w.scheme == "dense":
        return w.weight.float()
    group_size = w.group_size or w.in_features
    scale = w.weight_scale.float().repeat_interleave(group_size, dim=1)
    zero = 0.0 if w.zero_point is None else w.zero_point.float().repeat_interleave(group_size, dim=1)
    return (w.weight.float() - zero) * scale


def integer_activations(x: torch.Tensor, w: QuantLinearWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, scale), x ~= v * scale: the integer-valued fp32 activations (zero point removed) a W8A8/W4A8 kernel
    multiplies, per token (`qmath.quantize_per_token`) or per tensor (`qmath.quantize_static_input`)."""
    if w.scheme != "w8a8_static":
        return quantize_per_token(x)
    scale = w.input_scale.float().reshape(()).to(x.device)
    zero = None if w.input_zero_point is None else w.input_zero_point.float().reshape(()).to(x.device)
    q = quantize_static_input(x, scale, zero)
    return (q if zero is None else q - zero), scale


def fake_quantize_input(x: torch.Tensor, w: QuantLinearWeights) -> torch.Tensor:
    """The fp32 activation a W8A8/W4A8 kernel effectively multiplies: quantized to int8 then dequantized."""
    if w.scheme not in ACTIVATION_SCHEMES:
        return x
    v, scale = integer_activations(x, w)
    return v * scale


@dataclass
class ReferenceLinear:
    weights: QuantLinearWeights
    dequantized: torch.Tensor  # fp32 [out, in]


def prepare_linear(w: QuantLinearWeights, dtype: torch.dtype = torch.float32) -> ReferenceLinear:
    return ReferenceLinear(weights=w, dequantized=dequantize_weight(w))


def linear(x: torch.Tensor, prepared: ReferenceLinear) -> torch.Tensor:
    x32 = fake_quantize_input(x.float(), prepared.weights)
    y = x32 @ prepared.dequantized.T
    if prepared.weights.bias is not None:
        y = y + prepared.weights.bias.float()
    return y.to(x.dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float | torch.Tensor) -> torch.Tensor:
    """Keys/values as a cache of `cache_dtype` stores them: fp8 as x / scale clamped to the format's range."""
    if cache_dtype in FP8_DTYPES:
        limit = torch.finfo(cache_dtype).max
        return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def from_cache(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Cached keys/values back as fp32 (fp8 rescaled)."""
    return x.float() * scale if x.dtype in FP8_DTYPES else x.float()


def causal_visible(
    seq_len: int, query_len: int, device: torch.device | None = None, sliding_window: int | None = None
) -> torch.Tensor:
    """bool [query_len, seq_len]: query row i (context position seq_len - query_len + i) sees positions <=
    its own, and with a sliding window only the last `sliding_window` of them (its own included)."""
    query_positions = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_positions = torch.arange(seq_len, device=device)[None, :]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    return visible


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Store token t's key/value [T, Hkv, D] at flat slot slot_mapping[t] (= block * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        flat[slot_mapping] = to_cache(x, cache.dtype, scale)


def gather_sequence_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float | torch.Tensor
) -> torch.Tensor:
    """A sequence's first seq_len cached tokens as fp32 [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len)
    slots = block_table.long()[positions // block_size] * block_size + positions % block_size
    return from_cache(cache.view(-1, *cache.shape[2:])[slots], scale)


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
    """Causal attention of each sequence's new query tokens over its whole cached context (this step
    included), within the last `sliding_window` positions when given; `max_query_len` (1: every row is a
    decode row) is a hint other backends use, unused here."""
    out = torch.empty_like(query)
    for s in range(len(seq_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len = int(seq_lens[s])
        keys = gather_sequence_kv(k_cache, block_tables[s], seq_len, k_scale)
        values = gather_sequence_kv(v_cache, block_tables[s], seq_len, v_scale)
        out[start:end] = causal_attention(query[start:end].float(), keys, values, scale, sliding_window)
    return out


def causal_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """fp32 attention of queries [Tq, H, D] (the last Tq positions) over keys/values [S, Hkv, D], causal
    (within `sliding_window`, when given), GQA by repeating kv heads; also the reference models' attention (so
    converter and reference backend agree bit for bit)."""
    num_heads, seq_len, query_len = q.shape[1], keys.shape[0], q.shape[0]
    group = num_heads // keys.shape[1]
    keys, values = (
        keys.float().repeat_interleave(group, dim=1),
        values.float().repeat_interleave(group, dim=1),
    )
    # in place: each [H, Tq, S] temporary is a fresh mmap under the converter's malloc settings (page faults)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys).mul_(scale)
    scores.masked_fill_(~causal_visible(seq_len, query_len, q.device, sliding_window), float("-inf"))
    scores = scores.softmax(dim=-1) if scores.requires_grad else torch.softmax(scores, dim=-1, out=scores)
    return torch.einsum("hqk,khd->qhd", scores, values)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), then the top_k weights and expert ids per token."""
    scores = router_logits.float().softmax(dim=-1)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def prepare_experts(
    gate: list[QuantLinearWeights],
    up: list[QuantLinearWeights],
    down: list[QuantLinearWeights],
    dtype: torch.dtype = torch.float32,
) -> list[tuple[ReferenceLinear, ReferenceLinear, ReferenceLinear]]:
    return [
        (prepare_linear(g, dtype), prepare_linear(u, dtype), prepare_linear(d, dtype))
        for g, u, d in zip(gate, up, down, strict=True)
    ]


def moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared_experts: list[tuple[ReferenceLinear, ReferenceLinear, ReferenceLinear]],
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * down(silu(gate(x)) * up(x))."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert_id, (gate, up, down) in enumerate(prepared_experts):
        token_ids, slot = (topk_ids == expert_id).nonzero(as_tuple=True)
        if len(token_ids) == 0:
            continue
        tokens = x[token_ids]
        expert_out = linear(F.silu(linear(tokens, gate)) * linear(tokens, up), down)
        out.index_add_(0, token_ids, expert_out.float() * topk_weights[token_ids, slot, None])
    return out.to(x.dtype)

"""Per-rank memory of a Llama / DeepSeek-MoE model under tensor / expert / pipeline parallelism (plain arithmetic).

Weights: embedding and LM head split over the vocabulary, attention and MLP linears over TP, routed experts 1/TP
of them per rank either way (expert parallel: whole experts, E/TP each; otherwise every expert sharded), the router
replicated. `bytes_per_weight`: 2 for bf16; 0.5 + 2/g (+0.5/g asymmetric) for int4 with bf16 group-g scales.
KV: per token, both K and V of this rank's KV heads in this stage's layers.
"""

from __future__ import annotations

from typing import Any

from ascq.runtime.distributed.pipeline import stage_layers
from ascq.runtime.parallel import kv_heads_per_rank


def per_rank_memory(config: dict[str, Any], tp: int, pp: int = 1, bytes_per_weight: float = 2.0,
                    kv_bytes: int = 2, pp_rank: int = 0) -> dict[str, float]:
    """{"weight_bytes", "kv_bytes_per_token"} of rank (pp_rank, any tp rank)."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    layers = stage_layers(config["num_hidden_layers"], pp, pp_rank)
    attention = (heads * head_dim * h * 2 + kv_heads_per_rank(kv_heads, tp) * tp * head_dim * h * 2) / tp
    experts = config.get("n_routed_experts") or 0
    first_dense = config.get("first_k_dense_replace", 0) if experts else config["num_hidden_layers"]
    weights = 0.0
    for i in layers:
        weights += attention * bytes_per_weight
        if i < first_dense:
            weights += 3 * h * config["intermediate_size"] / tp * bytes_per_weight
        else:
            moe = config["moe_intermediate_size"]
            weights += 3 * h * moe * (experts + config.get("n_shared_experts", 0)) / tp * bytes_per_weight
            weights += h * experts * 2  # router, bf16, replicated
    if pp_rank == 0:
        weights += vocab * h / tp * 2
    if pp_rank == pp - 1:
        weights += vocab * h / tp * 2  # lm_head (kept bf16 by the recipes)
    kv = 2 * len(layers) * kv_heads_per_rank(kv_heads, tp) * head_dim * kv_bytes
    return {"weight_bytes": weights, "kv_bytes_per_token": kv}

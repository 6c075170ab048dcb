"""Per-rank memory of a Llama / DeepSeek-MoE model under tensor / expert / pipeline parallelism.

Weights: every checkpoint tensor (`ascq.zoo.planned.checkpoint_tensors`) cut as the runtime cuts it
(ascq/runtime/distributed/parallel.py): embedding and LM head split over the vocabulary; q/k/v, gate/up
column-parallel (KV heads split, or one per rank when TP > KV heads); o/down row-parallel; routed experts
either whole (expert parallel: E/TP per rank) or each one sharded like an MLP; the router and norms
replicated. A quantized shard is counted as compressed-tensors stores it (`WeightScheme.linear_bytes`, the
recipe's scheme), with the group size a row-parallel shard is re-expressed at when a group straddles two ranks
(gcd of the group and the columns per rank: the scales are repeated). Embeddings, norms, lm_head and the
router stay bf16 (the recipes' exclusions). KV: per token, K and V of this rank's KV heads in this stage's
layers.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from ascq.core.architecture import (
    NEVER_QUANTIZED,
    divide,
    head_dim_of,
    is_ignored,
    kv_heads_per_rank,
    stage_layers,
)
from ascq.zoo.planned import (
    BF16_BYTES,
    WeightScheme,
    checkpoint_tensors,
    recipe_scheme,
)

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def per_rank_memory(
    config: dict[str, Any],
    tp: int,
    pp: int = 1,
    recipe: str | None = None,
    expert_parallel: bool = False,
    kv_bytes: int = BF16_BYTES,
    pp_rank: int = 0,
    tp_rank: int = 0,
) -> dict[str, int]:
    """{"weight_bytes", "kv_bytes_per_token"} of rank (pp_rank, tp_rank); `recipe`: a recipe name of
    ascq.zoo.planned.shipped_recipe_scheme, None for the bf16 original."""
    scheme = recipe_scheme(config, recipe)
    layers = set(stage_layers(config["num_hidden_layers"], pp, pp_rank))
    experts_per_rank = divide(config.get("n_routed_experts") or tp, tp) if expert_parallel else None
    weights = 0
    for name, shape in checkpoint_tensors(config):
        layer = LAYER.match(name)
        if layer is not None and int(layer.group(1)) not in layers:
            continue
        if name.startswith("model.embed_tokens.") and pp_rank != 0:
            if config.get("tie_word_embeddings") and pp_rank == pp - 1:  # the last stage's tied LM head
                weights += _shard_bytes(name, shape, scheme, config, tp)
            continue
        if (name.startswith("lm_head.") or name == "model.norm.weight") and pp_rank != pp - 1:
            continue
        expert = EXPERT.search(name)
        if expert is not None and experts_per_rank is not None:
            if int(expert.group(1)) // experts_per_rank != tp_rank:
                continue
            weights += _tensor_bytes(name, shape, scheme)  # a whole expert
            continue
        weights += _shard_bytes(name, shape, scheme, config, tp)
    kv_heads = _kv_heads(config, tp)
    return {
        "weight_bytes": weights,
        "kv_bytes_per_token": 2 * len(layers) * kv_heads * head_dim_of(config) * kv_bytes,
    }


def _kv_heads(config: dict[str, Any], tp: int) -> int:
    return kv_heads_per_rank(config.get("num_key_value_heads") or config["num_attention_heads"], tp)


def _quantized(name: str, shape: tuple[int, ...], scheme: WeightScheme | None) -> bool:
    module = name.removesuffix(".weight")
    return scheme is not None and len(shape) == 2 and not is_ignored(module, NEVER_QUANTIZED)


def _tensor_bytes(name: str, shape: tuple[int, ...], scheme: WeightScheme | None) -> int:
    return scheme.linear_bytes(*shape) if _quantized(name, shape, scheme) else math.prod(shape) * BF16_BYTES


def _shard_bytes(
    name: str, shape: tuple[int, ...], scheme: WeightScheme | None, config: dict[str, Any], tp: int
) -> int:
    module = name.rsplit(".", 2)[-2]
    if name.startswith(("model.embed_tokens.", "lm_head.")):
        return _tensor_bytes(name, (divide(shape[0], tp), shape[1]), scheme)
    if module in ("k_proj", "v_proj"):
        local = _kv_heads(config, tp) * head_dim_of(config)
        return _tensor_bytes(name, (local, shape[1]), scheme)
    if module in COLUMN_PARALLEL:
        return _tensor_bytes(name, (divide(shape[0], tp), shape[1]), scheme)
    if module in ROW_PARALLEL:
        local_in = divide(shape[1], tp)
        scheme = scheme.for_linear(shape[1]) if scheme is not None else None
        if tp > 1 and _quantized(name, shape, scheme) and scheme.group_size and local_in % scheme.group_size:
            scheme = dataclasses.replace(scheme, group_size=math.gcd(scheme.group_size, local_in))
        return _tensor_bytes(name, (shape[0], local_in), scheme)
    return _tensor_bytes(name, shape, scheme)  # norms, the router: replicated

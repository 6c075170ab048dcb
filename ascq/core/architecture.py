"""The architecture facts every layer reads from a config.json, whatever the family (the families themselves:
`ascq.core.families`): the attention head size, which modules are never quantized, and how tensor / pipeline
parallelism cut each weight."""

from __future__ import annotations

import re
from typing import Any

from ascq.core.errors import AscqError

# The `ignore` default of every recipe that names none (llm-compressor's): the LM head and the MoE router
# (`mlp.gate`, whose logits pick the experts) stay full precision in every family.
DEFAULT_IGNORE = ("lm_head", "re:.*mlp\\.gate$")
# Never quantized whatever a recipe says, and always written to a checkpoint's `ignore`, so that a loader
# which quantizes every matching module (transformers, vLLM) keeps them full precision too: with tied
# embeddings the checkpoint has no lm_head tensor, and an `ignore` without it made transformers quantize the
# head.
NEVER_QUANTIZED = ("lm_head", "model.embed_tokens", "re:.*mlp\\.gate$")

# Tensor parallelism (Megatron's split, as vLLM): column-parallel linears split their outputs, row-parallel
# ones their inputs; everything else is replicated, except the embedding and LM head (split over the
# vocabulary).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def head_dim_of(config: dict[str, Any]) -> int:
    """The attention head size: the config's `head_dim`, else hidden_size / num_attention_heads (the one
    rule)."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise AscqError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads are split across ranks, or replicated (one per rank) when there are fewer heads than ranks."""
    if tp_size <= num_kv_heads:
        return divide(num_kv_heads, tp_size)
    if tp_size % num_kv_heads:
        raise AscqError(
            f"tensor-parallel size {tp_size} must be a multiple of num_key_value_heads {num_kv_heads}"
        )
    return 1


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Contiguous, as even as possible; earlier stages take the remainder."""
    if num_layers < pp_size:
        raise AscqError(f"{num_layers} layers cannot be split into {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def is_ignored(module_name: str, ignore: tuple[str, ...] | list[str] = DEFAULT_IGNORE) -> bool:
    """Whether a linear's full module name matches an `ignore` entry: `re:REGEX` (full match) or a module name
    (the name itself or its last components), llm-compressor's matching rule for names."""
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], module_name):
                return True
        elif module_name == pattern or module_name.endswith("." + pattern):
            return True
    return False

"""Qwen 3 MoE: Qwen 3's attention (per-head q/k RMSNorm) with DeepSeek-MoE v1's routed-expert block and no
shared experts: a softmax top-k router `mlp.gate` over `num_experts` experts `mlp.experts.E` (renormalized
when `norm_topk_prob`), on every `decoder_sparse_step`-th layer outside `mlp_only_layers` (the others dense,
of `intermediate_size`), as transformers' Qwen3MoeSparseMoeBlock."""

from __future__ import annotations

from typing import Any

from ascq.core.errors import UnsupportedError
from ascq.core.families.base import ModelFamily
from ascq.core.families.deepseek import MOE_MAPPINGS, DeepseekConfig, routed_experts_layout
from ascq.core.families.qwen3 import check_config as check_qwen3_config


def num_experts(config: dict[str, Any]) -> int:
    """The routed experts: `num_experts` (the Hub's configs), or `num_local_experts` (transformers 5's)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def expert_block(config: dict[str, Any]) -> DeepseekConfig:
    """The block's sizes and router, as DeepSeek-MoE v1's config (validated there)."""
    return DeepseekConfig(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"),
        n_routed_experts=num_experts(config),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        norm_topk_prob=bool(config.get("norm_topk_prob")),
        aux_loss_alpha=0.0,  # no training here
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(config.get("attention_bias")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings")),
    )


def is_moe_layer(config: dict[str, Any], index: int) -> bool:
    return (
        index not in (config.get("mlp_only_layers") or ())
        and num_experts(config) > 0
        and (index + 1) % int(config.get("decoder_sparse_step") or 1) == 0
    )


def check_config(config: dict[str, Any]) -> None:
    check_qwen3_config(config)
    if not num_experts(config):
        raise UnsupportedError("Qwen 3 MoE num_experts must be positive")
    expert_block(config)


QWEN3_MOE = ModelFamily(
    converter="ascq.quantize.architectures:DeepseekMoEArch",
    serving_model="ascq.runtime.models.deepseek:DeepseekForCausalLM",
    check_config=check_config,
    layout=routed_experts_layout,
    moe_mappings=MOE_MAPPINGS,
    is_moe_layer=is_moe_layer,
    qk_norm=True,
    expert_block=expert_block,
    gguf_architecture="qwen3moe",  # llama.cpp's name
)

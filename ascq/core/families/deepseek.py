"""DeepSeek-MoE v1 (`model_type: deepseek`): `DeepseekConfig` (its config.json, validated), the layout of
its dense and MoE layers (routed experts `mlp.experts.E`, shared experts, the `mlp.gate` router), and the
balance mappings of its MoE layers."""

from __future__ import annotations

import dataclasses
from typing import Any

from ascq.core.errors import AscqError, UnsupportedError
from ascq.core.families.base import (
    LLAMA_MAPPINGS,
    BalanceMapping,
    ModelFamily,
    NamedShapes,
    attention_tensors,
    mlp_tensors,
)


@dataclasses.dataclass
class DeepseekConfig:
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    moe_intermediate_size: int = 1407
    num_hidden_layers: int = 30
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    n_shared_experts: int | None = None
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_layer_freq: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 100000
    eos_token_id: int | None = 100001

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise AscqError(
                "deepseek config: hidden_size must divide by num_attention_heads, and those by "
                "num_key_value_heads"
            )
        if self.hidden_act != "silu":
            raise UnsupportedError(
                f"deepseek config: hidden_act {self.hidden_act!r} is not supported (only silu)"
            )
        if self.scoring_func != "softmax":
            raise UnsupportedError(
                f"deepseek config: scoring_func {self.scoring_func!r} is not supported (only softmax)"
            )
        if (
            self.rope_scaling is not None
            and self.rope_scaling.get("type", self.rope_scaling.get("rope_type")) != "linear"
        ):
            raise UnsupportedError(
                f"deepseek config: rope_scaling {self.rope_scaling} is not supported (None or linear)"
            )
        if self.n_routed_experts and not 0 < (self.num_experts_per_tok or 0) <= self.n_routed_experts:
            raise AscqError("deepseek config: num_experts_per_tok must be in 1..n_routed_experts")
        if self.moe_layer_freq < 1:
            raise AscqError("deepseek config: moe_layer_freq must be >= 1")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            bool(self.n_routed_experts)
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekConfig:
        """Build from a config.json dict; keys this model does not use (auto_map, torch_dtype, ...) are
        ignored."""
        if d.get("model_type", "deepseek") != "deepseek":
            raise UnsupportedError(f"expected model_type 'deepseek', got {d.get('model_type')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json content with the keys of deepseek-moe-16b-base's config (without auto_map)."""
        fields = dataclasses.asdict(self)
        if fields["head_dim"] == self.hidden_size // self.num_attention_heads:
            del fields["head_dim"]  # deepseek-moe-16b-base's config has none
        return {
            "architectures": ["DeepseekForCausalLM"],
            "attention_dropout": 0.0,
            **fields,
            "model_type": "deepseek",
            "pretraining_tp": 1,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }


def routed_experts_layout(family: ModelFamily, config: dict[str, Any], index: int) -> NamedShapes:
    """Attention, then a dense MLP or the MoE block (router, routed experts, shared experts) as the family's
    `is_moe_layer` says, then norms: every family on this block."""
    ds, hidden = family.expert_block(config), int(config["hidden_size"])
    norms = [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    attention = attention_tensors(family, config)
    if not family.is_moe_layer(config, index):
        return attention + mlp_tensors("mlp", hidden, ds.intermediate_size) + norms
    experts = [("mlp.gate.weight", (ds.n_routed_experts, hidden))]
    for e in range(ds.n_routed_experts):
        experts += mlp_tensors(f"mlp.experts.{e}", hidden, ds.moe_intermediate_size)
    if ds.n_shared_experts:
        experts += mlp_tensors("mlp.shared_experts", hidden, ds.moe_intermediate_size * ds.n_shared_experts)
    return attention + experts + norms


_EXPERT = r"mlp\.(?:experts\.\d+|shared_experts)"
MOE_MAPPINGS = (
    *LLAMA_MAPPINGS[:2],
    # one group for the routed and shared experts (judged on the whole MoE block); the router reads the same
    # norm
    BalanceMapping(
        "post_attention_layernorm", (rf"re:{_EXPERT}\.(?:gate|up)_proj",), exact_layers=("mlp.gate",)
    ),
    BalanceMapping(rf"re:{_EXPERT}\.up_proj", (rf"re:{_EXPERT}\.down_proj",)),
)


def check_config(config: dict[str, Any]) -> None:
    DeepseekConfig.from_dict(config)


def is_moe_layer(config: dict[str, Any], index: int) -> bool:
    return DeepseekConfig.from_dict(config).is_moe_layer(index)


DEEPSEEK = ModelFamily(
    converter="ascq.quantize.architectures:DeepseekMoEArch",
    serving_model="ascq.runtime.models.deepseek:DeepseekForCausalLM",
    check_config=check_config,
    layout=routed_experts_layout,
    moe_mappings=MOE_MAPPINGS,
    is_moe_layer=is_moe_layer,
    expert_block=DeepseekConfig.from_dict,
)

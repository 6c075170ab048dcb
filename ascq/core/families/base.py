"""`ModelFamily`: everything ascq knows of one model family, as data and pure functions of a config.json dict,
with lazy "module:Class" paths to the classes of higher layers that run it (the converter's architecture,
which builds the plain-PyTorch reference layer, and the serving model). A family module defines one (or a
few) of these; `registry.py` names each by `model_type`. Also the pieces families share: the balance
mappings and residual blocks of a pre-norm decoder layer, and the tensor layout of a Llama-style layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ascq.core.architecture import head_dim_of

Config = dict[str, Any]
Shape = tuple[int, ...]
NamedShapes = list[tuple[str, Shape]]


@dataclasses.dataclass(frozen=True)
class BalanceMapping:
    """`smooth_layer` produces the input that every `balance_layers` linear reads (llm-compressor's AWQMapping
    / SmoothQuant mapping). Names are module names relative to the decoder layer, or `re:` regexes (full
    match). A smooth layer that matches several modules (every expert's up_proj) pairs with the balance layers
    under its own parent module. `exact_layers` read the same output but stay full precision (the MoE router):
    they are compensated too, so the scales must be powers of two (exact in any float dtype)."""

    smooth_layer: str
    balance_layers: tuple[str, ...]
    exact_layers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LayerBlock:
    """One residual half of a decoder layer (`DecoderLayer.attention_block` / `mlp_block`): the modules it
    runs (names relative to the layer, with everything under them). The converter calibrates, quantizes and
    propagates one block at a time, so the MLP half is calibrated on what the quantized attention half
    produces."""

    name: str  # "attention" or "mlp"
    modules: tuple[str, ...]

    def contains(self, module_name: str) -> bool:
        return any(module_name == m or module_name.startswith(m + ".") for m in self.modules)


GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
LLAMA_MAPPINGS = (
    BalanceMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    BalanceMapping("self_attn.v_proj", ("self_attn.o_proj",)),  # skipped where shapes differ (GQA)
    BalanceMapping("post_attention_layernorm", GATE_UP),
    BalanceMapping("mlp.up_proj", ("mlp.down_proj",)),
)
DECODER_BLOCKS = (
    LayerBlock("attention", ("input_layernorm", "self_attn")),
    LayerBlock("mlp", ("post_attention_layernorm", "mlp")),
)


def accept_config(config: Config) -> None:
    """`ModelFamily.check_config` of a family that refuses nothing beyond what its layers check."""


def no_moe_layers(config: Config, index: int) -> bool:
    return False


def linear_tensors(name: str, out_features: int, in_features: int, bias: bool) -> NamedShapes:
    return [(f"{name}.weight", (out_features, in_features))] + (
        [(f"{name}.bias", (out_features,))] if bias else []
    )


def mlp_tensors(prefix: str, hidden: int, intermediate: int, bias: bool = False) -> NamedShapes:
    return (
        linear_tensors(f"{prefix}.gate_proj", intermediate, hidden, bias)
        + linear_tensors(f"{prefix}.up_proj", intermediate, hidden, bias)
        + linear_tensors(f"{prefix}.down_proj", hidden, intermediate, bias)
    )


def attention_tensors(family: ModelFamily, config: Config) -> NamedShapes:
    """q/k/v/o projections (biases per `family.qkv_bias` and `attention_bias`), then the per-head q/k norms of
    a family that has them."""
    hidden, head_dim = int(config["hidden_size"]), head_dim_of(config)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    q_bias, o_bias = family.qkv_bias(config), bool(config.get("attention_bias"))
    norms = (
        [("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,))]
        if family.qk_norm
        else []
    )
    return (
        linear_tensors("self_attn.q_proj", heads * head_dim, hidden, q_bias)
        + linear_tensors("self_attn.k_proj", kv_heads * head_dim, hidden, q_bias)
        + linear_tensors("self_attn.v_proj", kv_heads * head_dim, hidden, q_bias)
        + linear_tensors("self_attn.o_proj", hidden, heads * head_dim, o_bias)
        + norms
    )


def llama_layout(family: ModelFamily, config: Config, index: int) -> NamedShapes:
    """A Llama-style layer: attention, a gated MLP (`mlp_bias`), the input and post-attention norms."""
    hidden = int(config["hidden_size"])
    mlp = mlp_tensors("mlp", hidden, int(config["intermediate_size"]), bool(config.get("mlp_bias")))
    norms = [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    return attention_tensors(family, config) + mlp + norms


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One family's facts. `converter` and `serving_model` are "module:Class" paths (`registry.resolve`),
    imported only when a checkpoint of the family is converted or served: core names them without importing
    upward. The layout (`layer_tensors`) is the checkpoint's, Hugging Face names; the reference layer, the
    serving model and the planner are held to it (tests/test_core_tensors.py)."""

    converter: str  # ascq.quantize.architectures' `Architecture` subclass: builds the reference layer
    serving_model: str  # ascq.runtime.models' causal LM class
    check_config: Callable[[Config], None] = accept_config  # raises UnsupportedError in one line
    layout: Callable[[ModelFamily, Config, int], NamedShapes] = llama_layout  # `layer_tensors`
    mappings: tuple[BalanceMapping, ...] = LLAMA_MAPPINGS  # SmoothQuant's / AWQ's, dense layers
    moe_mappings: tuple[BalanceMapping, ...] = ()  # those of MoE layers (`is_moe_layer`)
    is_moe_layer: Callable[[Config, int], bool] = no_moe_layers  # routed experts in this layer
    # the sizes and router of the routed-expert block, as a `families.deepseek.DeepseekConfig` (DeepSeek-MoE
    # v1's block serves every MoE family: softmax top-k router, experts, optional shared experts)
    expert_block: Callable[[Config], Any] | None = None
    blocks: tuple[LayerBlock, ...] = DECODER_BLOCKS  # the layer's residual halves, in order
    qkv_bias_always: bool = False  # q/k/v biases whatever `attention_bias` says (Qwen 2)
    qk_norm: bool = False  # q and k RMS-normed per head before rotary (Qwen 3, Gemma 3)
    tied_embeddings_by_default: bool = False  # `tie_word_embeddings` when config.json says nothing
    gguf_architecture: str | None = None  # GGUF `general.architecture`, when it is not the model_type

    @property
    def routed_experts(self) -> bool:
        return bool(self.moe_mappings)

    def qkv_bias(self, config: Config) -> bool:
        return self.qkv_bias_always or bool(config.get("attention_bias"))

    def tie_word_embeddings(self, config: Config) -> bool:
        """Whether the LM head is the embedding matrix (no `lm_head.weight` in the checkpoint)."""
        return bool(config.get("tie_word_embeddings", self.tied_embeddings_by_default))

    def layer_tensors(self, config: Config, index: int) -> NamedShapes:
        """(name relative to `model.layers.{index}.`, shape) of one decoder layer's tensors."""
        return self.layout(self, config, index)

    def balance_mappings(self, config: Config, index: int) -> tuple[BalanceMapping, ...]:
        """SmoothQuant's and AWQ's mappings for layer `index` (data, resolved against the built layer)."""
        return self.moe_mappings if self.is_moe_layer(config, index) else self.mappings

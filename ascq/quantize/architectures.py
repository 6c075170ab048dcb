"""Per-architecture behaviour the streaming converter needs: build one decoder layer, run it, and resolve
the smoothing / balance mappings SmoothQuant and AWQ read against it. The mappings themselves are data in the
family's module (`ascq.core.families`, llm-compressor's shape: smooth_layer -> balance_layers), with its
residual blocks and MoE layers.

Every family runs ascq's plain-PyTorch reference layer (`ascq.reference.decoder.DecoderLayer`;
DeepSeek-MoE v1 with `ascq.reference.deepseek_moe.DeepseekMoE` as its MLP; Gemma 3:
`ascq.reference.gemma3.Gemma3DecoderLayer`), which shares RMSNorm, rotary, router and attention with the
runtime; transformers stays the Llama and Gemma 3 reference in the tests. Everything keeps Hugging Face names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascq.core.architecture import head_dim_of
from ascq.core.errors import AscqError, UnsupportedError
from ascq.core.families import gemma3
from ascq.core.families.base import BalanceMapping, LayerBlock
from ascq.core.families.deepseek import DeepseekConfig
from ascq.core.families.registry import family_of, resolve
from ascq.core.norm import gemma_rms_norm, rms_norm
from ascq.reference.decoder import MLP, AttentionShape, DecoderLayer, KVHook, RMSNorm, rotary_for


@dataclasses.dataclass(frozen=True)
class BalanceGroup:
    """One mapping resolved in one layer. `block`: the module whose output AWQ's scale search compares (the
    lowest common parent of the balance layers, the linear itself when there is one)."""

    smooth_layer: str
    balance_layers: list[str]
    exact_layers: list[str]
    block: str
    skip_reason: str | None = None  # set when the mapping cannot be applied in this layer


def module_matches(pattern: str, name: str) -> bool:
    """`re:REGEX` (full match) or the exact relative module name."""
    return re.fullmatch(pattern[3:], name) is not None if pattern.startswith("re:") else name == pattern


def resolve_mappings(
    layer: nn.Module, mappings: tuple[BalanceMapping, ...] | list[BalanceMapping]
) -> list[BalanceGroup]:
    """The balance groups of one layer, in mapping order; a producer whose output width differs from its
    balance layers' input width (v_proj -> o_proj under GQA) gives a group with a `skip_reason`."""
    modules = dict(layer.named_modules())
    groups = []
    for mapping in mappings:
        for smooth in [n for n in modules if n and module_matches(mapping.smooth_layer, n)]:
            parent = smooth.rpartition(".")[0]
            under = [n for n in modules if n.startswith(f"{parent}.") or not parent]
            balance = [n for n in under if any(module_matches(p, n) for p in mapping.balance_layers)]
            exact = [n for n in under if any(module_matches(p, n) for p in mapping.exact_layers)]
            if not balance:
                continue
            producer, skip = modules[smooth], None
            if isinstance(producer, nn.Linear) and any(
                producer.out_features != modules[n].in_features for n in balance
            ):
                skip = "shapes differ: GQA"
            groups.append(BalanceGroup(smooth, balance, exact, _common_parent(balance), skip))
    return groups


def _common_parent(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


class Architecture:
    """The converter's view of one family (`ascq.core.families`, the row's `converter`): builds and runs the
    reference decoder layer; the family's facts (mappings, blocks, MoE layers) are read from `self.family`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.family = family_of(config)
        self.model_type = config["model_type"]
        self.blocks: tuple[LayerBlock, ...] = self.family.blocks  # the residual halves (`forward_block`)
        self.has_routed_experts = self.family.routed_experts  # MoE layers (`expert_names`)
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = head_dim_of(config)
        self.rms_norm_eps = float(config["rms_norm_eps"])
        self.tie_word_embeddings = self.family.tie_word_embeddings(config)

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def new_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def is_moe_layer(self, index: int) -> bool:
        return self.family.is_moe_layer(self.config, index)

    def forward_layer(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        kv_hook: KVHook | None = None,
    ) -> torch.Tensor:
        """One decoder layer on hidden [batch, seq, hidden] at position_ids [1 or batch, seq]."""
        return layer(hidden, position_ids, kv_hook)

    def forward_block(
        self,
        layer: nn.Module,
        block: LayerBlock | None,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        kv_hook: KVHook | None = None,
    ) -> torch.Tensor:
        """One residual half (`self.blocks`) of a decoder layer, the two in order equal to `forward_layer`;
        None: the whole layer."""
        if block is None:
            return self.forward_layer(layer, hidden, position_ids, kv_hook)
        if block.name == "attention":
            return layer.attention_block(hidden, position_ids, kv_hook)
        return layer.mlp_block(hidden)

    def build_layer(self, index: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """The decoder layer with the given (prefix-stripped) weights, in eval mode."""
        with torch.device("meta"):
            layer = self.new_layer(index)
        try:
            layer.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise AscqError(
                f"layer {index}: checkpoint tensors do not match the config: {str(exc).splitlines()[0]}"
            ) from None
        return layer.eval()

    def balance_mappings(self, index: int) -> tuple[BalanceMapping, ...]:
        """SmoothQuant's and AWQ's mappings for layer `index` (data; resolve with `balance_groups`)."""
        return self.family.balance_mappings(self.config, index)

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input for `input_ids`: rows of the embedding matrix `weight`, as fp32."""
        return weight[input_ids].float()

    def final_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's last norm (`model.norm`) before the LM head."""
        return rms_norm(hidden, weight, self.rms_norm_eps)

    def balance_groups(self, index: int, layer: nn.Module) -> list[BalanceGroup]:
        return resolve_mappings(layer, self.balance_mappings(index))

    def expert_names(self, layer: nn.Module) -> list[str]:
        """Routed expert module names of the layer (`mlp.experts.E`), empty for dense layers."""
        experts = getattr(layer.mlp, "experts", None)
        return [f"mlp.experts.{e}" for e in range(len(experts))] if experts is not None else []


class LlamaArch(Architecture):
    """Every Llama-layout family (Llama, Mistral, Qwen 2): `ascq.reference.decoder.DecoderLayer` with a
    SiLU-gated MLP, the family's biases and q/k norms."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        attention_bias = bool(config.get("attention_bias"))
        self.shape = AttentionShape.from_config(config, self.family.qkv_bias(config), attention_bias)

    def new_layer(self, index: int) -> nn.Module:
        mlp = MLP(self.hidden_size, int(self.config["intermediate_size"]), bool(self.config.get("mlp_bias")))
        qk_norm = RMSNorm if self.family.qk_norm else None
        return DecoderLayer(self.shape, mlp, self.rms_norm_eps, rotary_for(self.config), qk_norm)


class DeepseekMoEArch(Architecture):
    """Every family on DeepSeek-MoE v1's routed-expert block (`ModelFamily.expert_block`): DeepSeek-MoE v1,
    Qwen 3 MoE."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.ds_config: DeepseekConfig = self.family.expert_block(config)

    def new_layer(self, index: int) -> nn.Module:
        from ascq.reference.deepseek_moe import DeepseekDecoderLayer

        qk_norm = RMSNorm if self.family.qk_norm else None
        return DeepseekDecoderLayer(self.ds_config, index, self.is_moe_layer(index), qk_norm, self.config)


class Gemma3Arch(Architecture):
    def new_layer(self, index: int) -> nn.Module:
        from ascq.reference.gemma3 import Gemma3DecoderLayer

        return Gemma3DecoderLayer(self.config, index)

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden_size) rounded to the embedding's dtype (transformers')."""
        scale = torch.tensor(gemma3.embed_scale(self.config), dtype=weight.dtype)
        return (weight[input_ids] * scale).float()

    def final_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(hidden, weight, self.rms_norm_eps)


def load_architecture(model_dir: Path) -> Architecture:
    """The architecture of a local HF checkpoint folder; UnsupportedError names the supported model types."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise AscqError(f"{model_dir}: config.json is missing (not a Hugging Face checkpoint folder)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AscqError(f"{path} is not valid JSON: {exc}") from None
    if config.get("quantization_config"):
        raise UnsupportedError(f"{model_dir} is already quantized; convert the unquantized checkpoint")
    return architecture_from_config(config)


def architecture_from_config(config: dict[str, Any]) -> Architecture:
    """The family's converter architecture (the registry row's `converter`)."""
    return resolve(family_of(config).converter)(config)

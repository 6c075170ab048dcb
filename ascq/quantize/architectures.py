"""Per-architecture knowledge the streaming converter needs: build one decoder layer, run it, smoothing mappings.

Every family runs ascq's plain-PyTorch reference layer (`ascq.models.decoder.DecoderLayer`; DeepSeek-MoE v1 with
`ascq.models.deepseek_moe.DeepseekMoE` as its MLP), which shares RMSNorm, rotary, router and attention with the
runtime; transformers stays the Llama reference in the tests. Everything keeps Hugging Face names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascq.errors import AscqError, UnsupportedError
from ascq.models import LLAMA_FAMILY, MODEL_TYPES
from ascq.models.decoder import MLP, AttentionShape, DecoderLayer, KVHook, head_dim_of, rotary_for
from ascq.runtime.models.llama import check_llama_config

SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)
QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


class Architecture:
    model_type: str

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = head_dim_of(config)
        self.rms_norm_eps = float(config["rms_norm_eps"])
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def new_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def forward_layer(
        self, layer: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kv_hook: KVHook | None = None
    ) -> torch.Tensor:
        """One decoder layer on hidden [batch, seq, hidden] at position_ids [1 or batch, seq]."""
        return layer(hidden, position_ids, kv_hook)

    def build_layer(self, index: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """The decoder layer with the given (prefix-stripped) weights, in eval mode."""
        with torch.device("meta"):
            layer = self.new_layer(index)
        try:
            layer.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise AscqError(f"layer {index}: checkpoint tensors do not match the config: {str(exc).splitlines()[0]}") from None
        return layer.eval()

    def smooth_mappings(self, layer: nn.Module) -> list[tuple[str, list[str]]]:
        """(norm, linears reading its output); for MoE the router and every expert's gate/up are included."""
        mlp = [f"mlp.{name}" for name in self._mlp_input_linears(layer)]
        return [("input_layernorm", list(QKV)), ("post_attention_layernorm", mlp)]

    def expert_names(self, layer: nn.Module) -> list[str]:
        """Routed expert module names of the layer (`mlp.experts.E`), empty for dense layers."""
        experts = getattr(layer.mlp, "experts", None)
        return [f"mlp.experts.{e}" for e in range(len(experts))] if experts is not None else []

    def _mlp_input_linears(self, layer: nn.Module) -> list[str]:
        names = [n for n, m in layer.mlp.named_modules() if isinstance(m, nn.Linear)]
        return [n for n in names if not n.endswith("down_proj")]


class LlamaFamily(Architecture):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.model_type = config["model_type"]
        check_llama_config(config)
        qkv_bias = self.model_type == "qwen2" or bool(config.get("attention_bias"))
        self.shape = AttentionShape.from_config(config, qkv_bias, bool(config.get("attention_bias")))

    def new_layer(self, index: int) -> nn.Module:
        mlp = MLP(self.hidden_size, int(self.config["intermediate_size"]), bool(self.config.get("mlp_bias")))
        return DecoderLayer(self.shape, mlp, self.rms_norm_eps, rotary_for(self.config))


class DeepseekMoEArch(Architecture):
    model_type = "deepseek"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        from ascq.models.deepseek_config import DeepseekConfig

        self.ds_config = DeepseekConfig.from_dict(config)

    def new_layer(self, index: int) -> nn.Module:
        from ascq.models.deepseek_moe import DeepseekDecoderLayer

        return DeepseekDecoderLayer(self.ds_config, index)


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
    model_type = config.get("model_type")
    if model_type in LLAMA_FAMILY:
        return LlamaFamily(config)
    if model_type == "deepseek":
        return DeepseekMoEArch(config)
    raise UnsupportedError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )

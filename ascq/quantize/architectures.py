"""Per-architecture knowledge the streaming converter needs: build one decoder layer, run it, smoothing mappings.

Llama-family configs (llama, mistral, qwen2) use transformers' own decoder layer classes; `model_type: deepseek`
(DeepSeek-MoE v1) uses `ascq.models.deepseek_moe.DeepseekDecoderLayer`. Everything keeps Hugging Face names.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascq.errors import AscqError, UnsupportedError
from ascq.models.deepseek_moe import KVHook

LLAMA_FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "deepseek")
QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


class _KVHookCache:
    """Duck-typed transformers `Cache` for one forward: passes each layer's new keys/values through a hook."""

    def __init__(self, hook: KVHook) -> None:
        self.hook = hook

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.hook(key_states, value_states)


class Architecture:
    model_type: str

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or self.hidden_size // self.num_heads)
        self.rms_norm_eps = float(config["rms_norm_eps"])
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def new_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def forward_layer(
        self, layer: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kv_hook: KVHook | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

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
        from transformers import AutoConfig

        self.model_type = config["model_type"]
        self.hf_config = AutoConfig.for_model(self.model_type, **{k: v for k, v in config.items() if k != "model_type"})
        self.hf_config._attn_implementation = "sdpa"
        prefix = LLAMA_FAMILY[self.model_type]
        module = importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")
        self.layer_class = getattr(module, f"{prefix}DecoderLayer")
        self.rotary = getattr(module, f"{prefix}RotaryEmbedding")(self.hf_config)

    def new_layer(self, index: int) -> nn.Module:
        return self.layer_class(self.hf_config, index)

    def forward_layer(self, layer, hidden, position_ids, kv_hook=None):
        if self.rotary.inv_freq.device != hidden.device:
            self.rotary.to(hidden.device)
        cos, sin = self.rotary(hidden, position_ids)
        cache = _KVHookCache(kv_hook) if kv_hook is not None else None
        return layer(hidden, position_ids=position_ids, position_embeddings=(cos, sin), past_key_values=cache)


class DeepseekMoEArch(Architecture):
    model_type = "deepseek"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        from ascq.models.deepseek_config import DeepseekConfig

        self.ds_config = DeepseekConfig.from_dict(config)

    def new_layer(self, index: int) -> nn.Module:
        from ascq.models.deepseek_moe import DeepseekDecoderLayer

        return DeepseekDecoderLayer(self.ds_config, index)

    def forward_layer(self, layer, hidden, position_ids, kv_hook=None):
        return layer(hidden, position_ids, kv_hook)


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

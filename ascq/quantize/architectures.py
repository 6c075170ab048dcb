"""Per-architecture knowledge the streaming converter needs: build one decoder layer, run it, and the
smoothing / balance mappings SmoothQuant and AWQ read (data, in llm-compressor's shape: smooth_layer ->
balance_layers).

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

from ascq.core import gemma3
from ascq.core.architecture import GEMMA3, LLAMA_FAMILY, MODEL_TYPES, check_llama_config, head_dim_of
from ascq.core.errors import AscqError, UnsupportedError
from ascq.core.norm import gemma_rms_norm, rms_norm
from ascq.core.tensors import tie_word_embeddings
from ascq.reference.decoder import MLP, AttentionShape, DecoderLayer, KVHook, rotary_for

SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)


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
class BalanceGroup:
    """One mapping resolved in one layer. `block`: the module whose output AWQ's scale search compares (the
    lowest common parent of the balance layers, the linear itself when there is one)."""

    smooth_layer: str
    balance_layers: list[str]
    exact_layers: list[str]
    block: str
    skip_reason: str | None = None  # set when the mapping cannot be applied in this layer


_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
LLAMA_MAPPINGS = (
    BalanceMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    BalanceMapping("self_attn.v_proj", ("self_attn.o_proj",)),  # skipped where shapes differ (GQA)
    BalanceMapping("post_attention_layernorm", _GATE_UP),
    BalanceMapping("mlp.up_proj", ("mlp.down_proj",)),
)
_EXPERT = r"mlp\.(?:experts\.\d+|shared_experts)"
DEEPSEEK_MOE_MAPPINGS = (
    *LLAMA_MAPPINGS[:2],
    # one group for the routed and shared experts (judged on the whole MoE block); the router reads the same
    # norm
    BalanceMapping(
        "post_attention_layernorm", (rf"re:{_EXPERT}\.(?:gate|up)_proj",), exact_layers=("mlp.gate",)
    ),
    BalanceMapping(rf"re:{_EXPERT}\.up_proj", (rf"re:{_EXPERT}\.down_proj",)),
)


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


DECODER_BLOCKS = (
    LayerBlock("attention", ("input_layernorm", "self_attn")),
    LayerBlock("mlp", ("post_attention_layernorm", "mlp")),
)
GEMMA3_BLOCKS = (  # each branch is normed before and after
    LayerBlock("attention", ("input_layernorm", "self_attn", "post_attention_layernorm")),
    LayerBlock("mlp", ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm")),
)
# The MLP reads pre_feedforward_layernorm (post_attention_layernorm norms the attention branch's output).
# llm-compressor's Gemma 3 AWQ mappings leave input_layernorm -> q/k/v out (smoothing it degraded its
# results, q/k being RMS-normed after the projection); ascq keeps it, since its scale search judges the
# attention output (q/k norms included) and keeps s = 1 where smoothing does not help.
GEMMA3_MAPPINGS = (
    LLAMA_MAPPINGS[0],
    LLAMA_MAPPINGS[1],
    BalanceMapping("pre_feedforward_layernorm", _GATE_UP),
    LLAMA_MAPPINGS[3],
)


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
    model_type: str
    blocks: tuple[LayerBlock, ...] = DECODER_BLOCKS  # the layer's residual halves, in order (`forward_block`)
    has_routed_experts: bool = False  # MoE layers (`expert_names`)

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = head_dim_of(config)
        self.rms_norm_eps = float(config["rms_norm_eps"])
        self.tie_word_embeddings = tie_word_embeddings(config)

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def new_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

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
        """One residual half (`DECODER_BLOCKS`) of a decoder layer, the two in order equal to `forward_layer`;
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
        return LLAMA_MAPPINGS

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
    has_routed_experts = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        from ascq.core.deepseek_config import DeepseekConfig

        self.ds_config = DeepseekConfig.from_dict(config)

    def balance_mappings(self, index: int) -> tuple[BalanceMapping, ...]:
        return DEEPSEEK_MOE_MAPPINGS if self.ds_config.is_moe_layer(index) else LLAMA_MAPPINGS

    def new_layer(self, index: int) -> nn.Module:
        from ascq.reference.deepseek_moe import DeepseekDecoderLayer

        return DeepseekDecoderLayer(self.ds_config, index)


class Gemma3Arch(Architecture):
    model_type = GEMMA3
    blocks = GEMMA3_BLOCKS

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        gemma3.check_config(config)

    def new_layer(self, index: int) -> nn.Module:
        from ascq.reference.gemma3 import Gemma3DecoderLayer

        return Gemma3DecoderLayer(self.config, index)

    def balance_mappings(self, index: int) -> tuple[BalanceMapping, ...]:
        return GEMMA3_MAPPINGS

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
    model_type = config.get("model_type")
    if model_type in LLAMA_FAMILY:
        return LlamaFamily(config)
    if model_type == "deepseek":
        return DeepseekMoEArch(config)
    if model_type == GEMMA3:
        return Gemma3Arch(config)
    raise unsupported_model_type(model_type)


def unsupported_model_type(model_type: Any) -> UnsupportedError:
    """The one-line refusal of an architecture ascq cannot convert or run, naming the supported families."""
    return UnsupportedError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )

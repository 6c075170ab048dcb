"""Gemma 3 (text) facts read from a config.json, shared by the converter's reference layer and the serving
model: which layers attend through a sliding window, each layer type's rotary settings, the query scale and
the embedding scale. Semantics are transformers' `Gemma3TextConfig` / `Gemma3ForCausalLM`: RMSNorm multiplies
by (1 + weight), q/k RMSNorm over head_dim, four norms per layer, GELU-tanh MLP, embeddings times
sqrt(hidden_size), a sliding window on `layer_types[i] == "sliding_attention"` (key position > query
position - sliding_window)."""

from __future__ import annotations

from typing import Any

from ascq.core.errors import UnsupportedError
from ascq.core.families.base import (
    GATE_UP,
    LLAMA_MAPPINGS,
    BalanceMapping,
    LayerBlock,
    ModelFamily,
    NamedShapes,
    llama_layout,
)

GEMMA3 = "gemma3_text"  # config.json model_type
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' Gemma3TextConfig.default_theta
DEFAULT_SLIDING_WINDOW_PATTERN = 6
NORM_WEIGHT_OFFSET = 1.0  # Gemma's RMSNorm multiplies by (1 + weight)


def check_config(config: dict[str, Any]) -> None:
    """Refuse what ascq does not implement for Gemma 3, in one line each."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedError(
            f"Gemma 3 hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise UnsupportedError(f"Gemma 3 {key}={config[key]} is not supported (only None)")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedError("Gemma 3 use_bidirectional_attention is not supported (causal only)")
    unknown = set(layer_types(config)) - {SLIDING, FULL}
    if unknown:
        raise UnsupportedError(f"Gemma 3 layer_types {sorted(unknown)} are not supported")


def layer_types(config: dict[str, Any]) -> list[str]:
    """`layer_types`, else the older `sliding_window_pattern` (every Nth layer global)."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = int(config.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(int(config["num_hidden_layers"]))]


def sliding_window(config: dict[str, Any], index: int) -> int | None:
    """The window (keys at most this many positions back, the query's own included) of layer `index`, None
    for a global layer."""
    if layer_types(config)[index] != SLIDING or not config.get("sliding_window"):
        return None
    return int(config["sliding_window"])


def rope_config(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """A config dict whose rotary settings are `layer_type`'s (for `ascq.core.rotary`): transformers 5's
    `rope_parameters` per layer type, else `rope_theta` / `rope_scaling` for global layers and
    `rope_local_base_freq` for sliding ones."""
    params = config.get("rope_parameters") or {}
    if layer_type in params:
        rope = dict(params[layer_type])
    elif layer_type == FULL:
        rope = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}
    else:
        rope = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq")}
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = DEFAULT_ROPE_THETA[layer_type]
    rope.setdefault("rope_type", rope.pop("type", "default"))
    out = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return {**out, "rope_theta": rope["rope_theta"], "rope_scaling": rope}


def query_scale(config: dict[str, Any]) -> float:
    return float(config.get("query_pre_attn_scalar", 256)) ** -0.5


def embed_scale(config: dict[str, Any]) -> float:
    return float(config["hidden_size"]) ** 0.5


def layout(family: ModelFamily, config: dict[str, Any], index: int) -> NamedShapes:
    """Llama's layer (with q/k norms) plus the norms before and after the feed-forward branch."""
    hidden = int(config["hidden_size"])
    return llama_layout(family, config, index) + [
        (f"{n}_feedforward_layernorm.weight", (hidden,)) for n in ("pre", "post")
    ]


BLOCKS = (  # each branch is normed before and after
    LayerBlock("attention", ("input_layernorm", "self_attn", "post_attention_layernorm")),
    LayerBlock("mlp", ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm")),
)
# The MLP reads pre_feedforward_layernorm (post_attention_layernorm norms the attention branch's output).
# llm-compressor's Gemma 3 AWQ mappings leave input_layernorm -> q/k/v out (smoothing it degraded its
# results, q/k being RMS-normed after the projection); ascq keeps it, since its scale search judges the
# attention output (q/k norms included) and keeps s = 1 where smoothing does not help.
MAPPINGS = (
    LLAMA_MAPPINGS[0],
    LLAMA_MAPPINGS[1],
    BalanceMapping("pre_feedforward_layernorm", GATE_UP),
    LLAMA_MAPPINGS[3],
)

GEMMA3_FAMILY = ModelFamily(
    converter="ascq.quantize.architectures:Gemma3Arch",
    serving_model="ascq.runtime.models.gemma3:Gemma3ForCausalLM",
    check_config=check_config,
    layout=layout,
    mappings=MAPPINGS,
    blocks=BLOCKS,
    qk_norm=True,
    tied_embeddings_by_default=True,
    gguf_architecture="gemma3",
)

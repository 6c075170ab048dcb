"""Every tensor name and shape of a checkpoint of a supported family, from its config.json alone, in the order
the files hold them (Hugging Face names). The reference models, the serving models, the planner and the
synthetic checkpoints all read and write exactly these (tests/test_core_tensors.py holds the models to
them)."""

from __future__ import annotations

import functools
import json
from typing import Any

from ascq.core.architecture import GEMMA3, LLAMA_FAMILY, head_dim_of
from ascq.core.deepseek_config import DeepseekConfig
from ascq.core.errors import UnsupportedError

# std of random weights at a checkpoint's shape (dummy loads, synthetic sources): a trained model's order
DUMMY_WEIGHT_STD = 0.02

Shape = tuple[int, ...]


def tie_word_embeddings(config: dict[str, Any]) -> bool:
    """Whether the LM head is the embedding matrix (no `lm_head.weight` in the checkpoint); transformers'
    default is False, except Gemma 3's True."""
    return bool(config.get("tie_word_embeddings", config.get("model_type") == GEMMA3))


def qkv_bias(config: dict[str, Any]) -> bool:
    """Qwen2 always has q/k/v biases; the other families when `attention_bias` says so."""
    return config.get("model_type") == "qwen2" or bool(config.get("attention_bias"))


def _linear(name: str, out_features: int, in_features: int, bias: bool) -> list[tuple[str, Shape]]:
    return [(f"{name}.weight", (out_features, in_features))] + (
        [(f"{name}.bias", (out_features,))] if bias else []
    )


def _mlp(prefix: str, hidden: int, intermediate: int, bias: bool = False) -> list[tuple[str, Shape]]:
    return (
        _linear(f"{prefix}.gate_proj", intermediate, hidden, bias)
        + _linear(f"{prefix}.up_proj", intermediate, hidden, bias)
        + _linear(f"{prefix}.down_proj", hidden, intermediate, bias)
    )


def _attention(config: dict[str, Any], q_bias: bool, o_bias: bool) -> list[tuple[str, Shape]]:
    hidden, head_dim = int(config["hidden_size"]), head_dim_of(config)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return (
        _linear("self_attn.q_proj", heads * head_dim, hidden, q_bias)
        + _linear("self_attn.k_proj", kv_heads * head_dim, hidden, q_bias)
        + _linear("self_attn.v_proj", kv_heads * head_dim, hidden, q_bias)
        + _linear("self_attn.o_proj", hidden, heads * head_dim, o_bias)
    )


def layer_tensors(config: dict[str, Any], index: int) -> list[tuple[str, Shape]]:
    """(name relative to `model.layers.{index}.`, shape) of one decoder layer's tensors."""
    model_type, hidden = config.get("model_type"), int(config["hidden_size"])
    norms = [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    if model_type in LLAMA_FAMILY:
        attention = _attention(config, qkv_bias(config), bool(config.get("attention_bias")))
        return (
            attention
            + _mlp("mlp", hidden, int(config["intermediate_size"]), bool(config.get("mlp_bias")))
            + norms
        )
    if model_type == "deepseek":
        ds = DeepseekConfig.from_dict(config)
        attention = _attention(config, ds.attention_bias, ds.attention_bias)
        if not ds.is_moe_layer(index):
            return attention + _mlp("mlp", hidden, ds.intermediate_size) + norms
        experts = [("mlp.gate.weight", (ds.n_routed_experts, hidden))]
        for e in range(ds.n_routed_experts):
            experts += _mlp(f"mlp.experts.{e}", hidden, ds.moe_intermediate_size)
        if ds.n_shared_experts:
            experts += _mlp("mlp.shared_experts", hidden, ds.moe_intermediate_size * ds.n_shared_experts)
        return attention + experts + norms
    if model_type == GEMMA3:
        bias, head_dim = bool(config.get("attention_bias")), head_dim_of(config)
        qk_norms = [("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,))]
        ffn_norms = [(f"{n}_feedforward_layernorm.weight", (hidden,)) for n in ("pre", "post")]
        return (
            _attention(config, bias, bias)
            + qk_norms
            + _mlp("mlp", hidden, int(config["intermediate_size"]))
            + norms
            + ffn_norms
        )
    raise UnsupportedError(f"model_type {model_type!r} is not supported")


def checkpoint_tensors(config: dict[str, Any]) -> tuple[tuple[str, Shape], ...]:
    """(Hugging Face tensor name, shape) of every tensor of the checkpoint `config` describes, in file order
    (memoized per config: the planner and the per-rank sizing ask for the same list many times)."""
    return _checkpoint_tensors(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _checkpoint_tensors(config_json: str) -> tuple[tuple[str, Shape], ...]:
    config = json.loads(config_json)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    tensors: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for index in range(int(config["num_hidden_layers"])):
        tensors += [(f"model.layers.{index}.{name}", shape) for name, shape in layer_tensors(config, index)]
    tensors.append(("model.norm.weight", (hidden,)))
    if not tie_word_embeddings(config):
        tensors.append(("lm_head.weight", (vocab, hidden)))
    return tuple(tensors)

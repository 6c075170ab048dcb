"""The tensor names and shapes in ascq/core/tensors.py are the ones the models hold: the reference models'
state dicts (meta device, every family and variant) and the fixture checkpoints' files."""

from __future__ import annotations

import json

import pytest
import torch

from ascq.core.families.deepseek import DeepseekConfig
from ascq.core.tensors import checkpoint_tensors
from ascq.formats.safetensors import CheckpointReader
from ascq.quantize.architectures import architecture_from_config

LLAMA = dict(
    model_type="llama",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)
DEEPSEEK = dict(
    model_type="deepseek",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)
VARIANTS = {
    "llama": LLAMA,
    "llama-tied": {**LLAMA, "tie_word_embeddings": True},
    "llama-head-dim": {**LLAMA, "head_dim": 32},
    "llama-biases": {**LLAMA, "attention_bias": True, "mlp_bias": True},
    "qwen2": {**LLAMA, "model_type": "qwen2"},
    "qwen3": {**LLAMA, "model_type": "qwen3", "head_dim": 32},
    "qwen3-moe": {
        **LLAMA,
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [0],
    },
    "mistral": {**LLAMA, "model_type": "mistral"},
    "deepseek": DEEPSEEK,
    "deepseek-no-shared": {**DEEPSEEK, "n_shared_experts": None},
}


def reference_state_dict(config: dict) -> dict[str, tuple[int, ...]]:
    """The reference model's tensors: embedding, every layer as the converter builds it, final norm, LM
    head."""
    arch = architecture_from_config(config)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"])}
    for index in range(arch.num_layers):
        with torch.device("meta"):
            layer = arch.new_layer(index)
        shapes |= {arch.layer_prefix(index) + n: tuple(t.shape) for n, t in layer.state_dict().items()}
    shapes["model.norm.weight"] = (config["hidden_size"],)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (config["vocab_size"], config["hidden_size"])
    return shapes


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_names_and_shapes_are_the_reference_models(variant):
    config = VARIANTS[variant]
    assert list(dict(checkpoint_tensors(config)).items()) == list(reference_state_dict(config).items())


def test_deepseek_reference_model_holds_the_same_tensors():
    from ascq.reference.deepseek_moe import DeepseekForCausalLM

    with torch.device("meta"):
        model = DeepseekForCausalLM(DeepseekConfig.from_dict(DEEPSEEK))
    assert dict(checkpoint_tensors(DEEPSEEK)) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_deepseek_moe_dir"])
def test_fixture_checkpoints_hold_exactly_these_tensors(fixture, request):
    folder = request.getfixturevalue(fixture)
    config = json.loads((folder / "config.json").read_text())
    reader = CheckpointReader(folder)
    on_disk = {name: tuple(reader.tensor_info(name)[1]) for name in reader}
    assert on_disk == dict(checkpoint_tensors(config))

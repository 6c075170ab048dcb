"""The model-family registry (`ascq.core.families.registry`): every row resolves to a family whose converter
architecture and serving model exist, rows are imported only when used, and unknown or refused configs get
one-line errors naming what is supported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from ascq.core.errors import UnsupportedError
from ascq.core.families.base import ModelFamily
from ascq.core.families.registry import (
    FAMILY_ROWS,
    SUPPORTED_ARCHITECTURES,
    family_of,
    family_of_architectures,
    lookup,
    model_type_of_gguf,
    resolve,
)
from ascq.core.tensors import checkpoint_tensors
from ascq.quantize.architectures import Architecture
from ascq.runtime.models import model_class_for

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    num_experts=4,  # Qwen 3 MoE's
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)


@pytest.mark.parametrize("model_type", sorted(FAMILY_ROWS))
def test_every_row_resolves_to_a_family_with_its_classes(model_type):
    family = lookup(model_type)
    assert isinstance(family, ModelFamily)
    assert issubclass(resolve(family.converter), Architecture)
    serving = resolve(family.serving_model)
    assert issubclass(serving, nn.Module)
    architecture = FAMILY_ROWS[model_type][0]
    assert model_class_for({**TINY, "architectures": [architecture], "model_type": model_type}) is serving


def test_rows_are_imported_only_when_used():
    code = (
        "import sys; from ascq.core.families import registry; "
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('ascq.core.families.') "
        "and m not in ('ascq.core.families.base', 'ascq.core.families.registry')); "
        "print(loaded()); registry.lookup('qwen2'); print(loaded())"
    )
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    before, after = out.splitlines()
    assert before == "[]"
    assert "ascq.core.families.qwen2" in after and "ascq.core.families.gemma3" not in after


def test_each_architecture_names_one_family():
    assert len(set(SUPPORTED_ARCHITECTURES)) == len(FAMILY_ROWS)


def test_unknown_model_type_and_architecture_are_refused_naming_the_supported():
    refusal = "model_type 'falcon' is not supported; supported: llama"
    with pytest.raises(UnsupportedError, match=refusal) as exc:
        family_of({**TINY, "model_type": "falcon"})
    assert all(model_type in str(exc.value) for model_type in FAMILY_ROWS)
    with pytest.raises(UnsupportedError, match="FalconForCausalLM.* is not supported; supported: Llama"):
        family_of_architectures({"architectures": ["FalconForCausalLM"]})


def test_family_facts_read_from_the_rows():
    assert family_of({**TINY, "model_type": "qwen2"}).qkv_bias({}) is True
    assert family_of({**TINY, "model_type": "llama"}).qkv_bias({"attention_bias": True}) is True
    assert family_of({**TINY, "model_type": "llama"}).qkv_bias({}) is False
    assert lookup("gemma3_text").tie_word_embeddings({}) and not lookup("llama").tie_word_embeddings({})
    assert model_type_of_gguf("gemma3") == "gemma3_text" and model_type_of_gguf("llama") == "llama"
    assert model_type_of_gguf("qwen3moe") == "qwen3_moe"  # llama.cpp's name
    assert lookup("deepseek").routed_experts and not lookup("llama").routed_experts


def test_qwen3_layout_has_per_head_qk_norms_and_no_biases():
    names = dict(checkpoint_tensors({**TINY, "model_type": "qwen3", "head_dim": 16}))
    assert names["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert names["model.layers.0.self_attn.k_norm.weight"] == (16,)
    assert not any(name.endswith("_proj.bias") for name in names)


def test_qwen3_sliding_window_is_refused_in_one_line():
    config = {**TINY, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(UnsupportedError, match="Qwen 3 sliding-window layers are not supported"):
        family_of(config)

"""The planned `zoo/deepseek-moe-16b` entry: config.json of deepseek-ai/deepseek-moe-16b-base, the recipes to
apply, expected checkpoint sizes and serving memory per recipe (and per rank for TP 2/4/8 and EP 8), and the
commands that produce and serve it. No weights. What was measured at this shape on a real machine (dummy and
synthetic full-size weights; docs/benchmarks.md has each command) is in
`ascq/data/deepseek-moe-16b-measured.json` and lands in the plan and card.

Regenerate with `python -m ascq.zoo.deepseek_moe_16b [TARGET]`.
"""

from __future__ import annotations

import json
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

from ascq.paths import zoo_root
from ascq.zoo.planned import write_planned_entry

NAME = "deepseek-moe-16b"
SOURCE = "deepseek-ai/deepseek-moe-16b-base"
RECIPES = ["awq-int4", "w4a16-gptq", "w4a8-dynamic", "w8a8", "w8a16"]
COMMANDS = {
    "convert": f"ascq convert {SOURCE} --recipe awq-int4 --out zoo/{NAME}",
    "serve": f"ascq serve zoo/{NAME}",
}
LICENSE = {
    "license": "other",
    "license_name": "deepseek",
    "license_link": f"https://huggingface.co/{SOURCE}/blob/main/LICENSE",
}

# config.json of deepseek-ai/deepseek-moe-16b-base as published (the model's own remote code is never run by
# ascq).
CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekConfig",
        "AutoModel": "modeling_deepseek.DeepseekModel",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "max_position_embeddings": 4096,
    "model_type": "deepseek",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 28,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0",
    "use_cache": True,
    "vocab_size": 102400,
}


# multi-device layouts of the plan: name -> (tensor_parallel_size, enable_expert_parallel)
LAYOUTS = {"tp2": (2, False), "tp4": (4, False), "tp8": (8, False), "ep8": (8, True)}
NUM_SEQS_OPTIONS = (1, 16)


def per_rank_plan(config: dict[str, Any], recipes: list[str]) -> dict[str, Any]:
    """Per layout and recipe: weights and KV cache of one rank (ascq/zoo/sizing.py; the splits are even, so
    every rank of a layout holds the same bytes), for full-length sequences as the plan's serve_memory."""
    from ascq.zoo.sizing import per_rank_memory

    num_positions = config["max_position_embeddings"]
    layouts = {}
    for name, (tp, expert_parallel) in LAYOUTS.items():
        rows = {}
        for recipe in [None, *recipes]:
            memory = per_rank_memory(config, tp, recipe=recipe, expert_parallel=expert_parallel)
            weights, kv_per_token = memory["weight_bytes"], memory["kv_bytes_per_token"]
            rows[recipe or "bf16"] = {
                "weights_bytes": weights,
                "kv_cache_bytes_per_token": kv_per_token,
                "serve_memory": {
                    f"{n}x{num_positions}_tokens": {
                        "weights_bytes": weights,
                        "kv_cache_bytes": kv_per_token * n * num_positions,
                        "total_bytes": weights + kv_per_token * n * num_positions,
                    }
                    for n in NUM_SEQS_OPTIONS
                },
            }
        layouts[name] = {
            "tensor_parallel_size": tp,
            "enable_expert_parallel": expert_parallel,
            "recipes": rows,
        }
    return layouts


def measured() -> dict[str, Any] | None:
    """{"machine", "date", "rows": [{"what", "value", "command"}]}: the numbers measured at full shape."""
    path = files("ascq") / "data" / f"{NAME}-measured.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_entry(target: Path | None = None) -> dict[str, Any]:
    return write_planned_entry(
        Path(target) if target else zoo_root() / NAME,
        CONFIG,
        COMMANDS,
        RECIPES,
        extra_plan={"per_rank": per_rank_plan(CONFIG, RECIPES), "measured": measured()},
        source={"model": SOURCE, "revision": "main"},
        base_model=SOURCE,
        format="compressed-tensors",
        scheme="w4a16",
        recipe={"names": ["awq-int4"], "text": None},  # not applied yet; the card shows the shipped recipe
        **LICENSE,
    )


if __name__ == "__main__":
    print(write_entry(Path(sys.argv[1]) if len(sys.argv) > 1 else None)["planned"]["recipes"])

"""Every tensor name and shape of a checkpoint of a supported family, from its config.json alone, in the order
the files hold them (Hugging Face names). The reference models, the serving models, the planner and the
synthetic checkpoints all read and write exactly these (tests/test_core_tensors.py holds the models to
them)."""

from __future__ import annotations

import functools
import json
from typing import Any

from ascq.core.families.base import Shape
from ascq.core.families.registry import family_of, lookup

# std of random weights at a checkpoint's shape (dummy loads, synthetic sources): a trained model's order
DUMMY_WEIGHT_STD = 0.02


def tie_word_embeddings(config: dict[str, Any]) -> bool:
    """Whether the LM head is the embedding matrix (no `lm_head.weight` in the checkpoint); transformers'
    default is False, except in families that say otherwise (Gemma 3)."""
    family = lookup(config.get("model_type"))
    return family.tie_word_embeddings(config) if family else bool(config.get("tie_word_embeddings"))


def layer_tensors(config: dict[str, Any], index: int) -> list[tuple[str, Shape]]:
    """(name relative to `model.layers.{index}.`, shape) of one decoder layer's tensors."""
    return family_of(config).layer_tensors(config, index)


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

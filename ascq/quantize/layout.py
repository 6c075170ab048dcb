"""A checkpoint's tensor names and shapes, derived from the architecture description (the converter's
`Architecture.new_layer`, i.e. the reference modules that load those tensors), without building a model: one
decoder layer per layer kind is built on the meta device and its names are repeated for every layer of that
kind. The planner and the synthetic checkpoints read it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ascq.quantize.architectures import Architecture, DeepseekMoEArch, architecture_from_config

Shape = tuple[int, ...]


def layer_kind(arch: Architecture, index: int) -> str:
    """ "moe" or "dense": everything a decoder layer's tensor names and shapes depend on
    (DeepseekConfig.is_moe_layer is the one dense/MoE rule)."""
    return "moe" if isinstance(arch, DeepseekMoEArch) and arch.ds_config.is_moe_layer(index) else "dense"


def decoder_linears(arch: Architecture) -> Iterator[tuple[str, nn.Linear]]:
    """(full name, meta-device module) of every linear of every decoder layer, without loading a weight: what
    a recipe's schemes are matched against before the converter streams the layers."""
    kinds: dict[str, list[tuple[str, nn.Linear]]] = {}
    for index in range(arch.num_layers):
        kind = layer_kind(arch, index)
        if kind not in kinds:
            with torch.device("meta"):
                layer = arch.new_layer(index)
            kinds[kind] = [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
        prefix = arch.layer_prefix(index)
        yield from ((prefix + name, module) for name, module in kinds[kind])


def checkpoint_tensors(config: dict[str, Any]) -> tuple[tuple[str, Shape], ...]:
    """(Hugging Face tensor name, shape) of every tensor of the checkpoint `config` describes, in file order
    (memoized per config: the planner and the per-rank sizing ask for the same list many times)."""
    return _checkpoint_tensors(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _checkpoint_tensors(config_json: str) -> tuple[tuple[str, Shape], ...]:
    config = json.loads(config_json)
    arch = architecture_from_config(config)
    hidden, vocab = arch.hidden_size, int(config["vocab_size"])
    layer_tensors: dict[str, list[tuple[str, Shape]]] = {}
    tensors: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for index in range(arch.num_layers):
        kind = layer_kind(arch, index)
        if kind not in layer_tensors:
            with torch.device("meta"):
                layer = arch.new_layer(index)
            layer_tensors[kind] = [(name, tuple(t.shape)) for name, t in layer.state_dict().items()]
        prefix = arch.layer_prefix(index)
        tensors += [(prefix + name, shape) for name, shape in layer_tensors[kind]]
    tensors.append(("model.norm.weight", (hidden,)))
    if not arch.tie_word_embeddings:
        tensors.append(("lm_head.weight", (vocab, hidden)))
    return tuple(tensors)

"""The decoder linears of a checkpoint as meta-device modules, without building a model: one decoder layer per
layer kind (the converter's `Architecture.new_layer`) is built on the meta device and its linears are repeated
for every layer of that kind. What a recipe's schemes are matched against before the layers stream. (The
checkpoint's tensor names and shapes: `ascq.core.tensors`.)"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ascq.quantize.architectures import Architecture

Shape = tuple[int, ...]


def layer_kind(arch: Architecture, index: int) -> str:
    """ "moe" or "dense": everything a decoder layer's tensor names and shapes depend on (the family's
    `is_moe_layer` is the one dense/MoE rule)."""
    return "moe" if arch.is_moe_layer(index) else "dense"


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

"""vLLM's `--load-format dummy`: random weights at the config's real shape, made directly in the form the
loader hands to the layers (quantized linears as their scheme's integers, scales and zero points; never a
bf16 copy of the whole model), and a tokenizer for a folder that has none.

The weights are noise: the point is the real shapes, bytes and kernels (start-up, memory, speed), not text.
Dequantized weights come out with a standard deviation of about 0.02, like a trained model's init. Each tensor
is its own copy of a window, at a random offset, of one pool of random values per kind: a generator call per
tensor would cost minutes at the full shape of a 16B model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from ascq.core.qmath import linear_group_size
from ascq.core.tensors import DUMMY_WEIGHT_STD, checkpoint_tensors

POOL_SIZE = 1 << 24
INPUT_SCALE = 4.0 / 127  # a static int8 input scale for activations of magnitude up to about 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def dummy_weights(config: dict[str, Any], quant: Any, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, in file order; `quant`: the loader's QuantConfig or None."""
    generator = torch.Generator().manual_seed(seed)
    for name, shape in checkpoint_tensors(config):
        prefix, param = name.rsplit(".", 1)
        group = (
            quant.group_for(prefix) if quant is not None and param == "weight" and len(shape) == 2 else None
        )
        if group is None:
            yield name, _dense(name, shape, generator)
            continue
        for local, tensor in random_quantized_linear(group[0], shape, generator).items():
            yield f"{prefix}.{local}", tensor
    if quant is not None and quant.kv_cache_scheme is not None:
        for index in range(int(config["num_hidden_layers"])):
            for scale in ("k_scale", "v_scale"):
                yield f"model.layers.{index}.self_attn.{scale}", torch.ones(1)


def _dense(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return _window(_normal_pool(generator.initial_seed()), shape, generator)


@functools.lru_cache(maxsize=2)
def _normal_pool(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(POOL_SIZE, generator=generator) * DUMMY_WEIGHT_STD).to(torch.bfloat16)


@functools.lru_cache(maxsize=4)
def _int_pool(seed: int, low: int, high: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (POOL_SIZE,), generator=generator, dtype=torch.int8)


def _window(pool: torch.Tensor, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A new tensor of `shape` holding the pool's values from a random offset on (wrapping around)."""
    numel = math.prod(shape)
    offset = int(torch.randint(len(pool), (1,), generator=generator))
    if offset + numel <= len(pool):
        return pool[offset : offset + numel].clone().view(shape)
    out = torch.empty(numel, dtype=pool.dtype)
    start = 0
    while start < numel:
        piece = pool[offset : offset + numel - start]
        out[start : start + len(piece)] = piece
        start, offset = start + len(piece), 0
    return out.view(shape)


def random_quantized_linear(
    scheme: QuantizationScheme, shape: tuple[int, ...], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One linear in the loader's signed-int convention (`compressed_tensors.decompress_linear`): int8
    `weight`, `weight_scale`, `zero_point` when asymmetric, `input_scale` for static activations."""
    weights: QuantizationArgs = scheme.weights
    out_features, in_features = shape
    low, high = -(2 ** (weights.num_bits - 1)), 2 ** (weights.num_bits - 1) - 1
    group_size = linear_group_size(weights.group_size, in_features) if weights.strategy == "group" else None
    num_groups = in_features // group_size if group_size else 1
    uniform_std = ((high - low + 1) ** 2 - 1) ** 0.5 / 12**0.5
    tensors = {
        "weight": _window(_int_pool(generator.initial_seed(), low, high), shape, generator),
        "weight_scale": torch.full(
            (out_features, num_groups), DUMMY_WEIGHT_STD / uniform_std, dtype=torch.bfloat16
        ),
    }
    if not weights.symmetric:
        zero_dtype = weights.zp_dtype if weights.zp_dtype is not None else torch.int8
        tensors["zero_point"] = torch.zeros((out_features, num_groups), dtype=zero_dtype)
    activations = scheme.input_activations
    if activations is not None and not activations.dynamic:
        tensors["input_scale"] = torch.tensor([INPUT_SCALE], dtype=torch.bfloat16)
    return tensors


def has_tokenizer(model_dir: Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)

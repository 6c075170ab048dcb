"""Planned zoo entries: checkpoint size and serving memory per recipe computed from an architecture's
config.json (tensor names and shapes from `ascq.quantize.layout`, the architecture description), and
`require_weights`, the check that tells a user which command produces an entry's missing weights.

Sizes count tensor payload bytes exactly as a compressed-tensors checkpoint stores them (safetensors headers,
a few KiB, are not counted): quantized linears as `ascq.formats.compressed_tensors.linear_bytes` says;
embeddings, norms, `lm_head` and the MoE router stay in bf16 (the converters' default exclusions).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compressed_tensors.quantization import QuantizationArgs

from ascq.core.architecture import NEVER_QUANTIZED, head_dim_of, is_ignored
from ascq.core.errors import AscqError
from ascq.core.qmath import fitted_group_size, linear_group_size
from ascq.core.tensors import Shape, checkpoint_tensors
from ascq.formats import compressed_tensors as ct
from ascq.formats.manifest import (
    MANIFEST_NAME,
    list_entry_files,
    new_manifest,
    read_manifest,
    staged_entry,
    write_manifest,
)

BF16_BYTES = 2


@dataclass(frozen=True)
class WeightScheme:
    """How a recipe stores one linear: bits, group size (None = per output channel), zero point, static
    input scale."""

    scheme: str
    num_bits: int
    group_size: int | None
    symmetric: bool
    static_input_scale: bool = False

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise AscqError(f"{self.scheme}: num_bits must be 4 or 8, got {self.num_bits}")
        if self.group_size is not None and self.group_size < 1:
            raise AscqError(f"{self.scheme}: group_size must be positive or None, got {self.group_size}")

    def weight_args(self) -> QuantizationArgs:
        strategy = "group" if self.group_size else "channel"
        return QuantizationArgs(
            num_bits=self.num_bits, strategy=strategy, group_size=self.group_size, symmetric=self.symmetric
        )

    def activation_args(self) -> QuantizationArgs | None:
        if self.scheme.endswith("a16"):
            return None
        static = self.static_input_scale
        return QuantizationArgs(num_bits=8, strategy="tensor" if static else "token", dynamic=not static)

    def for_linear(self, in_features: int) -> WeightScheme:
        """This scheme for one linear: per channel where the group size does not divide it
        (`qmath.linear_group_size`)."""
        group = linear_group_size(self.group_size, in_features)
        return self if group == self.group_size else dataclasses.replace(self, group_size=group)

    def fitted(self, in_features: Sequence[int]) -> WeightScheme:
        """The checkpoint's scheme over its quantized linears' input widths (`qmath.fitted_group_size`)."""
        if not self.group_size or not in_features:
            return self
        return dataclasses.replace(
            self, group_size=fitted_group_size(self.group_size, in_features) or self.group_size
        )

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one linear as compressed-tensors stores it
        (`ascq.formats.compressed_tensors.linear_bytes`)."""
        return _linear_bytes(self.for_linear(in_features), out_features, in_features)


@functools.cache
def _linear_bytes(scheme: WeightScheme, out_features: int, in_features: int) -> int:
    """Memoized: a MoE checkpoint has tens of thousands of linears of a few shapes, and each library call
    is slow."""
    return ct.linear_bytes(scheme.weight_args(), scheme.activation_args(), out_features, in_features)


@functools.cache
def _stored_scheme(recipe: str) -> WeightScheme | None:
    """How shipped recipe `recipe` (recipes/*.yaml) stores its linears, read from its own config group; None
    when it quantizes no weights (fp8-kv)."""
    from ascq.quantize.recipe import load_recipe  # the converters' modules, only when asked

    schemes = [m.quant_scheme() for m in load_recipe(recipe).modifiers]
    groups = [g for s in schemes if s is not None for g in s.config_groups.values()]
    if not groups:
        return None
    weights, activations = groups[0].weights, groups[0].input_activations
    return WeightScheme(
        ct.scheme_name(weights, activations),
        weights.num_bits,
        weights.group_size if weights.strategy == "group" else None,
        weights.symmetric,
        static_input_scale=activations is not None and not activations.dynamic,
    )


def shipped_recipe_scheme(recipe: str) -> WeightScheme:
    """The stored scheme of a shipped weight recipe; any other name is refused in one line."""
    from ascq.quantize.recipe import available_recipes

    scheme = _stored_scheme(recipe) if recipe in available_recipes() else None
    if scheme is None:
        known = sorted(name for name in available_recipes() if _stored_scheme(name))
        raise AscqError(f"unknown weight recipe '{recipe}'; known: {', '.join(known)}")
    return scheme


def num_parameters(config: dict[str, Any], tensors: Sequence[tuple[str, Shape]] | None = None) -> int:
    return sum(math.prod(shape) for _, shape in tensors or checkpoint_tensors(config))


def _is_quantized(name: str, shape: Shape) -> bool:
    module = name.removesuffix(".weight")
    return len(shape) == 2 and not is_ignored(module, NEVER_QUANTIZED)


def recipe_scheme(
    config: dict[str, Any], recipe: str | None, tensors: Sequence[tuple[str, Shape]] | None = None
) -> WeightScheme | None:
    """How `recipe` stores this model's linears, its group size fitted to their input widths as the converter
    fits it (None: the bf16 original)."""
    if not recipe:
        return None
    scheme = shipped_recipe_scheme(recipe)
    return scheme.fitted(
        sorted(
            {shape[1] for name, shape in tensors or checkpoint_tensors(config) if _is_quantized(name, shape)}
        )
    )


def checkpoint_bytes(
    config: dict[str, Any], recipe: str | None, tensors: Sequence[tuple[str, Shape]] | None = None
) -> int:
    """Tensor payload bytes of the checkpoint `recipe` produces (None: the bf16 original); `tensors` defaults
    to `checkpoint_tensors(config)`. Each distinct (kind, shape) is sized once: a MoE checkpoint repeats a few
    shapes tens of thousands of times."""
    scheme = recipe_scheme(config, recipe, tensors)
    counts = Counter(
        (scheme is not None and _is_quantized(name, shape), shape)
        for name, shape in tensors or checkpoint_tensors(config)
    )
    return sum(
        num * (scheme.linear_bytes(*shape) if quantized else math.prod(shape) * BF16_BYTES)
        for (quantized, shape), num in counts.items()
    )


def kv_cache_bytes_per_token(config: dict[str, Any], kv_bytes: int = BF16_BYTES) -> int:
    num_heads = config["num_attention_heads"]
    head_dim = head_dim_of(config)
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    return 2 * config["num_hidden_layers"] * num_kv_heads * head_dim * kv_bytes


def serving_memory(config: dict[str, Any], weights_bytes: int, num_seqs: int = 1) -> dict[str, int]:
    """Weights (every expert resident, `checkpoint_bytes`) + a bf16 KV cache for `num_seqs` full-length
    sequences; activation workspace is not included."""
    num_tokens = config["max_position_embeddings"] * num_seqs
    kv = kv_cache_bytes_per_token(config) * num_tokens
    return {
        "weights_bytes": weights_bytes,
        "kv_cache_tokens": num_tokens,
        "kv_cache_bytes": kv,
        "total_bytes": weights_bytes + kv,
    }


def plan(
    config: dict[str, Any], recipes: list[str], num_seqs_options: tuple[int, ...] = (1, 16)
) -> dict[str, Any]:
    """Per recipe (plus "bf16"): checkpoint bytes and serving memory at each concurrency in
    `num_seqs_options`."""
    tensors = checkpoint_tensors(config)
    rows: dict[str, Any] = {}
    for recipe in [None, *recipes]:
        weights = checkpoint_bytes(config, recipe, tensors)
        rows[recipe or "bf16"] = {
            "scheme": shipped_recipe_scheme(recipe).scheme if recipe else "dense",
            "checkpoint_bytes": weights,
            "serve_memory": {
                f"{n}x{config['max_position_embeddings']}_tokens": serving_memory(config, weights, n)
                for n in num_seqs_options
            },
        }
    return {
        "num_parameters": num_parameters(config, tensors),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(config),
        "recipes": rows,
    }


def write_planned_entry(
    target: Path,
    config: dict[str, Any],
    commands: dict[str, str],
    recipes: list[str],
    extra_plan: dict[str, Any] | None = None,
    **manifest_fields: Any,
) -> dict[str, Any]:
    """Write an entry holding only config.json and a manifest whose `planned` section says how to produce it
    (`extra_plan`: more keys for that section, e.g. per-rank memory)."""
    with staged_entry(Path(target)) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        planned = {"weights": False, "commands": commands, **plan(config, recipes), **(extra_plan or {})}
        manifest = write_manifest(
            staging, new_manifest(Path(target).name, planned=planned, **manifest_fields)
        )
    return manifest


def require_weights(entry_dir: Path) -> None:
    """Raise AscqError naming the command that produces the weights when a zoo entry holds no safetensors
    (folders that are not zoo entries are left to the loader)."""
    entry_dir = Path(entry_dir)
    if not (entry_dir / MANIFEST_NAME).is_file() or any(
        r.endswith(".safetensors") for r in list_entry_files(entry_dir)
    ):
        return
    manifest = read_manifest(entry_dir)
    command = ((manifest.get("planned") or {}).get("commands") or {}).get("convert")
    how = (
        f"produce them with `{command}`"
        if command
        else "convert a model into it with `ascq convert MODEL --recipe NAME --out PATH`"
    )
    raise AscqError(
        f"zoo entry {entry_dir.name} has no weights yet: {how}; or run it on random weights (shape, memory "
        f"and speed only) with `ascq serve {entry_dir} --load-format dummy`"
    )

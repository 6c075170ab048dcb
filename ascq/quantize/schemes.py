"""Quantization schemes of a recipe, as compressed-tensors `QuantizationScheme`s, and which linear gets which.

A quantizing modifier's arguments (`targets`, `ignore`, `scheme` preset or `config_groups`, `kv_cache_scheme`) are
parsed into a `RecipeScheme`; matching uses compressed-tensors' own matcher so a checkpoint's `config_groups` and
`ignore` select exactly the linears that were quantized when transformers or vLLM read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from pydantic import ValidationError
from torch import nn

from ascq.errors import AscqError, UnsupportedError
from ascq.formats import compressed_tensors as ct
from ascq.quantize.qmath import block_aligned_group_size
from ascq.zoo.manifest import group_size_fit_text

DEFAULT_TARGETS = ["Linear"]
# lm_head and embeddings stay full precision, as does the MoE router (its logits pick the experts).
DEFAULT_IGNORE = ["lm_head", "re:.*mlp\\.gate$"]
# ... and whatever a recipe says, these are never quantized and always written to `ignore`, so that a loader which
# quantizes every matching module (transformers, vLLM) keeps them full precision too: with tied embeddings the
# checkpoint has no lm_head tensor, and an `ignore` without it made transformers quantize the head (perplexity inf).
ALWAYS_IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp\\.gate$"]
SUPPORTED_PRESETS = ("W8A8", "W4A16", "W4A16_ASYM", "W8A16", "W4A8")


class RecipeError(AscqError):
    """A recipe that cannot be parsed or validated."""


@dataclasses.dataclass
class RecipeScheme:
    owner: str  # the modifier that declared it (and quantizes its linears)
    config_groups: dict[str, QuantizationScheme]
    ignore: list[str]
    kv_cache_scheme: QuantizationArgs | None = None


@dataclasses.dataclass
class LinearTarget:
    weights: QuantizationArgs
    input_activations: QuantizationArgs | None
    owner: RecipeScheme  # the quantizing modifier's scheme; `owner.owner` is the modifier's name

    @property
    def scheme(self) -> QuantizationScheme:
        return QuantizationScheme(targets=["Linear"], weights=self.weights, input_activations=self.input_activations)


def _args(owner: str, where: str, value: Any) -> QuantizationArgs:
    if not isinstance(value, dict):
        raise RecipeError(f"{owner}: {where} must be a mapping of quantization arguments, got {value!r}")
    try:
        return QuantizationArgs.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RecipeError(f"{owner}: {where}.{loc}: {first['msg']}") from None


def _check_supported(owner: str, group: str, scheme: QuantizationScheme) -> None:
    w, a = scheme.weights, scheme.input_activations
    if w is None or w.type != "int" or w.num_bits not in (4, 8) or w.strategy not in ("channel", "group", "tensor"):
        raise UnsupportedError(f"{owner}: {group}: weights must be int4 or int8 with strategy channel, group or tensor")
    if w.dynamic:
        raise UnsupportedError(f"{owner}: {group}: dynamic weight quantization is not supported")
    if a is None:
        return
    dynamic_token = a.dynamic is True and a.strategy == "token"
    static_tensor = a.dynamic is False and a.strategy == "tensor"
    if a.type != "int" or a.num_bits != 8 or not a.symmetric or not (dynamic_token or static_tensor):
        raise UnsupportedError(
            f"{owner}: {group}: input activations must be int8 symmetric, dynamic per-token or static per-tensor"
        )


def _kv_args(owner: str, value: Any) -> QuantizationArgs:
    args = _args(owner, "kv_cache_scheme", value)
    if args.type != "float" or args.num_bits != 8 or args.strategy != "tensor" or args.dynamic or not args.symmetric:
        raise UnsupportedError(f"{owner}: kv_cache_scheme must be fp8 (type float, num_bits 8) static per-tensor symmetric")
    return args


def _str_list(owner: str, key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecipeError(f"{owner}: {key} must be a list of strings, got {value!r}")
    return list(value)


def parse_recipe_scheme(owner: str, args: dict[str, Any]) -> RecipeScheme | None:
    """The scheme part of a modifier's arguments; None when it declares neither weights nor KV quantization."""
    targets = _str_list(owner, "targets", args.get("targets", DEFAULT_TARGETS))
    ignore = _str_list(owner, "ignore", args.get("ignore", DEFAULT_IGNORE))
    if "scheme" in args and "config_groups" in args:
        raise RecipeError(f"{owner}: give either scheme or config_groups, not both")
    groups: dict[str, QuantizationScheme] = {}
    if "scheme" in args:
        name = args["scheme"]
        if not isinstance(name, str) or name.upper() not in SUPPORTED_PRESETS:
            raise UnsupportedError(f"{owner}: scheme {name!r} is not supported; use one of {', '.join(SUPPORTED_PRESETS)}")
        groups["group_0"] = preset_name_to_scheme(name, targets)
    for group, spec in (args.get("config_groups") or {}).items():
        if not isinstance(spec, dict) or "weights" not in spec:
            raise RecipeError(f"{owner}: config_groups.{group} must be a mapping with targets and weights")
        unknown = set(spec) - {"targets", "weights", "input_activations"}
        if unknown:
            raise RecipeError(f"{owner}: config_groups.{group}: unknown key {sorted(unknown)[0]!r}")
        groups[group] = QuantizationScheme(
            targets=_str_list(owner, f"config_groups.{group}.targets", spec.get("targets", targets)),
            weights=_args(owner, f"config_groups.{group}.weights", spec["weights"]),
            input_activations=_args(owner, f"config_groups.{group}.input_activations", spec["input_activations"])
            if spec.get("input_activations") is not None
            else None,
        )
    for group, scheme in groups.items():
        _check_supported(owner, group, scheme)
    kv = _kv_args(owner, args["kv_cache_scheme"]) if args.get("kv_cache_scheme") is not None else None
    if not groups and kv is None:
        return None
    return RecipeScheme(owner=owner, config_groups=groups, ignore=ignore, kv_cache_scheme=kv)


def _match(name: str, module: nn.Module, schemes: list[RecipeScheme]) -> tuple[RecipeScheme, QuantizationScheme] | None:
    """(recipe scheme, config group) of one module (full name): the first recipe scheme whose groups match it."""
    if ct.is_ignored(name, ALWAYS_IGNORE, module):
        return None
    for recipe_scheme in schemes:
        scheme = ct.match_scheme(name, recipe_scheme.config_groups.values(), recipe_scheme.ignore, module)
        if scheme is not None:
            return recipe_scheme, scheme
    return None


def resolve_target(name: str, module: nn.Module, schemes: list[RecipeScheme]) -> LinearTarget | None:
    """The scheme for one module (full name); None = keep."""
    match = _match(name, module, schemes)
    if match is None:
        return None
    recipe_scheme, scheme = match
    return LinearTarget(scheme.weights, scheme.input_activations, recipe_scheme)


@dataclasses.dataclass(frozen=True)
class GroupSizeFit:
    """A config group whose recipe group size does not divide every linear it quantizes (`qmath.fitted_group_size`)."""

    modifier: str
    group: str
    recipe_group_size: int
    group_size: int | None  # what the checkpoint uses; None: per channel where the recipe's does not divide
    in_features: tuple[int, ...]  # the input widths of the group's linears
    source_block_size: int | None = None  # the source checkpoint's quantization block (GGUF), if any

    def message(self) -> str:
        return f"{self.modifier} {self.group}: {group_size_fit_text(self.record())}"

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"in_features": list(self.in_features)}


def fit_group_sizes(
    schemes: list[RecipeScheme], linears: Iterable[tuple[str, nn.Module]], source_block_size: int | None = None
) -> list[GroupSizeFit]:
    """Give every grouped config group the one group size `qmath.block_aligned_group_size` picks over the linears
    (full name, module) it quantizes and the source's quantization block (`qmath.source_block_size`), in place,
    before any layer is converted: quantizers, the writer and `quantization_config` then all read it from the
    scheme. Returns the groups whose group size changed."""
    owners = {id(g): (rs, key) for rs in schemes for key, g in rs.config_groups.items()}
    widths: dict[int, set[int]] = {}
    for name, module in linears:
        match = _match(name, module, schemes)
        if match is not None and match[1].weights.strategy == "group":
            widths.setdefault(id(match[1]), set()).add(int(module.in_features))
    fits = []
    for scheme_id, seen in widths.items():
        recipe_scheme, key = owners[scheme_id]
        scheme = recipe_scheme.config_groups[key]
        recipe_size = int(scheme.weights.group_size)
        fitted = block_aligned_group_size(recipe_size, seen, source_block_size)
        if fitted == recipe_size:
            continue
        fits.append(GroupSizeFit(recipe_scheme.owner, key, recipe_size, fitted, tuple(sorted(seen)), source_block_size))
        if fitted is not None:
            weights = scheme.weights.model_copy(update={"group_size": fitted})
            recipe_scheme.config_groups[key] = scheme.model_copy(update={"weights": weights})
    return fits


def scheme_name(target: LinearTarget) -> str:
    return ct.scheme_name(target.weights, target.input_activations)


def compression_format(target: LinearTarget) -> str:
    """The on-disk format compressed-tensors itself picks for this scheme (int-quantized / pack-quantized)."""
    return ct.compression_format(target.weights, target.input_activations)

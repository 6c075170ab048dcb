"""Quantization schemes of a recipe, as compressed-tensors `QuantizationScheme`s, and which linear gets which.

A quantizing modifier's arguments (`targets`, `ignore`, `scheme` preset or `config_groups`, `kv_cache_scheme`)
are parsed into a `RecipeScheme`; matching uses compressed-tensors' own matcher so a checkpoint's
`config_groups` and `ignore` select exactly the linears that were quantized when transformers or vLLM read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from pydantic import ValidationError
from torch import nn

from ascq.core import architecture
from ascq.core.errors import AscqError, UnsupportedError
from ascq.core.qmath import block_aligned_group_size, float_zero_point
from ascq.formats import compressed_tensors as ct
from ascq.formats.manifest import group_size_fit_text
from ascq.quantize import observer
from ascq.quantize.mixed import BitsBudget, check_base_scheme, check_budget

DEFAULT_TARGETS = ["Linear"]
DEFAULT_IGNORE = list(architecture.DEFAULT_IGNORE)
ALWAYS_IGNORE = list(architecture.NEVER_QUANTIZED)
SUPPORTED_PRESETS = ("W8A8", "W4A16", "W4A16_ASYM", "W8A16", "W4A8")
# A modifier's `zp_dtype` (compressed-tensors' `QuantizationArgs.zp_dtype`, for every group it declares; a
# config group's `weights.zp_dtype` sets one group's). Unset or `int`: integer zero points at the recipe's
# group size, what vLLM's int4 kernels and compressed-tensors' packed format take (the default). The
# source-grid modes (`SOURCE_GRID`, transformers and ascq only): `float` stores float zero points in the
# checkpoint's scale dtype at the source's quantization block (GGUF) if it has one, which reproduces a source
# with float block minima (Q4_1) exactly; `auto` does so only for such a source, else keeps integers. A float
# dtype stores unrounded zero points at the recipe's group size.
SOURCE_GRID = ("auto", "float")
# the modifier arguments of a bits budget (`ascq.quantize.mixed`): mean stored bits per weight over the
# linears of the modifier's one int4 group scheme, and the schemes a linear may get (default: every one of
# mixed.CANDIDATES)
# `lm_head: int8`: the LM head quantized int8 per output channel, symmetric (an untied copy when the embedding
# is tied: `pipeline.quantized_head`)
BUDGET_ARGS = {"bits_per_weight": (float, int), "mixed_schemes": list, "lm_head": str}
LM_HEAD_SCHEMES = {
    "int8": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
}
ZP_DTYPES = {
    "auto": None,
    "float": None,
    "int": torch.int8,
    "int8": torch.int8,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class RecipeError(AscqError):
    """A recipe that cannot be parsed or validated."""


@dataclasses.dataclass
class RecipeScheme:
    owner: str  # the modifier that declared it (and quantizes its linears)
    config_groups: dict[str, QuantizationScheme]
    ignore: list[str]
    kv_cache_scheme: QuantizationArgs | None = None
    source_grid: dict[str, str] = dataclasses.field(default_factory=dict)  # config group -> SOURCE_GRID mode
    # a bits budget: the pipeline replaces the one config group by one group per chosen scheme
    # (`mixed.mixed_config_groups`) before the layer loop
    budget: BitsBudget | None = None
    lm_head: QuantizationArgs | None = None  # the LM head's weights (`LM_HEAD_SCHEMES`); None: kept

    def set_budget(self, budget: BitsBudget) -> None:
        """Vary this scheme's one config group (weight-only int4 per group) under `budget`."""
        if len(self.config_groups) != 1:
            raise RecipeError(f"{self.owner}: bits_per_weight needs exactly one config group (a scheme)")
        check_base_scheme(self.owner, next(iter(self.config_groups.values())))
        if self.source_grid:
            raise UnsupportedError(
                f"{self.owner}: bits_per_weight and zp_dtype {set(self.source_grid)} do not combine"
            )
        self.budget = budget


@dataclasses.dataclass
class LinearTarget:
    weights: QuantizationArgs
    input_activations: QuantizationArgs | None
    owner: RecipeScheme  # the quantizing modifier's scheme; `owner.owner` is the modifier's name

    @property
    def scheme(self) -> QuantizationScheme:
        return QuantizationScheme(
            targets=["Linear"], weights=self.weights, input_activations=self.input_activations
        )


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
    if (
        w is None
        or w.type != "int"
        or w.num_bits not in (4, 8)
        or w.strategy not in ("channel", "group", "tensor")
    ):
        raise UnsupportedError(
            f"{owner}: {group}: weights must be int4 or int8 with strategy channel, group or tensor"
        )
    if w.dynamic:
        raise UnsupportedError(f"{owner}: {group}: dynamic weight quantization is not supported")
    if w.observer is not None and w.observer not in observer.WEIGHT_OBSERVERS:
        raise UnsupportedError(
            f"{owner}: {group}: weight observer {w.observer!r} is not supported; use one of "
            f"{', '.join(observer.WEIGHT_OBSERVERS)}"
        )
    options = set(observer.MSE_DEFAULTS) if w.observer == "mse" else set()  # the min-max observers take none
    unknown = set(w.observer_kwargs or {}) - options
    if unknown:
        raise UnsupportedError(
            f"{owner}: {group}: observer_kwargs {sorted(unknown)[0]!r} is not supported for "
            f"observer {w.observer!r}"
        )
    if "zp_dtype" in w.model_fields_set:
        _check_zp_dtype(owner, group, scheme)
    if a is None:
        return
    dynamic_token = a.dynamic is True and a.strategy == "token"
    static_tensor = a.dynamic is False and a.strategy == "tensor"
    if a.type != "int" or a.num_bits != 8 or not a.symmetric or not (dynamic_token or static_tensor):
        raise UnsupportedError(
            f"{owner}: {group}: input activations must be int8 symmetric, dynamic per-token or static "
            f"per-tensor"
        )


def _check_zp_dtype(owner: str, group: str, scheme: QuantizationScheme) -> None:
    w = scheme.weights
    if w.zp_dtype not in ZP_DTYPES.values():
        raise UnsupportedError(
            f"{owner}: {group}: zp_dtype {_dtype_name(w.zp_dtype)} is not supported; use one of "
            f"{', '.join(ZP_DTYPES)}"
        )
    if not w.zp_dtype.is_floating_point:
        return
    if w.symmetric:
        raise UnsupportedError(
            f"{owner}: {group}: zp_dtype {_dtype_name(w.zp_dtype)} needs asymmetric weights "
            "(symmetric: false, e.g. scheme W4A16_ASYM); symmetric weights have no zero point"
        )
    if scheme.input_activations is not None or w.strategy != "group":
        raise UnsupportedError(
            f"{owner}: {group}: float zero points (zp_dtype {_dtype_name(w.zp_dtype)}) are "
            "supported for weight-only group schemes (W4A16_ASYM) only"
        )


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _with_zp_dtype(owner: str, groups: dict[str, QuantizationScheme], value: Any) -> dict[str, str]:
    """Apply a modifier's `zp_dtype` argument to every config group it declares, in place; returns the
    groups in a source-grid mode (`SOURCE_GRID`), which the planner resolves (`fit_group_sizes`)."""
    if value not in ZP_DTYPES:
        raise RecipeError(f"{owner}: zp_dtype {value!r} is not supported; use one of {', '.join(ZP_DTYPES)}")
    for group, scheme in groups.items():
        if "zp_dtype" in scheme.weights.model_fields_set:
            raise RecipeError(
                f"{owner}: give zp_dtype either as the modifier's argument or in "
                f"config_groups.{group}.weights, not both"
            )
        dtype = ZP_DTYPES[value] or torch.bfloat16  # `float` is checked as a float dtype
        if value != "auto":
            _check_zp_dtype(owner, group, scheme.model_copy(update={"weights": _zp(scheme.weights, dtype)}))
        if value not in SOURCE_GRID:
            groups[group] = scheme.model_copy(update={"weights": _zp(scheme.weights, dtype)})
    return dict.fromkeys(groups, value) if value in SOURCE_GRID else {}


def _zp(weights: QuantizationArgs, dtype: torch.dtype) -> QuantizationArgs:
    return weights.model_copy(update={"zp_dtype": dtype})


def _kv_args(owner: str, value: Any) -> QuantizationArgs:
    args = _args(owner, "kv_cache_scheme", value)
    if (
        args.type != "float"
        or args.num_bits != 8
        or args.strategy != "tensor"
        or args.dynamic
        or not args.symmetric
    ):
        raise UnsupportedError(
            f"{owner}: kv_cache_scheme must be fp8 (type float, num_bits 8) static per-tensor symmetric"
        )
    return args


def _str_list(owner: str, key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecipeError(f"{owner}: {key} must be a list of strings, got {value!r}")
    return list(value)


def parse_recipe_scheme(owner: str, args: dict[str, Any]) -> RecipeScheme | None:
    """The scheme part of a modifier's arguments; None when it declares neither weights nor KV
    quantization."""
    targets = _str_list(owner, "targets", args.get("targets", DEFAULT_TARGETS))
    ignore = _str_list(owner, "ignore", args.get("ignore", DEFAULT_IGNORE))
    if "scheme" in args and "config_groups" in args:
        raise RecipeError(f"{owner}: give either scheme or config_groups, not both")
    groups: dict[str, QuantizationScheme] = {}
    if "scheme" in args:
        name = args["scheme"]
        if not isinstance(name, str) or name.upper() not in SUPPORTED_PRESETS:
            raise UnsupportedError(
                f"{owner}: scheme {name!r} is not supported; use one of {', '.join(SUPPORTED_PRESETS)}"
            )
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
            input_activations=_args(
                owner, f"config_groups.{group}.input_activations", spec["input_activations"]
            )
            if spec.get("input_activations") is not None
            else None,
        )
    if args.get("zp_dtype") is not None:
        if not groups:
            raise RecipeError(f"{owner}: zp_dtype needs a scheme or config_groups")
        source_grid = _with_zp_dtype(owner, groups, args["zp_dtype"])
    else:
        source_grid = {}
    for group, scheme in groups.items():
        _check_supported(owner, group, scheme)
    kv = _kv_args(owner, args["kv_cache_scheme"]) if args.get("kv_cache_scheme") is not None else None
    if not groups and kv is None:
        return None
    scheme = RecipeScheme(owner, groups, ignore, kv, source_grid)
    if args.get("bits_per_weight") is not None:
        scheme.set_budget(check_budget(owner, args["bits_per_weight"], args.get("mixed_schemes")))
    elif args.get("mixed_schemes") is not None:
        raise RecipeError(f"{owner}: mixed_schemes needs bits_per_weight")
    if args.get("lm_head") is not None:
        if args["lm_head"] not in LM_HEAD_SCHEMES or not groups:
            raise UnsupportedError(
                f"{owner}: lm_head {args['lm_head']!r}: use one of {', '.join(LM_HEAD_SCHEMES)} beside a "
                "weight scheme"
            )
        scheme.lm_head = LM_HEAD_SCHEMES[args["lm_head"]]
    return scheme


def _match(
    name: str, module: nn.Module, schemes: list[RecipeScheme]
) -> tuple[RecipeScheme, QuantizationScheme] | None:
    """(recipe scheme, config group) of one module (full name): the first recipe scheme whose groups match
    it."""
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
    """A config group whose recipe group size does not divide every linear it quantizes
    (`qmath.fitted_group_size`), or follows the source's quantization blocks, or whose zero points are floats
    (`zp_dtype`)."""

    modifier: str
    group: str
    recipe_group_size: int
    group_size: int | None  # what the checkpoint uses; None: per channel where the recipe's does not divide
    in_features: tuple[int, ...]  # the input widths of the group's linears
    source_block_size: int | None = None  # the source checkpoint's quantization block (GGUF), if any
    zp_dtype: str | None = None  # float zero points' dtype ("bfloat16"); None: integer zero points
    zp_dtype_from: str | None = (
        None  # "source" (planner: float block minima) or "recipe" (the recipe's zp_dtype)
    )

    def message(self) -> str:
        return f"{self.modifier} {self.group}: {group_size_fit_text(self.record())}"

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"in_features": list(self.in_features)}


def _planned_zp_dtype(
    mode: str | None,
    weights: QuantizationArgs,
    activations: QuantizationArgs | None,
    group_size: int | None,
    source_block_size: int | None,
    source_float_min: bool,
    scale_dtype: torch.dtype,
) -> torch.dtype | None:
    """The float zero-point dtype the planner picks for a group in a source-grid mode (`SOURCE_GRID`; None:
    int). `float`: the checkpoint's scale dtype. `auto`: that dtype when the source's blocks have float
    minima and the group is one source block, the only case where it keeps the source's grid exactly (an
    int zero point moves every block by up to half a step)."""
    if mode == "float":
        return scale_dtype
    if mode != "auto" or not source_float_min:
        return None
    if weights.symmetric or activations is not None or weights.type != "int":
        return None
    return scale_dtype if group_size is not None and group_size == source_block_size else None


def fit_group_sizes(
    schemes: list[RecipeScheme],
    linears: Iterable[tuple[str, nn.Module]],
    source_block_size: int | None = None,
    source_float_min: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> list[GroupSizeFit]:
    """Give every grouped config group one group size over the linears (full name, module) it quantizes, in
    place, before any layer is converted: quantizers, the writer and `quantization_config` then all read it
    from the scheme. By default the recipe's (`qmath.fitted_group_size` where a width forces otherwise) with
    integer zero points, what vLLM's packed int4 path reads; a group in a source-grid mode (`SOURCE_GRID`)
    follows the source's quantization block (`qmath.block_aligned_group_size`, `qmath.source_block_size`) and
    gets float zero points (`_planned_zp_dtype`). Returns the groups whose group size changed or whose zero
    points are floats."""
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
        mode = recipe_scheme.source_grid.get(key)
        fitted = block_aligned_group_size(recipe_size, seen, source_block_size if mode else None)
        update: dict[str, Any] = {} if fitted in (None, recipe_size) else {"group_size": fitted}
        zp_from = "recipe" if float_zero_point(scheme.weights) else None
        if mode is not None:
            planned = _planned_zp_dtype(
                mode,
                scheme.weights,
                scheme.input_activations,
                fitted,
                source_block_size,
                source_float_min,
                scale_dtype,
            )
            if planned is not None:
                on_source_blocks = source_float_min and fitted is not None and fitted == source_block_size
                update["zp_dtype"], zp_from = planned, "source" if on_source_blocks else "recipe"
        if fitted is None and zp_from is not None:
            raise UnsupportedError(
                f"{recipe_scheme.owner} {key}: float zero points need a group size that divides "
                f"every input width ({', '.join(map(str, sorted(seen)))})"
            )
        if fitted == recipe_size and zp_from is None:
            continue
        weights = scheme.weights.model_copy(update=update)
        zp_name = _dtype_name(weights.zp_dtype) if zp_from else None
        fits.append(
            GroupSizeFit(
                recipe_scheme.owner,
                key,
                recipe_size,
                fitted,
                tuple(sorted(seen)),
                source_block_size,
                zp_name,
                zp_from,
            )
        )
        if update:
            recipe_scheme.config_groups[key] = scheme.model_copy(update={"weights": weights})
    return fits


def scheme_name(target: LinearTarget) -> str:
    return ct.scheme_name(target.weights, target.input_activations)


def compression_format(target: LinearTarget) -> str:
    """The on-disk format compressed-tensors itself picks for this scheme (int-quantized / pack-quantized)."""
    return ct.compression_format(target.weights, target.input_activations)

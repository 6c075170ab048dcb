"""The modifier contract: one recipe entry (`SmoothQuantModifier`, `QuantizationModifier`, ...) acting per layer.

See docs/ARCHITECTURE.md "Converter pipeline". Modifiers are registered by name in `ascq/quantize/registry.py`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ascq.quantize.schemes import RecipeError, RecipeScheme

if TYPE_CHECKING:
    from ascq.quantize.layer_context import LayerContext


@dataclasses.dataclass
class QuantizedLinear:
    """A linear's integer weights in the signed convention, plus its scales as they are written."""

    q: torch.Tensor  # int8 [out, in], int4 values in [-8, 7]
    scale: torch.Tensor  # [1], [out, 1] or [out, in // group_size], checkpoint scale dtype
    zero_point: torch.Tensor | None = None  # int8, same shape as scale; None when symmetric
    input_scale: torch.Tensor | None = None  # [1] for static per-tensor activations

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.ndim != 2:
            raise ValueError(f"QuantizedLinear.q must be a 2-D int8 tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        if self.zero_point is not None and self.zero_point.shape != self.scale.shape:
            raise ValueError("QuantizedLinear.zero_point must have the shape of scale")


class Modifier:
    name: ClassVar[str] = ""

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> Modifier:
        raise NotImplementedError

    def quant_scheme(self) -> RecipeScheme | None:
        """The weight/KV scheme this modifier quantizes with, or None for pure weight transforms."""
        return None

    def process_layer(self, ctx: LayerContext) -> None:
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        return {}


def check_args(owner: str, args: Any, allowed: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """`args` as a dict whose keys are in `allowed` and values of the allowed types (RecipeError otherwise)."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise RecipeError(f"{owner}: arguments must be a mapping, got {type(args).__name__}")
    for key, value in args.items():
        if key not in allowed:
            raise RecipeError(f"{owner}: unknown argument {key!r} (known: {', '.join(sorted(allowed))})")
        types = allowed[key]
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types))):
            names = "/".join(t.__name__ for t in _tuple(types))
            raise RecipeError(f"{owner}: argument {key} must be {names}, got {value!r}")
    return dict(args)


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)

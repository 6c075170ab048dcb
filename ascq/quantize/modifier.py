"""The modifier contract: one recipe entry (`SmoothQuantModifier`, `QuantizationModifier`, ...) acting per
layer.

See docs/ARCHITECTURE.md "Converter pipeline". Modifiers are registered by name in
`ascq/quantize/registry.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ascq.formats import QuantizedLinear
from ascq.quantize.schemes import RecipeError, RecipeScheme

__all__ = ["Modifier", "QuantizedLinear", "check_args"]

if TYPE_CHECKING:
    from ascq.quantize.layer_context import LayerContext


class Modifier:
    name: ClassVar[str] = ""
    # True: calibrated one residual block at a time, the MLP block on the quantized attention block's output
    # (`pipeline.convert_layer`); False: on the whole full-precision layer, as llm-compressor does
    per_block: ClassVar[bool] = True
    # True: measured to keep its quality with bf16 products in the layer's forwards, so `--calibration-dtype
    # auto` uses them where they are fast (`pipeline.calibration_gemm_dtype`)
    calibrates_in_bf16: ClassVar[bool] = False

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
    """`args` as a dict whose keys are in `allowed` and values of the allowed types (RecipeError
    otherwise)."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise RecipeError(f"{owner}: arguments must be a mapping, got {type(args).__name__}")
    for key, value in args.items():
        if key not in allowed:
            raise RecipeError(f"{owner}: unknown argument {key!r} (known: {', '.join(sorted(allowed))})")
        types = allowed[key]
        if value is not None and (
            not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types))
        ):
            names = "/".join(t.__name__ for t in _tuple(types))
            raise RecipeError(f"{owner}: argument {key} must be {names}, got {value!r}")
    return dict(args)


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)

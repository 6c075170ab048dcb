"""`QuantizationModifier`: round-to-nearest weights, calibrated static activation scales, fp8 KV-cache scales.

It quantizes every target linear it owns that no earlier modifier (e.g. GPTQ) has already quantized. Static
per-tensor input scales and the KV scales come from the maxima observed over all calibration tokens, with the
layer's weights as the earlier modifiers left them (smoothed, full precision).
"""

from __future__ import annotations

from typing import Any

import torch

from ascq.core import qmath
from ascq.quantize import observer
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.modifier import Modifier, QuantizedLinear, check_args
from ascq.quantize.schemes import BUDGET_ARGS, RecipeError, RecipeScheme, parse_recipe_scheme

ARGS = {
    "targets": list,
    "ignore": list,
    "scheme": str,
    "config_groups": dict,
    "kv_cache_scheme": dict,
    "zp_dtype": str,
    **BUDGET_ARGS,
}


class QuantizationModifier(Modifier):
    name = "QuantizationModifier"

    def __init__(self, scheme: RecipeScheme) -> None:
        self.scheme = scheme
        self.num_quantized = 0

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> QuantizationModifier:
        scheme = parse_recipe_scheme(cls.name, check_args(cls.name, args, ARGS))
        if scheme is None:
            raise RecipeError(f"{cls.name}: needs a scheme, config_groups or kv_cache_scheme")
        return cls(scheme)

    def quant_scheme(self) -> RecipeScheme:
        return self.scheme

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        owned = [n for n, t in ctx.targets.items() if t.owner is self.scheme and n not in ctx.results]
        static = [
            n
            for n in owned
            if ctx.targets[n].input_activations is not None and not ctx.targets[n].input_activations.dynamic
        ]
        input_max = ctx.input_absmax(static) if static else {}
        for name in owned:
            target = ctx.targets[name]
            q, scale, zero_point = observer.quantize_weight(
                ctx.module(name).weight, target.weights, ctx.scale_dtype
            )
            input_scale = None
            if name in input_max:
                input_scale = qmath.static_scale(input_max[name].max(), 8, ctx.scale_dtype)
            ctx.results[name] = QuantizedLinear(q, scale, zero_point, input_scale)
            self.num_quantized += 1
        if self.scheme.kv_cache_scheme is not None and ctx.in_block("self_attn"):
            ctx.extra_tensors.update(kv_scales(ctx))

    def summary(self) -> dict[str, Any]:
        return {"num_quantized_linears": self.num_quantized}


def kv_scales(ctx: LayerContext) -> dict[str, torch.Tensor]:
    """`self_attn.k_scale` / `v_scale` [1]: fp8 e4m3 scales from the post-RoPE key/value maxima."""
    maxima = {"k": torch.zeros(()), "v": torch.zeros(())}

    def observe(key: torch.Tensor, value: torch.Tensor):
        maxima["k"] = torch.maximum(maxima["k"], key.detach().abs().max().float().cpu())
        maxima["v"] = torch.maximum(maxima["v"], value.detach().abs().max().float().cpu())
        return key, value

    ctx.run(kv_hook=observe)
    return {f"self_attn.{kv}_scale": qmath.fp8_scale(maxima[kv], ctx.scale_dtype) for kv in ("k", "v")}

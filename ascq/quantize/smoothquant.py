"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights before int8 quantization.

Per input channel j of the linears reading a norm's output: `s_j = max|x_j|^α / max|W_:,j|^(1-α)`; the norm
weight is divided by s and the linears' columns multiplied by it, so the layer computes the same function in
full precision. `max|W|` is taken over the linears that will be quantized; linears that stay full precision
but read the same norm (the MoE router) are rescaled too, with the scales rounded to powers of two so their
outputs are unchanged bit for bit. Default mappings: the architecture's (`architectures.balance_groups`) whose
smooth layer is a norm.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ascq.quantize.awq import power_of_two
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.modifier import Modifier, check_args
from ascq.quantize.schemes import RecipeError

MIN_SCALE = 1e-5


class SmoothQuantModifier(Modifier):
    name = "SmoothQuantModifier"

    def __init__(
        self, smoothing_strength: float = 0.8, mappings: list[tuple[list[str], str]] | None = None
    ) -> None:
        if not 0.0 < smoothing_strength < 1.0:
            raise RecipeError(f"{self.name}: smoothing_strength must be in (0, 1), got {smoothing_strength}")
        self.smoothing_strength = float(smoothing_strength)
        self.mappings = mappings
        self.num_smoothed = 0

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> SmoothQuantModifier:
        args = check_args(
            cls.name, args, {"smoothing_strength": (float, int), "mappings": list, "ignore": list}
        )
        mappings = args.get("mappings")
        if mappings is not None and not all(
            isinstance(m, list) and len(m) == 2 and isinstance(m[1], str) and isinstance(m[0], list)
            for m in mappings
        ):
            raise RecipeError(f"{cls.name}: mappings must be a list of [[linear regexes...], norm regex]")
        return cls(args.get("smoothing_strength", 0.8), mappings)

    def layer_mappings(self, ctx: LayerContext) -> list[tuple[str, list[str]]]:
        """(norm, every linear reading it) per mapping; the quantized ones set the scales, all are
        rescaled."""
        if self.mappings is None:
            norms = [g for g in ctx.balance_groups() if not isinstance(ctx.module(g.smooth_layer), nn.Linear)]
            return [(g.smooth_layer, [*g.balance_layers, *g.exact_layers]) for g in norms]
        names = [n for n, _ in ctx.layer.named_modules() if n]
        resolved = []
        for linear_patterns, norm_pattern in self.mappings:
            norms = [n for n in names if _matches(norm_pattern, n)]
            linears = [n for n in names if any(_matches(p, n) for p in linear_patterns)]
            if len(norms) != 1 or not linears:
                raise RecipeError(
                    f"{self.name}: mapping {norm_pattern!r} matches {len(norms)} norms and {len(linears)} "
                    f"linears in layer {ctx.index}"
                )
            if not ctx.in_block(norms[0]):
                continue
            if not all(ctx.in_block(n) for n in linears):
                raise RecipeError(
                    f"{self.name}: mapping {norm_pattern!r}: its linears must read the norm's output in the "
                    f"same residual block"
                )
            resolved.append((norms[0], linears))
        return resolved

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        mappings = [
            (norm, linears)
            for norm, linears in self.layer_mappings(ctx)
            if any(n in ctx.targets for n in linears)
        ]
        if not mappings:
            return
        act_max = _norm_output_absmax(ctx, [norm for norm, _ in mappings])
        for norm, linears in mappings:
            quantized = [ctx.module(n).weight for n in linears if n in ctx.targets]
            weight_max = (
                torch.stack([w.abs().amax(dim=0) for w in quantized]).amax(dim=0).clamp(min=MIN_SCALE)
            )
            alpha = self.smoothing_strength
            scales = act_max[norm].pow(alpha) / weight_max.pow(1 - alpha)
            scales = torch.where(act_max[norm] > 0, scales, torch.ones_like(scales)).clamp(min=MIN_SCALE)
            if len(quantized) < len(linears):  # a full-precision reader (the router): compensate it exactly
                scales = power_of_two(scales)
            offset = getattr(ctx.module(norm), "weight_offset", 0.0)  # Gemma: (1 + weight)
            ctx.module(norm).weight.add_(offset).div_(scales).sub_(offset)
            for name in linears:
                ctx.module(name).weight.mul_(scales)
            self.num_smoothed += 1

    def summary(self) -> dict[str, Any]:
        return {"smoothing_strength": self.smoothing_strength, "num_smoothed_groups": self.num_smoothed}


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None or re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _norm_output_absmax(ctx: LayerContext, norms: list[str]) -> dict[str, torch.Tensor]:
    maxima: dict[str, torch.Tensor] = {}

    def observe(name: str):
        def hook(module, args, output) -> None:
            channel_max = output.detach().abs().reshape(-1, output.shape[-1]).amax(dim=0).float()
            maxima[name] = torch.maximum(maxima[name], channel_max) if name in maxima else channel_max

        return hook

    ctx.observe({name: observe(name) for name in norms})
    return maxima

"""`GPTQModifier`: GPTQ for every target linear of a decoder layer (it owns the weight scheme it declares).

Hessians come from the calibration inputs each linear sees in this layer (routed tokens for experts; experts
with fewer than `min_expert_tokens` routed tokens use all tokens passed through them densely, see
`moe_coverage`). A layer whose H cannot be factorised falls back to round-to-nearest with a warning naming it.

Recipe (llm-compressor's shape):
`GPTQModifier: {scheme: W4A16_ASYM, ignore: [...], block_size: 128, dampening_frac: 0.01, actorder: static}`.

`weighted_mse: true` (ascq's; needs `observer: mse` weights): the MSE observer weights each column's error by
the column's diag(H), the mean square of its input (GPTQ's own loss (w - q)ᵀ H (w - q) without H's
off-diagonal terms, the importance weighting of llama.cpp's imatrix quantization). On SmolLM2 (fp32 source, 16
x 512 calibration tokens, GPL-3 perplexity) it scored 32.65 and 32.38 (two calibration GEMM dtypes) where the
unweighted observer scored 36.97 and 37.00 with the same code, and 34.78 / 35.70 before a last-bit change in
its error sums (GPTQ's spread: docs/benchmarks.md "Converter against llm-compressor").
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs

from ascq.core import qmath
from ascq.quantize import observer
from ascq.quantize.gptq import CholeskyError, GPTQConfig, GramCache, HessianAccumulator, gptq_quantize
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.modifier import Modifier, QuantizedLinear, check_args
from ascq.quantize.moe_coverage import DEFAULT_MIN_TOKENS, CoverageLog, dense_mlp_inputs
from ascq.quantize.reference_forward import activation_pre_hook, set_dequantized_weight
from ascq.quantize.schemes import BUDGET_ARGS, LinearTarget, RecipeError, RecipeScheme, parse_recipe_scheme

log = logging.getLogger(__name__)
ARGS = {
    "targets": list,
    "ignore": list,
    "scheme": str,
    "config_groups": dict,
    "block_size": int,
    "dampening_frac": (float, int),
    "actorder": (str, bool),
    "min_expert_tokens": int,
    "zp_dtype": str,
    "weighted_mse": bool,
    **BUDGET_ARGS,
}
# "static" (a.k.a. "weight") keeps contiguous groups; "group"/"dynamic" would need a g_idx in the checkpoint
ACTORDER = {None: False, False: False, "static": True, "weight": True}


class GPTQModifier(Modifier):
    name = "GPTQModifier"
    per_block = False  # see pipeline.convert_layer
    # bf16 products only round the propagated activations (Hessians stay fp32): on SmolLM2 (fp32 source, 16 x
    # 512, weighted_mse) 32.04 / 32.40 / 32.52 with bf16 products, 32.65 / 33.31 with fp32 (GPTQ's rounding
    # spread)
    calibrates_in_bf16 = True

    def __init__(
        self,
        scheme: RecipeScheme,
        block_size: int,
        dampening_frac: float,
        actorder: bool,
        min_expert_tokens: int,
        weighted_mse: bool = False,
    ) -> None:
        self.scheme = scheme
        self.weighted_mse = weighted_mse
        if weighted_mse and any(
            g.weights is None or g.weights.observer != "mse" for g in scheme.config_groups.values()
        ):
            raise RecipeError(
                f"{self.name}: weighted_mse weights the mse observer's error; give every config group's "
                "weights observer: mse"
            )
        self.block_size = block_size
        self.dampening_frac = dampening_frac
        self.actorder = actorder
        self.coverage = CoverageLog(self.name, min_expert_tokens)
        self.num_quantized = 0
        self.fallbacks: list[str] = []
        self._config(None)  # validate

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> GPTQModifier:
        args = check_args(cls.name, args, ARGS)
        scheme = parse_recipe_scheme(cls.name, args)
        if scheme is None or not scheme.config_groups:
            raise RecipeError(f"{cls.name}: needs a scheme or config_groups")
        actorder = args.get("actorder")
        if actorder not in ACTORDER:
            raise RecipeError(f"{cls.name}: actorder must be static (or weight) or null, got {actorder!r}")
        return cls(
            scheme,
            args.get("block_size", 128),
            float(args.get("dampening_frac", 0.01)),
            ACTORDER[actorder],
            args.get("min_expert_tokens", DEFAULT_MIN_TOKENS),
            args.get("weighted_mse", False),
        )

    def quant_scheme(self) -> RecipeScheme:
        return self.scheme

    def _config(self, args: QuantizationArgs | None) -> GPTQConfig:
        group = args.group_size if args is not None and args.strategy == "group" else None
        try:
            return GPTQConfig(
                num_bits=args.num_bits if args is not None else 4,
                group_size=group,
                block_size=self.block_size,
                dampening_frac=self.dampening_frac,
                actorder=self.actorder,
                float_zero_point=args is not None and qmath.float_zero_point(args),
            )
        except ValueError as exc:
            raise RecipeError(f"{self.name}: {exc}") from None

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        owned = [n for n, t in ctx.targets.items() if t.owner is self.scheme and n not in ctx.results]
        if not owned:
            return
        experts = ctx.expert_names()
        if ctx.propagate_in_place and not experts and all(_dynamic_or_none(ctx.targets[n]) for n in owned):
            self._sequential(ctx, owned)
            return
        cache = GramCache()  # linears reading the same input share its x xᵀ
        hessians = {n: HessianAccumulator(ctx.module(n).weight.shape[1], cache) for n in owned}
        capture = ["mlp"] if experts else []
        cap = ctx.capture_inputs([*owned, *capture], {n: h.add for n, h in hessians.items()})
        if experts:
            counts = {
                e: hessians[f"{e}.up_proj"].num_tokens if f"{e}.up_proj" in hessians else 0 for e in experts
            }
            coverage = self.coverage.layer(ctx.prefix, counts)
            for expert in experts:
                if coverage.needs_dense(expert):
                    self._dense_hessians(ctx, expert, cap.inputs("mlp"), hessians)
            ctx.report["expert_coverage"] = coverage.report()
        for names in _same_hessian(ctx, owned, hessians):
            self._quantize_group(ctx, names, hessians[names[0]].hessian)

    def _sequential(self, ctx: LayerContext, owned: list[str]) -> None:
        """One pass of the whole layer over all calibration tokens at once: each linear is GPTQ-quantized when
        its input arrives (with the linears that read the same input: q/k/v, gate/up) and computes its output
        with the quantized weights, so the layer's output is already the next layer's input (GPTQ's "true
        sequential" order: o_proj's H comes from the quantized q/k/v, down_proj's from the quantized gate/up).
        Costs one layer forward instead of a calibration forward plus a propagation forward."""
        siblings = {n: [n] for n in owned}
        for group in ctx.balance_groups():
            # a norm: its readers share one input
            if not isinstance(ctx.module(group.smooth_layer), torch.nn.Linear):
                names = [n for n in group.balance_layers if n in siblings]
                siblings.update({n: names for n in names})

        shared: dict = {}  # linears reading one input fake-quantize it once (`activation_pre_hook`)

        def pre_hook(name: str):
            def hook(module: torch.nn.Module, args: tuple) -> tuple | None:
                if name not in ctx.results:
                    hessian = HessianAccumulator(module.weight.shape[1])
                    hessian.add(args[0])
                    names = [n for n in siblings[name] if n not in ctx.results]
                    self._quantize_group(ctx, names, hessian.hessian)
                    for n in names:
                        set_dequantized_weight(ctx.module(n), ctx.targets[n], ctx.results[n])
                activations = ctx.targets[name].input_activations
                return (
                    None
                    if activations is None
                    else activation_pre_hook(activations, None, shared)(module, args)
                )

            return hook

        handles = [ctx.module(n).register_forward_pre_hook(pre_hook(n)) for n in owned]
        try:
            x = torch.cat(ctx.inputs)
            out = ctx.arch.forward_block(ctx.layer, None, x, ctx.position_ids(x.shape[1]))
        finally:
            for handle in handles:
                handle.remove()
        missing = sorted(set(owned) - set(ctx.results))
        if missing:
            raise RuntimeError(f"GPTQ: {ctx.prefix}{missing[0]} was not called in the layer's forward")
        ctx.propagated = list(out.split([x.shape[0] for x in ctx.inputs]))

    def _dense_hessians(
        self, ctx: LayerContext, expert: str, block_inputs: list[torch.Tensor], hessians: dict
    ) -> None:
        for proj, inputs in dense_mlp_inputs(ctx.module(expert), block_inputs).items():
            name = f"{expert}.{proj}"
            if name in hessians:
                hessians[name] = HessianAccumulator(ctx.module(name).weight.shape[1])
                for x in inputs:
                    hessians[name].add(x)

    def _quantize_group(self, ctx: LayerContext, names: list[str], hessian: torch.Tensor) -> None:
        """GPTQ of linears that share one H and one weight scheme, as one stacked weight: its rows are solved
        independently, so this is each linear's own GPTQ in one column loop instead of several."""
        args = ctx.targets[names[0]].weights
        weights = [ctx.module(n).weight for n in names]
        try:
            deq, scale, zero = gptq_quantize(
                torch.cat(weights),
                hessian,
                _qparams(args, ctx.scale_dtype, self.weighted_mse),
                qmath.int_range(args.num_bits),
                self._config(args),
            )
        except CholeskyError as exc:
            for name, weight in zip(names, weights, strict=True):
                message = f"GPTQ: {ctx.prefix}{name}: {exc}; falling back to round-to-nearest for this layer"
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                log.warning(message)
                self.fallbacks.append(f"{ctx.prefix}{name}")
                ctx.report.setdefault("gptq_rtn_fallback", []).append(name)
                q, scale, zero_point = observer.quantize_weight(weight, args, ctx.scale_dtype)
                ctx.results[name] = QuantizedLinear(q, scale, zero_point)
            self.num_quantized += len(names)
            return
        rows = [w.shape[0] for w in weights]
        for name, d, s, z in zip(names, deq.split(rows), scale.split(rows), zero.split(rows), strict=True):
            s = s.to(ctx.scale_dtype)
            zero_point = None if args.symmetric else z.to(qmath.zero_point_dtype(args) or torch.int8)
            ctx.results[name] = QuantizedLinear(
                qmath.quantize_with_qparams(d, s, zero_point, args), s, zero_point
            )
        self.num_quantized += len(names)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_quantized_linears": self.num_quantized,
            "actorder": "static" if self.actorder else None,
        }
        out["rtn_fallbacks"] = self.fallbacks
        if self.coverage.blocks:
            out["expert_coverage"] = self.coverage.blocks
        return out


def _dynamic_or_none(target: LinearTarget) -> bool:
    """Activations the sequential pass can fake-quantize itself (static ones need a calibrated
    input_scale)."""
    return target.input_activations is None or bool(target.input_activations.dynamic)


def _same_hessian(
    ctx: LayerContext, names: list[str], hessians: dict[str, HessianAccumulator]
) -> list[list[str]]:
    """`names` grouped by equal H and equal weight scheme (linears that read the same input), in order."""
    groups: list[list[str]] = []
    for name in names:
        for group in groups:
            first = group[0]
            if ctx.targets[first].weights == ctx.targets[name].weights and torch.equal(
                hessians[first].hessian, hessians[name].hessian
            ):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def _qparams(args: QuantizationArgs, scale_dtype: torch.dtype, weighted_mse: bool):
    """(scale, zero) [rows, groups] of weight groups [rows, groups, group_len], rounded to the checkpoint's
    scale dtype as the writer will; with `weighted_mse`, the observer's error weighted by the columns'
    importance."""

    def qparams(w: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = observer.weight_ranges(w, args, scale_dtype, importance if weighted_mse else None)
        scale, zero = qmath.compute_qparams(
            low, high, args.num_bits, args.symmetric, scale_dtype, qmath.zero_point_dtype(args)
        )
        return scale.float(), zero.float()

    return qparams

"""`AWQModifier`: AWQ scale search + clip search per decoder layer, then (with a scheme) round-to-nearest.

Balance groups: the family's mappings (`families.base.LLAMA_MAPPINGS`, `families.deepseek.MOE_MAPPINGS`), in
order (AutoAWQ's, with MoE handled as one group per norm); each group's scales are judged on its block's
output:
- input_layernorm -> q, k, v (judged on the attention output);
- v_proj -> o_proj, only when their shapes match (skipped under GQA, as AutoAWQ does);
- post_attention_layernorm -> gate/up of the MLP, or of every routed and shared expert together (judged on the
  whole MoE block output; the router reads the same norm and stays full precision, so its weight is multiplied
  by the scales too, which are then powers of two: norm and router weights are rescaled exactly in any float
  dtype and the router's logits, hence the routing, are bit for bit those of the source checkpoint);
- up_proj -> down_proj for the dense MLP, each routed expert and the shared experts.

A group whose linears are re-quantized onto the grid their source checkpoint was quantized on
(`qmath.keeps_source_grid`: a GGUF Q4_1 / K-quant import at its block size with float zero points) keeps
s = 1: round-to-nearest already gives back the source's weights and any scaling moves them off that grid (on
SmolLM2's Q4_1 import the search's one non-identity pick lowered the calibration loss and raised the held-out
perplexity); the clip search still runs there. Experts with fewer routed calibration tokens than
`min_expert_tokens` are calibrated on all tokens passed through them densely (`moe_coverage`). After the
scales, the clip search runs on every quantized linear except q/k.

Recipe (llm-compressor's shape): `AWQModifier: {scheme: W4A16_ASYM, ignore: [...], duo_scaling: true, n_grid:
20}`; ascq's own keys: `clip_search`, `max_shrink`, `clip_steps`, `min_expert_tokens`, `max_search_tokens`,
`search_loss` (`block`: each group judged on its block's output as above; `linear`: on its linears' own
outputs, see SEARCH_LOSSES), `shortlist` (with the block loss: only the K grid points best by the linears' own
outputs run the block; not for the MoE expert group, which is judged on every grid point). Without
`scheme`/`config_groups` it only transforms the weights, and a later quantizing modifier (GPTQ, RTN) owns the
targets; the search then fake-quantizes with that modifier's scheme.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ascq.core import qmath
from ascq.quantize import awq, observer
from ascq.quantize.architectures import BalanceGroup
from ascq.quantize.input_capture import replay
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.modifier import Modifier, QuantizedLinear, check_args
from ascq.quantize.moe_coverage import DEFAULT_MIN_TOKENS, CoverageLog, dense_mlp_inputs, num_tokens
from ascq.quantize.schemes import BUDGET_ARGS, RecipeError, RecipeScheme, parse_recipe_scheme

ARGS = {
    "targets": list,
    "ignore": list,
    "scheme": str,
    "config_groups": dict,
    "duo_scaling": bool,
    "n_grid": int,
    "clip_search": bool,
    "max_shrink": (float, int),
    "clip_steps": int,
    "min_expert_tokens": int,
    "max_search_tokens": int,
    "search_loss": str,
    "shortlist": int,
    "zp_dtype": str,
    **BUDGET_ARGS,
}
# what a group's α is judged on: its block's output (AutoAWQ, llm-compressor), or its linears' own outputs
# (the AWQ paper's objective; a Gram-matrix loss over every calibration token, no forward per grid point; not
# for the MoE expert group, whose experts read different routed tokens)
SEARCH_LOSSES = ("block", "linear")
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")  # AutoAWQ: clipping q/k hurts the attention scores


class AWQModifier(Modifier):
    name = "AWQModifier"
    per_block = False  # see pipeline.convert_layer

    def __init__(
        self,
        scheme: RecipeScheme | None,
        search: awq.AWQSearchConfig,
        clip_search: bool = True,
        min_expert_tokens: int = DEFAULT_MIN_TOKENS,
        linear_loss: bool = False,
    ) -> None:
        self.scheme = scheme
        self.search = search
        self.clip_search = clip_search
        self.linear_loss = linear_loss
        self.coverage = CoverageLog(self.name, min_expert_tokens)
        self.num_groups = 0

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> AWQModifier:
        args = check_args(cls.name, args, ARGS)
        try:
            search = awq.AWQSearchConfig(
                num_grid=args.get("n_grid", 20),
                duo_scaling=args.get("duo_scaling", True),
                max_shrink=float(args.get("max_shrink", 0.5)),
                num_clip_steps=args.get("clip_steps", 20),
                max_search_tokens=args.get("max_search_tokens", 4096),
                shortlist=args.get("shortlist", 0),
            )
        except ValueError as exc:
            raise RecipeError(f"{cls.name}: {exc}") from None
        scheme = parse_recipe_scheme(cls.name, args)
        loss = args.get("search_loss", "block")
        if loss not in SEARCH_LOSSES:
            raise RecipeError(
                f"{cls.name}: search_loss must be one of {', '.join(SEARCH_LOSSES)}, got {loss!r}"
            )
        if loss == "linear" and "shortlist" in args:
            raise RecipeError(
                f"{cls.name}: shortlist shortens the block loss's grid; search_loss linear has none"
            )
        return cls(
            scheme,
            search,
            args.get("clip_search", True),
            args.get("min_expert_tokens", DEFAULT_MIN_TOKENS),
            loss == "linear",
        )

    def quant_scheme(self) -> RecipeScheme | None:
        return self.scheme

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        groups = ctx.balance_groups()
        experts = ctx.expert_names()
        capture_names = list(dict.fromkeys([*(g.block for g in groups), *experts, *ctx.targets]))
        cap = ctx.capture_inputs(capture_names)
        coverage = self.coverage.layer(ctx.prefix, {e: num_tokens(cap.inputs(e)) for e in experts})
        # what each module reads, updated as scales are folded (the clip search needs the scaled inputs)
        inputs = {name: cap.inputs(name) for name in capture_names}
        for expert in (e for e in experts if coverage.needs_dense(e)):
            dense = dense_mlp_inputs(ctx.module(expert), inputs["mlp"])
            inputs.update(
                {f"{expert}.{proj}": x for proj, x in dense.items() if f"{expert}.{proj}" in inputs}
            )
        # shared by the blocks
        report: dict[str, Any] = ctx.report.setdefault("awq", {"alpha": {}, "skipped": []})
        for group in groups:
            if group.skip_reason is not None:
                report["skipped"].append(
                    f"{group.smooth_layer}->{group.balance_layers[0]} ({group.skip_reason})"
                )
                continue
            block = group.block if isinstance(ctx.module(group.block), nn.Linear) else None
            x = inputs[group.block]
            if num_tokens(x) == 0:
                report["skipped"].append(f"{group.smooth_layer}->{group.balance_layers[0]} (no tokens)")
                continue
            scales = self._balance(ctx, group, x, None if block else cap.calls[group.block], report)
            divided: dict[
                tuple, list[torch.Tensor]
            ] = {}  # linears reading the same tensors share one divided copy
            for name in group.balance_layers:
                key = tuple((t.data_ptr(), t.shape) for t in inputs[name])
                if key not in divided:
                    divided[key] = _divided(inputs[name], scales)
                inputs[name] = divided[key]

        if self.clip_search:
            self._clip(ctx, {name: inputs[name] for name in ctx.targets})
        if self.scheme is not None:
            self._quantize(ctx)
        if experts:
            report["expert_coverage"] = coverage.report()

    def _fake_quantize(self, ctx: LayerContext, name: str):
        args = ctx.targets[name].weights
        return lambda w: observer.fake_quantize_weight(w, args, ctx.scale_dtype)

    def _search_config(self, ctx: LayerContext, name: str) -> awq.AWQSearchConfig:
        args = ctx.targets[name].weights
        in_features = ctx.module(name).weight.shape[1]
        group = args.group_size if args.strategy == "group" and args.group_size else in_features
        return dataclasses.replace(
            self.search, group_size=group, identity_candidate=qmath.float_zero_point(args)
        )

    def _balance(
        self,
        ctx: LayerContext,
        group: BalanceGroup,
        x: list[torch.Tensor],
        calls: list | None,
        report: dict[str, Any],
    ) -> torch.Tensor:
        """Search and fold the scales of one balance group on its block input `x`; returns them (ones when the
        group is skipped). `calls`: the block's recorded calls (None when the block is one linear)."""
        linears = group.balance_layers
        ones = torch.ones(ctx.module(linears[0]).weight.shape[1])
        if not all(n in ctx.targets for n in linears):
            report["skipped"].append(f"{group.smooth_layer} (not every linear is quantized)")
            return ones
        # any s != 1 moves the weights off the source's grid
        if all(ctx.keeps_source_grid(n) for n in linears):
            report["skipped"].append(f"{group.smooth_layer} (weights on the source's quantization grid)")
            return ones
        modules = [ctx.module(n) for n in linears]
        block_module = ctx.module(group.block)
        budget = self.search.max_search_tokens
        gram = None
        block_output = None
        if calls is None:  # a single linear: its input rows are independent, sample them
            xs = awq.sample_tokens(_flat_cat(x), budget)
            # the loss follows from the weight change
            if modules == [block_module] and xs.shape[0] > xs.shape[1]:
                gram = xs.t() @ xs / xs.shape[0]
            else:
                block_output = lambda: block_module(xs)  # noqa: E731
        else:  # a block runs on whole calibration batches (attention needs whole sequences), at least one
            if not self.linear_loss or group.exact_layers:
                num_calls = next((i + 1 for i in range(len(x)) if num_tokens(x[: i + 1]) >= budget), len(x))
                block_output = lambda: replay(block_module, calls[:num_calls], x[:num_calls])  # noqa: E731
            if (self.linear_loss or self.search.shortlist) and not group.exact_layers:  # the linears' outputs
                flat = _flat_cat(x)
                gram = flat.t() @ flat / flat.shape[0] if flat.shape[0] >= flat.shape[1] else flat.float()
        scales, alpha, _ = awq.search_scales(
            awq.activation_mean(_flat_cat(x)),
            modules,
            block_output,
            [self._fake_quantize(ctx, n) for n in linears],
            self._search_config(ctx, linears[0]),
            exact=bool(group.exact_layers),
            gram=gram,
            rows_independent=all(ctx.targets[n].weights.strategy in ("channel", "group") for n in linears),
            minmax_grids=[
                observer.minmax_grid(m.weight, ctx.targets[n].weights, ctx.scale_dtype)
                for m, n in zip(modules, linears, strict=True)
            ],
        )
        consumers = modules + [ctx.module(n) for n in group.exact_layers]
        producer = ctx.module(group.smooth_layer)
        if isinstance(producer, nn.Linear):
            awq.fold_into_linear(producer, consumers, scales)
        else:
            awq.fold_into_norm(producer, consumers, scales)
        report["alpha"][group.smooth_layer] = alpha
        self.num_groups += 1
        return scales

    def _clip(self, ctx: LayerContext, clip_inputs: dict[str, list[torch.Tensor]]) -> None:
        for name, x in clip_inputs.items():
            if name in NO_CLIP or name not in ctx.targets or num_tokens(x) == 0:
                continue
            linear = ctx.module(name)
            config = self._search_config(ctx, name)
            rows_independent = ctx.targets[name].weights.strategy in ("channel", "group")
            max_val = awq.search_clip(
                linear.weight,
                _flat_cat(x),
                self._fake_quantize(ctx, name),
                config,
                rows_independent,
                observer.minmax_grid(linear.weight, ctx.targets[name].weights, ctx.scale_dtype),
            )
            awq.apply_clip(linear, max_val)

    def _quantize(self, ctx: LayerContext) -> None:
        for name, target in ctx.targets.items():
            if target.owner is self.scheme and name not in ctx.results:
                q, scale, zero_point = observer.quantize_weight(
                    ctx.module(name).weight, target.weights, ctx.scale_dtype
                )
                ctx.results[name] = QuantizedLinear(q, scale, zero_point)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_balanced_groups": self.num_groups, "clip_search": self.clip_search}
        if self.coverage.blocks:
            out["expert_coverage"] = self.coverage.blocks
        return out


def _flat_cat(x: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in x])


def _divided(x: list[torch.Tensor], scales: torch.Tensor) -> list[torch.Tensor]:
    return [t / scales for t in x]

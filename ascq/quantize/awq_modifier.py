"""`AWQModifier`: AWQ scale search + clip search per decoder layer, then (with a scheme) round-to-nearest.

Balance groups, in order (AutoAWQ's, with MoE handled as one group per norm):
  input_layernorm -> q, k, v (judged on the attention output);
  v_proj -> o_proj, only when their shapes match (skipped under GQA, as AutoAWQ does);
  post_attention_layernorm -> gate/up of the MLP, or of every routed and shared expert together (judged on the
  whole MoE block output; the router reads the same norm, so the inverse scale is folded into its weight);
  up_proj -> down_proj for the dense MLP, each routed expert and the shared experts.
Experts with fewer routed calibration tokens than `min_expert_tokens` are calibrated on all tokens passed through
them densely (`moe_coverage`). After the scales, the clip search runs on every quantized linear except q/k.

Recipe (llm-compressor's shape): `AWQModifier: {scheme: W4A16_ASYM, ignore: [...], duo_scaling: true, n_grid: 20}`.
Without `scheme`/`config_groups` it only transforms the weights, and a later quantizing modifier (GPTQ, RTN) owns
the targets; the search then fake-quantizes with that modifier's scheme.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ascq.quantize import awq, qmath
from ascq.quantize.input_capture import InputCapture, replay
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.modifier import Modifier, QuantizedLinear, check_args
from ascq.quantize.moe_coverage import DEFAULT_MIN_TOKENS, ExpertCoverage, dense_mlp_inputs, num_tokens
from ascq.quantize.schemes import RecipeError, RecipeScheme, parse_recipe_scheme

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
}
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")  # AutoAWQ: clipping q/k hurts the attention scores


class AWQModifier(Modifier):
    name = "AWQModifier"

    def __init__(
        self,
        scheme: RecipeScheme | None,
        search: awq.AWQSearchConfig,
        clip_search: bool = True,
        min_expert_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> None:
        if min_expert_tokens < 0:
            raise RecipeError(f"{self.name}: min_expert_tokens must be >= 0")
        self.scheme = scheme
        self.search = search
        self.clip_search = clip_search
        self.min_expert_tokens = min_expert_tokens
        self.num_groups = 0
        self.coverage: dict[str, Any] = {}

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
            )
        except ValueError as exc:
            raise RecipeError(f"{cls.name}: {exc}") from None
        scheme = parse_recipe_scheme(cls.name, args)
        return cls(scheme, search, args.get("clip_search", True), args.get("min_expert_tokens", DEFAULT_MIN_TOKENS))

    def quant_scheme(self) -> RecipeScheme | None:
        return self.scheme

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        layer = ctx.layer
        mlps = gated_mlps(layer)
        experts = [n for n in mlps if ".experts." in n]
        capture_names = ["self_attn", "self_attn.o_proj", "mlp", *experts, *(f"{m}.down_proj" for m in mlps)]
        with InputCapture(layer, capture_names) as cap:
            ctx.run()
        coverage = ExpertCoverage(self.min_expert_tokens, {e: num_tokens(cap.inputs(e)) for e in experts})
        inputs = {name: cap.inputs(name) for name in capture_names}
        report: dict[str, Any] = {"alpha": {}, "skipped": []}

        # the inputs each quantized linear reads (updated as scales are folded), for the clip search
        clip_inputs: dict[str, list[torch.Tensor]] = {}
        qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        s = self._balance(ctx, "input_layernorm", qkv, [], "self_attn", cap.calls["self_attn"], inputs["self_attn"], report)
        clip_inputs.update(dict.fromkeys(qkv, _divided(inputs["self_attn"], s)))

        v, o = ctx.module("self_attn.v_proj"), ctx.module("self_attn.o_proj")
        o_inputs = inputs["self_attn.o_proj"]
        if v.weight.shape == o.weight.shape:
            s = self._balance(ctx, "self_attn.v_proj", ["self_attn.o_proj"], [], "self_attn.o_proj", None, o_inputs, report)
            o_inputs = _divided(o_inputs, s)
        else:
            report["skipped"].append("self_attn.v_proj->o_proj (shapes differ: GQA)")
        clip_inputs["self_attn.o_proj"] = o_inputs

        mlp_in = [f"{m}.{p}" for m in mlps for p in ("gate_proj", "up_proj")]
        router = ["mlp.gate"] if experts else []
        mlp_scales = self._balance(ctx, "post_attention_layernorm", mlp_in, router, "mlp", cap.calls["mlp"], inputs["mlp"], report)
        block_inputs = _divided(inputs["mlp"], mlp_scales)
        for m in mlps:
            dense = m in experts and coverage.needs_dense(m)
            dense_inputs = dense_mlp_inputs(ctx.module(m), block_inputs) if dense else None
            gate_up_inputs = block_inputs if (dense or m not in experts) else _divided(inputs[m], mlp_scales)
            clip_inputs[f"{m}.gate_proj"] = clip_inputs[f"{m}.up_proj"] = gate_up_inputs
            down_inputs = dense_inputs["down_proj"] if dense else inputs[f"{m}.down_proj"]
            if num_tokens(down_inputs) == 0:
                report["skipped"].append(f"{m}.up_proj->down_proj (no tokens)")
                continue
            down = f"{m}.down_proj"
            s = self._balance(ctx, f"{m}.up_proj", [down], [], down, None, down_inputs, report)
            clip_inputs[down] = _divided(down_inputs, s)

        if self.clip_search:
            self._clip(ctx, clip_inputs)
        if self.scheme is not None:
            self._quantize(ctx)
        if experts:
            report["expert_coverage"] = coverage.report()
            self.coverage.update({f"{ctx.prefix}{k}": v for k, v in coverage.report().items()})
        ctx.report["awq"] = report

    def _fake_quantize(self, ctx: LayerContext, name: str):
        args = ctx.targets[name].weights
        return lambda w: qmath.fake_quantize_weight(w, args, ctx.scale_dtype)

    def _search_config(self, ctx: LayerContext, name: str) -> awq.AWQSearchConfig:
        args = ctx.targets[name].weights
        in_features = ctx.module(name).weight.shape[1]
        group = args.group_size if args.strategy == "group" and args.group_size else in_features
        return dataclasses.replace(self.search, group_size=group)

    def _balance(
        self,
        ctx: LayerContext,
        producer: str,
        linears: list[str],
        fold_only: list[str],
        block: str,
        calls: list | None,
        x: list[torch.Tensor],
        report: dict[str, Any],
    ) -> torch.Tensor:
        """Search and fold the scales of one balance group; returns them (ones when the group is skipped)."""
        ones = torch.ones(ctx.module(linears[0]).weight.shape[1])
        if not all(n in ctx.targets for n in linears):
            report["skipped"].append(f"{producer} (not every linear is quantized)")
            return ones
        modules = [ctx.module(n) for n in linears]
        block_module = ctx.module(block)
        budget = self.search.max_search_tokens
        if calls is None:  # a single linear: its input rows are independent, sample them
            xs = awq.sample_tokens(_flat_cat(x), budget)
            block_output = lambda: block_module(xs)  # noqa: E731
        else:  # whole calibration batches (attention needs whole sequences), at least one
            num_calls = next((i + 1 for i in range(len(x)) if num_tokens(x[: i + 1]) >= budget), len(x))
            block_output = lambda: replay(block_module, calls[:num_calls], x[:num_calls])  # noqa: E731
        scales, alpha, _ = awq.search_scales(
            awq.activation_mean(_flat_cat(x)),
            modules,
            block_output,
            [self._fake_quantize(ctx, n) for n in linears],
            self._search_config(ctx, linears[0]),
        )
        consumers = modules + [ctx.module(n) for n in fold_only]
        producer_module = ctx.module(producer)
        if isinstance(producer_module, nn.Linear):
            awq.fold_into_linear(producer_module, consumers, scales)
        else:
            awq.fold_into_norm(producer_module, consumers, scales)
        report["alpha"][producer] = alpha
        self.num_groups += 1
        return scales

    def _clip(self, ctx: LayerContext, clip_inputs: dict[str, list[torch.Tensor]]) -> None:
        for name, x in clip_inputs.items():
            if name in NO_CLIP or name not in ctx.targets or num_tokens(x) == 0:
                continue
            linear = ctx.module(name)
            config = self._search_config(ctx, name)
            max_val = awq.search_clip(linear.weight, _flat_cat(x), self._fake_quantize(ctx, name), config)
            awq.apply_clip(linear, max_val)

    def _quantize(self, ctx: LayerContext) -> None:
        for name, target in ctx.targets.items():
            if target.owner is self.scheme and name not in ctx.results:
                q, scale, zero_point = qmath.quantize_weight(ctx.module(name).weight, target.weights, ctx.scale_dtype)
                ctx.results[name] = QuantizedLinear(q, scale, zero_point)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_balanced_groups": self.num_groups, "clip_search": self.clip_search}
        if self.coverage:
            out["expert_coverage"] = self.coverage
        return out


def gated_mlps(layer: nn.Module) -> list[str]:
    """Module names of the gated MLPs (gate/up/down) of a layer: `mlp`, or `mlp.experts.E` + `mlp.shared_experts`."""
    names = [n for n, m in layer.named_modules() if all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))]
    return sorted(names, key=lambda n: (n.count("."), _expert_index(n), n))


def _expert_index(name: str) -> int:
    tail = name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _flat_cat(x: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in x])


def _divided(x: list[torch.Tensor], scales: torch.Tensor) -> list[torch.Tensor]:
    return [t / scales for t in x]

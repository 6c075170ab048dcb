"""AWQ search and folding on random tensors, against plain-PyTorch math and compressed-tensors' own fake
quant."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from torch import nn

from ascq.core.norm import rms_norm
from ascq.quantize.awq import (
    AWQSearchConfig,
    activation_mean,
    apply_clip,
    duo_scales,
    fold_into_linear,
    fold_into_norm,
    search_clip,
    search_scales,
    weight_mean,
)

W4_G32 = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)


def ct_fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """Int4 asym group-32 quantize-dequantize, parameters and rounding by compressed-tensors itself."""
    groups = w.float().view(w.shape[0], -1, 32)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), W4_G32)
    return fake_quantize(w.float(), scale, zero, W4_G32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def outlier_inputs(num_tokens: int = 256, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, dim, generator=g)
    x[:, [3, 17, 40]] *= 30.0  # a few salient channels, as in real LLM activations
    return x


def test_weight_and_activation_means_match_loops():
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(8, 64, generator=g), torch.randn(4, 64, generator=g)
    w = torch.cat([w1, w2]).abs()
    expected = torch.zeros(64)
    for row in w:
        for start in range(0, 64, 32):
            chunk = row[start : start + 32]
            expected[start : start + 32] += chunk / chunk.max()
    torch.testing.assert_close(weight_mean([w1, w2], 32), expected / 12)
    x = torch.randn(2, 5, 64, generator=g)
    torch.testing.assert_close(activation_mean(x), x.abs().reshape(10, 64).mean(0))


def test_duo_scales_are_normalised_and_follow_formula():
    x_mean, w_mean = torch.rand(64) + 0.1, torch.rand(64) + 0.1
    s = duo_scales(x_mean, w_mean, 0.35)
    raw = x_mean**0.35 / (w_mean**0.65 + 1e-4)
    torch.testing.assert_close(s, raw / (raw.max() * raw.min()).sqrt())
    assert s.max() * s.min() == pytest.approx(1.0, rel=1e-5)


def test_search_scales_matches_brute_force_grid_and_restores_weights():
    torch.manual_seed(0)
    x = outlier_inputs()
    q, k = nn.Linear(64, 48, bias=False), nn.Linear(64, 16, bias=False)
    before = [q.weight.clone(), k.weight.clone()]
    config = AWQSearchConfig(group_size=32)

    def block(inp: torch.Tensor) -> torch.Tensor:
        return torch.cat([q(inp), k(inp)], dim=-1)

    scales, alpha, losses = search_scales(
        activation_mean(x), [q, k], lambda: block(x), ct_fake_quantize, config
    )
    torch.testing.assert_close(q.weight, before[0])
    torch.testing.assert_close(k.weight, before[1])
    # independent loss for every α: plain matmuls with the quantized scaled weights
    x_mean = x.abs().mean(0)
    w_mean = weight_mean(before, 32)
    reference = torch.cat([x @ before[0].t(), x @ before[1].t()], dim=-1)
    brute = []
    for step in range(20):
        s = duo_scales(x_mean, w_mean, step / 20)
        out = torch.cat([(x / s) @ ct_fake_quantize(w * s).t() for w in before], dim=-1)
        brute.append((out - reference).pow(2).mean().item())
    assert losses == pytest.approx(brute, rel=1e-4)
    assert alpha == pytest.approx(brute.index(min(brute)) / 20)
    assert alpha > 0, "salient channels must make a non-trivial α win"
    rtn = (torch.cat([x @ ct_fake_quantize(w).t() for w in before], dim=-1) - reference).pow(2).mean().item()
    assert min(brute) < 0.7 * rtn, "AWQ scaling must beat plain round-to-nearest"
    torch.testing.assert_close(scales, duo_scales(x_mean, w_mean, alpha))


def test_awq_beats_round_to_nearest_on_outlier_channels():
    torch.manual_seed(0)
    x = outlier_inputs(dim=128)
    norm, fc = RMSNorm(128), nn.Linear(128, 96, bias=False)
    h = norm(x)
    reference = fc(h)
    rtn_err = (h @ ct_fake_quantize(fc.weight).t() - reference).pow(2).mean()
    scales, _, _ = search_scales(
        activation_mean(h), [fc], lambda: fc(h), ct_fake_quantize, AWQSearchConfig(group_size=32)
    )
    fold_into_norm(norm, [fc], scales)
    awq_err = (norm(x) @ ct_fake_quantize(fc.weight).t() - reference).pow(2).mean()
    assert awq_err < 0.7 * rtn_err


def test_folding_preserves_the_function():
    torch.manual_seed(0)
    x = torch.randn(10, 64)
    norm, q, router = RMSNorm(64), nn.Linear(64, 32), nn.Linear(64, 8, bias=False)
    up, down = nn.Linear(64, 48, bias=True), nn.Linear(48, 64)
    with torch.no_grad():
        h = norm(x)
        before = (q(h), router(h), down(up(h)))
        fold_into_norm(norm, [q, router, up], torch.rand(64) + 0.5)
        fold_into_linear(up, [down], torch.rand(48) + 0.5)
        h = norm(x)
        after = (q(h), router(h), down(up(h)))
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_clip_search_picks_the_per_group_best_shrink():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[0, 5] = 12.0  # one extreme weight: clipping its group helps
    x = torch.randn(300, 64)
    config = AWQSearchConfig(group_size=32, max_clip_tokens=1000)
    max_val = search_clip(w, x, ct_fake_quantize, config)
    original_max = w.abs().view(16, 2, 32).amax(-1)
    assert (max_val <= original_max + 1e-6).all() and (max_val >= 0.5 * original_max - 1e-6).all()
    # brute force: each group's partial-output error for each candidate shrink
    for row, grp in [(0, 0), (3, 1), (7, 0)]:
        errs = []
        for step in range(21):
            m = original_max * (1 - 0.5 * step / 20)
            bound = m.repeat_interleave(32, dim=1)
            qw = ct_fake_quantize(w.clamp(-bound, bound))
            sl = slice(grp * 32, grp * 32 + 32)
            errs.append(((x[:, sl] @ qw[row, sl]) - (x[:, sl] @ w[row, sl])).pow(2).mean().item())
        expected = original_max[row, grp] * (1 - 0.5 * errs.index(min(errs)) / 20)
        assert max_val[row, grp].item() == pytest.approx(expected.item(), rel=1e-5)
    assert max_val[0, 0] < original_max[0, 0]
    fc = nn.Linear(64, 16, bias=False)
    fc.weight.data = w.clone()
    clip_err = (x @ ct_fake_quantize(_clipped(fc, max_val)).t() - x @ w.t()).pow(2).mean()
    rtn_err = (x @ ct_fake_quantize(w).t() - x @ w.t()).pow(2).mean()
    assert clip_err < rtn_err


def _clipped(fc: nn.Linear, max_val: torch.Tensor) -> torch.Tensor:
    apply_clip(fc, max_val)
    return fc.weight.detach()


# ---- the modifier on one real decoder layer (random weights, planted outlier channels)
# ------------------------


def _deepseek_layer_context(modifier, outliers: bool, seed: int = 0):
    from ascq.quantize.architectures import DeepseekMoEArch
    from ascq.quantize.layer_context import LayerContext
    from ascq.quantize.schemes import resolve_target

    config = dict(
        model_type="deepseek",
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=2,
        first_k_dense_replace=1,
        rms_norm_eps=1e-6,
    )
    arch = DeepseekMoEArch(config)
    torch.manual_seed(seed)
    layer = arch.new_layer(1).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = layer.get_submodule(name)
            norm.weight.uniform_(0.5, 1.5)
            if outliers:  # the outlier-stress transform on this layer
                norm.weight[[3, 50, 100, 200]] *= 30
                for n, m in layer.named_modules():
                    reads_norm = n.startswith("self_attn.") and n[-6:] in ("q_proj", "k_proj", "v_proj")
                    reads_norm |= name == "post_attention_layernorm" and (
                        n.endswith(("gate_proj", "up_proj")) or n == "mlp.gate"
                    )
                    if (
                        isinstance(m, nn.Linear)
                        and reads_norm
                        and (name == "input_layernorm") == n.startswith("self_attn.")
                    ):
                        m.weight[:, [3, 50, 100, 200]] /= 30
    scheme = modifier.quant_scheme()
    targets = {
        n: t
        for n, m in layer.named_modules()
        if isinstance(m, nn.Linear) and (t := resolve_target(f"model.layers.1.{n}", m, [scheme]))
    }
    inputs = [torch.randn(1, 48, 256) for _ in range(2)]
    return LayerContext(1, "model.layers.1.", arch, layer, inputs, targets, torch.bfloat16)


def test_awq_modifier_scaling_keeps_the_moe_layer_function_and_routing():
    from ascq.quantize.awq_modifier import AWQModifier

    modifier = AWQModifier.from_args({"scheme": "W4A16_ASYM", "clip_search": False})
    ctx = _deepseek_layer_context(modifier, outliers=True)
    routing: list[torch.Tensor] = []

    def record_routing(moe, args, output) -> None:
        routing.append(moe.route(args[0].reshape(-1, 256))[2])

    ctx.layer.mlp.register_forward_hook(record_routing)
    before = ctx.run()
    modifier.process_layer(ctx)
    after = ctx.run()
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the hook also sees the searches' replays: the last calls are the run after
    for first, last in zip(routing[: len(before)], routing[-len(before) :], strict=True):
        assert torch.equal(first.sort(-1).values, last.sort(-1).values)
    report = ctx.report["awq"]
    assert set(report["alpha"]) >= {
        "input_layernorm",
        "self_attn.v_proj",
        "post_attention_layernorm",
        "mlp.experts.0.up_proj",
    }
    assert len(ctx.results) == len(ctx.targets) == 4 + 16 * 3 + 3
    assert sum(report["expert_coverage"]["mlp"]["tokens_per_expert"]) == 2 * 48 * 4


def _output_error(ctx, modifier) -> float:
    from ascq.core import qmath

    reference = ctx.run()
    modifier.process_layer(ctx)
    for name, result in ctx.results.items():
        ctx.module(name).weight.data = qmath.dequantize_weight(
            result.q, result.scale, result.zero_point, ctx.targets[name].weights
        )
    return sum((a - b).pow(2).mean().item() for a, b in zip(reference, ctx.run(), strict=True))


def test_awq_modifier_beats_rtn_on_an_outlier_layer():
    from ascq.quantize.awq_modifier import AWQModifier
    from ascq.quantize.quantization_modifier import QuantizationModifier

    rtn, awq = (
        QuantizationModifier.from_args({"scheme": "W4A16_ASYM"}),
        AWQModifier.from_args({"scheme": "W4A16_ASYM"}),
    )
    rtn_error = _output_error(_deepseek_layer_context(rtn, True), rtn)
    awq_error = _output_error(_deepseek_layer_context(awq, True), awq)
    assert 0 < awq_error < 0.7 * rtn_error


def test_awq_moe_router_is_compensated_exactly_in_the_checkpoint_dtype():
    """The router stays full precision but reads the scaled norm: written in bf16, norm / s and gate · s must
    give the source's router logits bit for bit (powers-of-two scales), else AWQ reroutes tokens that RTN does
    not."""
    from ascq.quantize.awq_modifier import AWQModifier

    modifier = AWQModifier.from_args({"scheme": "W4A16_ASYM", "clip_search": False})
    ctx = _deepseek_layer_context(modifier, outliers=True)
    with torch.no_grad():
        for p in ctx.layer.parameters():
            p.copy_(p.to(torch.bfloat16))  # a bf16 source checkpoint
    norm, gate = ctx.layer.post_attention_layernorm, ctx.layer.mlp.gate
    x = torch.cat([t.reshape(-1, 256) for t in ctx.inputs]) * 3

    def router_logits() -> torch.Tensor:
        written = {
            "norm": norm.weight.to(torch.bfloat16).float(),
            "gate": gate.weight.to(torch.bfloat16).float(),
        }
        return rms_norm(x, written["norm"], 1e-6) @ written["gate"].T

    before, norm_before = router_logits(), norm.weight.clone()
    modifier.process_layer(ctx)
    assert not torch.equal(norm.weight, norm_before), "the MoE group was balanced"
    torch.testing.assert_close(router_logits(), before, rtol=0, atol=0)
    assert torch.equal(router_logits().topk(4).indices, before.topk(4).indices)


def test_search_loss_is_block_or_linear():
    from ascq.quantize.awq_modifier import AWQModifier
    from ascq.quantize.schemes import RecipeError

    base = {"scheme": "W4A16_ASYM", "targets": ["Linear"]}
    assert not AWQModifier.from_args(base).linear_loss  # llm-compressor's: the block output
    assert AWQModifier.from_args({**base, "search_loss": "linear"}).linear_loss
    with pytest.raises(RecipeError, match="search_loss must be one of block, linear"):
        AWQModifier.from_args({**base, "search_loss": "output"})


def test_shortlist_runs_the_block_on_the_best_grid_points_by_the_linear_loss():
    """shortlist k: the Gram loss (no forward) ranks the grid, the block loss judges only its k best; the
    block runs k + 1 times (the reference once) and the pick is the block-loss best of those k."""
    torch.manual_seed(0)
    x = outlier_inputs()
    q, k = nn.Linear(64, 48, bias=False), nn.Linear(64, 16, bias=False)
    before = [q.weight.clone(), k.weight.clone()]
    num_calls = 0

    def block() -> torch.Tensor:  # not the linears' own outputs: a nonlinearity between, as attention has
        nonlocal num_calls
        num_calls += 1
        return torch.tanh(torch.cat([q(x), k(x)], dim=-1) / 4)

    gram = x.t() @ x / x.shape[0]
    x_mean = activation_mean(x)
    _, _, linear_losses = search_scales(
        x_mean, [q, k], None, ct_fake_quantize, AWQSearchConfig(group_size=32), gram=gram
    )
    _, _, block_losses = search_scales(
        x_mean, [q, k], block, ct_fake_quantize, AWQSearchConfig(group_size=32)
    )
    num_calls = 0
    scales, alpha, losses = search_scales(
        x_mean, [q, k], block, ct_fake_quantize, AWQSearchConfig(group_size=32, shortlist=3), gram=gram
    )
    assert num_calls == 4
    shortlisted = sorted(sorted(range(20), key=linear_losses.__getitem__)[:3])
    assert losses == pytest.approx([block_losses[i] for i in shortlisted], rel=1e-5)
    best = min(shortlisted, key=block_losses.__getitem__)
    assert alpha == pytest.approx(best / 20)
    torch.testing.assert_close(scales, duo_scales(x_mean, weight_mean(before, 32), best / 20))
    torch.testing.assert_close(q.weight, before[0])
    num_calls = 0  # shortlist 0 (the default): every grid point runs the block, as without a Gram matrix
    _, _, all_losses = search_scales(
        x_mean, [q, k], block, ct_fake_quantize, AWQSearchConfig(group_size=32), gram=gram
    )
    assert num_calls == 21 and all_losses == pytest.approx(block_losses, rel=1e-6)


def test_shortlist_recipe_key():
    from ascq.quantize.awq_modifier import AWQModifier
    from ascq.quantize.schemes import RecipeError

    base = {"scheme": "W4A16_ASYM", "targets": ["Linear"]}
    assert AWQModifier.from_args({**base, "shortlist": 4}).search.shortlist == 4
    with pytest.raises(RecipeError, match="shortlist must be >= 0"):
        AWQModifier.from_args({**base, "shortlist": -1})
    with pytest.raises(RecipeError, match="search_loss linear has none"):
        AWQModifier.from_args({**base, "search_loss": "linear", "shortlist": 4})

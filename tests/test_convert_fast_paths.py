"""The converter's speed paths compute what the plain paths compute: bit for bit where the same operations run
in another order or batching, to float rounding where the math is rearranged (fused attention, Gram-matrix
losses)."""

from __future__ import annotations

import logging

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from torch import nn

from ascq.core import qmath
from ascq.formats.safetensors import CheckpointReader
from ascq.quantize import awq, observer
from ascq.quantize.architectures import load_architecture
from ascq.quantize.gptq import GramCache, HessianAccumulator
from ascq.quantize.input_capture import InputCapture
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.pipeline import fast_layer
from ascq.quantize.reference_forward import activation_pre_hook

W4_G32 = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)
W8_TOKEN = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)


def fake_quantize(w: torch.Tensor) -> torch.Tensor:
    return observer.fake_quantize_weight(w, W4_G32)


def tiny_layer(tiny_llama_dir, index: int = 0) -> tuple:
    arch = load_architecture(tiny_llama_dir)
    layer = arch.build_layer(
        index, CheckpointReader(tiny_llama_dir).get_prefix(arch.layer_prefix(index), torch.float32)
    )
    return arch, layer


def test_clip_search_with_stacked_steps_is_bit_identical():
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    w[3, 7] = 9.0
    for num_tokens in (16, 400):  # the partial-output path (groups longer than the tokens) and the Gram path
        x = torch.randn(num_tokens, 128) * (torch.rand(128) * 3)
        config = awq.AWQSearchConfig(group_size=32, max_clip_tokens=512)
        one_at_a_time = awq.search_clip(w, x, fake_quantize, config)
        stacked = awq.search_clip(w, x, fake_quantize, config, rows_independent=True)
        assert torch.equal(one_at_a_time, stacked)
        assert (stacked < w.abs().view(48, 4, 32).amax(-1)).any()


def test_alpha_grid_gram_loss_equals_the_linear_output_loss():
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    x[:, [3, 17, 40]] *= 30.0
    linear = nn.Linear(64, 24)
    before = linear.weight.clone()
    config = awq.AWQSearchConfig(group_size=32)
    x_mean = awq.activation_mean(x)
    plain = awq.search_scales(x_mean, [linear], lambda: linear(x), fake_quantize, config)
    gram = awq.search_scales(
        x_mean, [linear], lambda: linear(x), fake_quantize, config, gram=x.t() @ x / x.shape[0]
    )
    assert torch.equal(linear.weight, before)
    assert gram[2] == pytest.approx(plain[2], rel=1e-4)
    assert gram[1] == plain[1] and torch.equal(gram[0], plain[0])
    # several linears reading x: the Gram loss is the MSE of their concatenated outputs
    second = nn.Linear(64, 8)
    outputs = lambda: torch.cat([linear(x), second(x)], dim=-1)  # noqa: E731
    plain = awq.search_scales(x_mean, [linear, second], outputs, fake_quantize, config)
    gram = awq.search_scales(
        x_mean, [linear, second], None, fake_quantize, config, gram=x.t() @ x / x.shape[0]
    )
    assert gram[2] == pytest.approx(plain[2], rel=1e-4)
    assert gram[1] == plain[1] and torch.equal(gram[0], plain[0])
    # fewer tokens than input channels: the rows themselves stand in for the Gram matrix
    few = x[:40]
    outputs = lambda: torch.cat([linear(few), second(few)], dim=-1)  # noqa: E731
    plain = awq.search_scales(x_mean, [linear, second], outputs, fake_quantize, config)
    rows = awq.search_scales(x_mean, [linear, second], None, fake_quantize, config, gram=few)
    assert rows[2] == pytest.approx(plain[2], rel=1e-4)
    assert rows[1] == plain[1] and torch.equal(rows[0], plain[0])


def test_shared_gram_cache_gives_the_same_hessians_once_per_input():
    torch.manual_seed(0)
    batches = [torch.randn(2, 32, 40) for _ in range(3)]
    cache = GramCache()
    shared = [HessianAccumulator(40, cache), HessianAccumulator(40, cache)]
    alone = HessianAccumulator(40)
    computed = []
    original_get = cache.get

    def counting_get(x, total, compute):
        return original_get(x, total, lambda: computed.append(1) or compute())

    cache.get = counting_get
    for x in batches:
        for accumulator in shared:
            accumulator.add(x.detach())  # hooks see a fresh detached view per module
        alone.add(x)
    assert all(torch.equal(a.hessian, alone.hessian) for a in shared)
    assert len(computed) == len(batches)
    other = HessianAccumulator(40, cache)
    other.add(batches[0] + 1)  # another tensor: its own product
    assert len(computed) == len(batches) + 1


def test_observe_stops_after_the_hooked_modules_and_sees_what_run_sees(tiny_llama_dir):
    arch, layer = tiny_layer(tiny_llama_dir)
    torch.manual_seed(0)
    inputs = [torch.randn(2, 16, arch.hidden_size), torch.randn(1, 16, arch.hidden_size)]
    ctx = LayerContext(0, arch.layer_prefix(0), arch, layer, inputs, {}, torch.float32)
    seen: dict[str, list[torch.Tensor]] = {"run": [], "observe": []}
    mlp_calls = []
    layer.mlp.register_forward_pre_hook(lambda *a: mlp_calls.append(1))

    def record(kind: str):
        return lambda module, args, output: seen[kind].append(output.clone())

    ctx.run({"post_attention_layernorm": record("run")})
    assert len(mlp_calls) == 2
    ctx.observe({"input_layernorm": record("observe"), "post_attention_layernorm": record("observe")})
    assert len(mlp_calls) == 2, "observe ran the MLP, which no hook needs"
    assert all(torch.equal(a, b) for a, b in zip(seen["run"], seen["observe"][1::2], strict=True))


def test_shared_activation_quantizer_is_bit_identical_and_quantizes_once():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32) * 4
    shared: dict = {}
    hooks = [activation_pre_hook(W8_TOKEN, None, shared) for _ in range(3)]
    outputs = [hook(None, (x,))[0] for hook in hooks]
    expected = qmath.per_token_fake_quantize(x, 8)
    assert all(torch.equal(out, expected) for out in outputs)
    assert outputs[1] is outputs[0] and outputs[2] is outputs[0]
    x.mul_(2)  # changed in place: quantized again
    assert torch.equal(hooks[0](None, (x,))[0], qmath.per_token_fake_quantize(x, 8))
    static = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
    a, b = torch.tensor([0.05]), torch.tensor([0.1])
    y = torch.randn(4, 32)
    static_shared: dict = {}
    first = activation_pre_hook(static, a, static_shared)(None, (y,))[0]
    second = activation_pre_hook(static, b, static_shared)(None, (y,))[0]  # another scale: its own result
    assert torch.equal(first, qmath.static_fake_quantize(y, a)) and torch.equal(
        second, qmath.static_fake_quantize(y, b)
    )


def test_fused_attention_matches_the_reference_attention(tiny_llama_dir):
    arch, layer = tiny_layer(tiny_llama_dir)
    torch.manual_seed(0)
    x = torch.randn(3, 40, arch.hidden_size)
    positions = torch.arange(40)[None]
    reference = arch.forward_layer(layer, x, positions)
    fused = arch.forward_layer(fast_layer(layer), x, positions)
    assert layer.self_attn.fused_attention is torch.float32
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_input_capture_views_share_storage_for_the_gram_cache(tiny_llama_dir):
    """q/k/v read one tensor; the capture hooks' detached views keep its storage, so the cache key matches."""
    arch, layer = tiny_layer(tiny_llama_dir)
    pointers: dict[str, int] = {}
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    on_input = {n: (lambda x, n=n: pointers.__setitem__(n, x.data_ptr())) for n in names}
    with InputCapture(layer, names, on_input), torch.no_grad():
        arch.forward_layer(layer, torch.randn(1, 8, arch.hidden_size), torch.arange(8)[None])
    assert len(set(pointers.values())) == 1


def test_alpha_grid_with_stacked_candidates_is_bit_identical():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x[:, [5, 9]] *= 20.0
    q, k = nn.Linear(64, 48, bias=False), nn.Linear(64, 16, bias=False)

    def block() -> torch.Tensor:
        return torch.cat([q(x), k(x)], dim=-1).relu()

    config = awq.AWQSearchConfig(group_size=32)
    one_at_a_time = awq.search_scales(awq.activation_mean(x), [q, k], block, fake_quantize, config)
    stacked = awq.search_scales(
        awq.activation_mean(x), [q, k], block, fake_quantize, config, rows_independent=True
    )
    assert stacked[2] == one_at_a_time[2] and stacked[1] == one_at_a_time[1]
    assert torch.equal(stacked[0], one_at_a_time[0]) and one_at_a_time[1] > 0


def test_residual_blocks_compose_to_the_layer(tiny_llama_dir):
    arch, layer = tiny_layer(tiny_llama_dir)
    torch.manual_seed(0)
    x = torch.randn(2, 16, arch.hidden_size)
    position_ids = torch.arange(16)[None]
    h = x
    for block in arch.blocks:
        h = arch.forward_block(layer, block, h, position_ids)
    assert torch.equal(h, arch.forward_layer(layer, x, position_ids))
    names = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    assert all(sum(b.contains(n) for b in arch.blocks) == 1 for n in names), (
        "every linear in exactly one block"
    )


def test_capture_inputs_stops_before_the_last_linear_runs_and_sees_its_input(tiny_llama_dir):
    """The MLP block's captured down_proj inputs are plain PyTorch's silu(gate(n)) * up(n), and down_proj
    never runs."""
    arch, layer = tiny_layer(tiny_llama_dir)
    torch.manual_seed(0)
    inputs = [torch.randn(2, 16, arch.hidden_size), torch.randn(1, 16, arch.hidden_size)]
    mlp_block = next(b for b in arch.blocks if b.name == "mlp")
    ctx = LayerContext(0, arch.layer_prefix(0), arch, layer, inputs, {}, torch.float32, block=mlp_block)
    down_calls = []
    layer.mlp.down_proj.register_forward_hook(lambda *a: down_calls.append(1))
    cap = ctx.capture_inputs(["mlp.gate_proj", "mlp.down_proj"])
    assert not down_calls
    mlp = layer.mlp
    for x, got in zip(inputs, cap.inputs("mlp.down_proj"), strict=True):
        n = layer.post_attention_layernorm(x)
        torch.testing.assert_close(
            got, torch.nn.functional.silu(n @ mlp.gate_proj.weight.T) * (n @ mlp.up_proj.weight.T)
        )
    assert ctx.balance_groups() and all(mlp_block.contains(g.smooth_layer) for g in ctx.balance_groups())


@pytest.mark.parametrize("static", [False, True])
def test_integer_gemm_propagation_matches_the_fake_quantized_fp32_forward(
    tiny_llama_dir, monkeypatch, static
):
    from ascq.kernels import cpu
    from ascq.quantize.modifier import QuantizedLinear
    from ascq.quantize.reference_forward import install_quantized, integer_gemm_applies
    from ascq.quantize.schemes import LinearTarget

    weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    activations = (
        QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
        if static
        else W8_TOKEN
    )
    torch.manual_seed(0)
    x = torch.randn(3, 40, 256) * 2
    outputs = {}
    for fast in (False, True):
        monkeypatch.setattr(cpu, "INT8_GEMM_FAST", fast)
        arch, layer = tiny_layer(tiny_llama_dir)
        quantized = {}
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                target = LinearTarget(weights, activations, None)
                q, scale, _ = observer.quantize_weight(module.weight, weights, torch.bfloat16)
                input_scale = torch.tensor([0.05], dtype=torch.bfloat16) if static else None
                quantized[name] = (target, QuantizedLinear(q, scale, None, input_scale))
                assert integer_gemm_applies(target, module) == fast
        install_quantized(fast_layer(layer), quantized, integer_gemm=True)
        outputs[fast] = arch.forward_block(layer, None, x, torch.arange(40)[None])
    torch.testing.assert_close(outputs[True], outputs[False], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outputs[True], x)


def _gptq_context(tiny_llama_dir, propagate_in_place: bool) -> tuple:
    from ascq.quantize.gptq_modifier import GPTQModifier
    from ascq.quantize.pipeline import layer_targets

    arch, layer = tiny_layer(tiny_llama_dir)
    modifier = GPTQModifier.from_args({"scheme": "W4A16_ASYM", "targets": ["Linear"], "actorder": "static"})
    targets, _, _ = layer_targets(layer, arch.layer_prefix(0), [modifier.quant_scheme()])
    torch.manual_seed(0)
    inputs = [torch.randn(2, 48, 256) * 3 for _ in range(2)]
    ctx = LayerContext(
        0,
        arch.layer_prefix(0),
        arch,
        fast_layer(layer),
        inputs,
        targets,
        torch.bfloat16,
        propagate_in_place=propagate_in_place,
    )
    return modifier, ctx


def test_gptq_sequential_pass_propagates_what_the_written_weights_compute(tiny_llama_dir):
    from ascq.quantize.reference_forward import install_quantized

    modifier, ctx = _gptq_context(tiny_llama_dir, propagate_in_place=True)
    modifier.process_layer(ctx)
    assert ctx.propagated is not None and set(ctx.results) == set(ctx.targets) and modifier.num_quantized == 7
    install_quantized(ctx.layer, {n: (t, ctx.results[n]) for n, t in ctx.targets.items()})
    for propagated, x in zip(ctx.propagated, ctx.inputs, strict=True):
        torch.testing.assert_close(propagated, ctx.forward(x), rtol=1e-5, atol=1e-5)
    other, two_pass = _gptq_context(tiny_llama_dir, propagate_in_place=False)
    other.process_layer(two_pass)
    assert two_pass.propagated is None
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):  # read the layer input: same H
        # (H summed over one batch or two: float rounding may move a rare code by one)
        assert (two_pass.results[name].q != ctx.results[name].q).float().mean() < 0.01, name
    # the others' H come from the quantized linears before them in the sequential pass
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert not torch.equal(two_pass.results[name].q, ctx.results[name].q), name


def test_gptq_of_stacked_linears_equals_each_linears_own():
    from ascq.quantize.gptq import GPTQConfig, gptq_quantize

    torch.manual_seed(0)
    x = torch.randn(400, 64) * (torch.rand(64) * 3)
    hessian = 2 * x.t() @ x / x.shape[0]
    weights = [torch.randn(32, 64), torch.randn(16, 64)]
    config = GPTQConfig(group_size=32, actorder=True)

    def qparams(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return qmath.compute_qparams(w.amin(-1), w.amax(-1), 4, False, torch.float32, None)

    stacked = gptq_quantize(torch.cat(weights), hessian, qparams, (0, 15), config)
    alone = [gptq_quantize(w, hessian, qparams, (0, 15), config) for w in weights]
    for part, own in zip(zip(*(t.split([32, 16]) for t in stacked), strict=True), alone, strict=True):
        for a, b in zip(part, own, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_products_layer_matches_fp32_to_bf16_rounding(tiny_llama_dir, monkeypatch):
    """`fast_layer(layer, bfloat16)`: the same layer function with every product rounded like a bf16 GEMM,
    while hooks still see the fp32 inputs; q/k/v and gate/up round their shared input once."""
    from ascq.quantize import pipeline

    arch, layer = tiny_layer(tiny_llama_dir)
    torch.manual_seed(0)
    x = torch.randn(2, 24, arch.hidden_size)
    positions = torch.arange(24)[None]
    reference = arch.forward_layer(fast_layer(layer), x, positions)
    seen = []
    handle = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    rounded = []
    shared_result = pipeline.shared_result

    def counting(shared, tensor, key, compute):
        return shared_result(shared, tensor, key, lambda: rounded.append(tensor.shape[-1]) or compute())

    monkeypatch.setattr(pipeline, "shared_result", counting)
    try:
        bf16 = arch.forward_layer(fast_layer(layer, torch.bfloat16), x, positions)
    finally:
        handle.remove()
    assert seen == [torch.float32] and layer.self_attn.fused_attention is torch.bfloat16
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, reference)
    torch.testing.assert_close(bf16, reference, rtol=0.05, atol=0.05)
    # 7 linears, 4 distinct inputs: q/k/v's, o's, gate/up's, down's
    assert len(rounded) == 4


def test_calibration_dtype_auto_is_bf16_only_for_recipes_measured_with_it(monkeypatch, caplog):
    from ascq.core.errors import AscqError
    from ascq.kernels import cpu
    from ascq.quantize import pipeline
    from ascq.quantize.recipe import load_recipes

    monkeypatch.setattr(cpu, "BF16_GEMM_FAST", True)
    assert pipeline.calibration_gemm_dtype("auto", "cpu", load_recipes(["w4a16-gptq"])) is torch.bfloat16
    assert pipeline.calibration_gemm_dtype("auto", "cpu", load_recipes(["awq-int4"])) is torch.float32
    assert pipeline.calibration_gemm_dtype("auto", "cpu", load_recipes(["w8a8"])) is torch.float32
    assert pipeline.calibration_gemm_dtype("bfloat16", "cpu", load_recipes(["awq-int4"])) is torch.bfloat16
    assert pipeline.calibration_gemm_dtype("auto", "cuda", load_recipes(["w8a8"])) is torch.float32
    monkeypatch.setattr(cpu, "BF16_GEMM_FAST", False)
    assert pipeline.calibration_gemm_dtype("auto", "cpu", load_recipes(["w8a8"])) is torch.float32
    # asked for explicitly where it is slow: kept, with a warning (on an AVX2-only host a bf16 F.linear of
    # 1024 x 2048 x 2816 ran at 6 GFLOP/s against fp32's 58-66)
    with caplog.at_level(logging.WARNING, logger="ascq.quantize.pipeline"):
        assert pipeline.calibration_gemm_dtype("bfloat16", "cpu", load_recipes(["w8a8"])) is torch.bfloat16
    assert "no fast bf16 GEMM" in caplog.text
    caplog.clear()
    monkeypatch.setattr(cpu, "BF16_GEMM_FAST", True)
    with caplog.at_level(logging.WARNING, logger="ascq.quantize.pipeline"):
        pipeline.calibration_gemm_dtype("bfloat16", "cpu", load_recipes(["w8a8"]))
    assert "no fast bf16 GEMM" not in caplog.text
    with pytest.raises(AscqError, match="--calibration-dtype 'fp16'"):
        pipeline.calibration_gemm_dtype("fp16", "cpu", load_recipes(["w8a8"]))


def test_replay_runs_input_only_calls_as_one_and_keeps_per_call_context():
    from ascq.quantize.input_capture import replay

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
    inputs = [torch.randn(1, 5, 16), torch.randn(1, 7, 16)]
    calls = [((x,), {}) for x in inputs]
    per_call = torch.cat([mlp(x).reshape(-1, 16) for x in inputs])
    torch.testing.assert_close(replay(mlp, calls, inputs), per_call)

    class SequenceMean(nn.Module):  # sees its call's whole sequence: must run call by call
        def forward(self, x, scale=1.0):
            return (x - x.mean(dim=1, keepdim=True)) * scale

    block = SequenceMean()
    calls = [((x,), {"scale": 2.0}) for x in inputs]
    expected = torch.cat([block(x, scale=2.0).reshape(-1, 16) for x in inputs])
    assert torch.equal(replay(block, calls, inputs), expected)

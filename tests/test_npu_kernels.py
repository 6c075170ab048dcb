"""The NPU backend's kernels against the reference backend, run on the CPU torch_npu EMULATOR.

What passes here: the backend calls the documented torch_npu ops with argument names, dtypes, shapes, layouts
(K, N weights, FRACTAL_NZ tags, int4 packing, TND page attention) the docs accept, and the emulated math
equals the reference backend's. Not shown: that Ascend hardware produces the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from npu_emulation import EmulatedContractError, get_npu_format

from ascq.core.errors import UnsupportedError
from ascq.kernels import QuantLinearWeights, reference

DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def quantized_linear(
    scheme: str, out_features: int, in_features: int, group_size=None, asym=False, bias=False, seed=0
) -> QuantLinearWeights:
    g = torch.Generator().manual_seed(seed)
    bits = 4 if scheme in ("w4a16", "w4a8_dynamic") else 8
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    groups = in_features // group_size if group_size else 1
    weight = torch.randint(low, high + 1, (out_features, in_features), generator=g, dtype=torch.int8)
    scale = (torch.rand(out_features, groups, generator=g) * 0.02 + 0.005).to(DTYPE)
    zero = torch.randint(-3, 4, (out_features, groups), generator=g, dtype=torch.int8) if asym else None
    static = scheme == "w8a8_static"
    return QuantLinearWeights(
        scheme,
        weight,
        scale,
        zero,
        group_size,
        input_scale=torch.tensor([0.03]) if static else None,
        input_zero_point=torch.tensor([5], dtype=torch.int8) if static and asym else None,
        bias=(torch.randn(out_features, generator=g) * 0.1).to(DTYPE) if bias else None,
    )


LINEAR_CASES = {
    "w8a8_dynamic": dict(scheme="w8a8_dynamic"),
    "w8a8_dynamic-bias": dict(scheme="w8a8_dynamic", bias=True),
    "w8a8_static-bias": dict(scheme="w8a8_static", bias=True),
    "w4a16-group32-asym": dict(scheme="w4a16", group_size=32, asym=True),
    "w4a16-group64-sym-bias": dict(scheme="w4a16", group_size=64, bias=True),
    "w4a16-per-channel": dict(scheme="w4a16"),
    "w8a16-per-channel-asym": dict(scheme="w8a16", asym=True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", LINEAR_CASES)
def test_linear_matches_reference(npu_backend, case, dtype):
    """bf16 and fp16 compute hit different rows of the ops' documented dtype tables (bias/scale dtypes)."""
    opts = LINEAR_CASES[case]
    w = quantized_linear(out_features=96, in_features=128, **opts)
    x = (torch.randn(7, 128) * 2).to(dtype)
    prepared = npu_backend.prepare_linear(w, dtype)
    expected = reference.linear(x, reference.prepare_linear(w))
    got = npu_backend.linear(x, prepared)
    assert got.dtype == dtype and got.shape == (7, 96)
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_w8a8_static_asymmetric_input_folds_offset_into_quant_bias(npu_backend):
    """npu_quantize adds the offset before rounding (result = x / scale + zero_points), so the expectation is
    written from that formula: y = ((q - zp) * s) @ W^T + bias with q = clamp(round(x / s + zp))."""
    w = quantized_linear("w8a8_static", 96, 128, asym=True, bias=True)
    w.zero_point = None  # activations asymmetric, weights symmetric
    x = (torch.randn(7, 128) * 2).to(DTYPE)
    s, zp = w.input_scale.float(), w.input_zero_point.float()
    q = (x.float() / s + zp).round().clamp(-128, 127)
    expected = ((q - zp) * s) @ reference.dequantize_weight(w).T + w.bias.float()
    got = npu_backend.linear(x, npu_backend.prepare_linear(w, DTYPE))
    torch.testing.assert_close(got.float(), expected.to(DTYPE).float(), rtol=1e-2, atol=1e-2)


def test_w8a8_weights_are_nz_kn_and_weight_only_stays_nd(npu_backend):
    w8a8 = npu_backend.prepare_linear(quantized_linear("w8a8_dynamic", 48, 64), DTYPE)
    assert w8a8.weight.shape == (64, 48) and get_npu_format(w8a8.weight) == 29
    w4 = npu_backend.prepare_linear(quantized_linear("w4a16", 48, 64, group_size=32), DTYPE)
    assert w4.weight.dtype == torch.int32 and w4.weight.shape == (64, 48 // 8)
    assert get_npu_format(w4.weight) == 2 and w4.scale.shape == (2, 48)


def test_backend_rejects_what_the_ops_do_not_document(npu_backend):
    with pytest.raises(UnsupportedError, match="group size"):
        npu_backend.prepare_linear(quantized_linear("w4a16", 16, 96, group_size=48), DTYPE)
    with pytest.raises(UnsupportedError, match="w4a8_dynamic"):
        npu_backend.prepare_linear(quantized_linear("w4a8_dynamic", 16, 64), DTYPE)
    with pytest.raises(UnsupportedError, match="bfloat16"):
        npu_backend.prepare_linear(quantized_linear("w8a8_dynamic", 16, 64), torch.float32)


def test_emulator_enforces_documented_contracts(npu_backend):
    import torch_npu  # the emulator, installed by the fixture

    x = torch.randn(4, 64).to(DTYPE)
    w = torch.randint(-8, 8, (64, 32), dtype=torch.int8)
    scale = torch.ones(1, 32, dtype=DTYPE)
    with pytest.raises(EmulatedContractError, match="graph mode"):
        torch_npu.npu_weight_quant_batchmatmul(x, torch_npu.npu_format_cast(w, 29), scale)
    with pytest.raises(EmulatedContractError, match="multiple of 32"):
        torch_npu.npu_weight_quant_batchmatmul(x, w, torch.ones(4, 32, dtype=DTYPE), antiquant_group_size=16)
    with pytest.raises(EmulatedContractError, match="dtype"):
        torch_npu.npu_weight_quant_batchmatmul(x, w, scale.float())
    with pytest.raises(EmulatedContractError, match="x1 dtype"):
        torch_npu.npu_quant_matmul(x, w, torch.ones(32), output_dtype=DTYPE)
    # fp16 output without pertoken needs int32 bias
    with pytest.raises(EmulatedContractError, match="combination"):
        torch_npu.npu_quant_matmul(
            w.t()[:4].contiguous(), w, torch.ones(32), bias=torch.ones(32), output_dtype=torch.float16
        )
    with pytest.raises(EmulatedContractError, match="int4 range"):
        torch_npu.npu_convert_weight_to_int4pack(torch.full((8, 8), 9, dtype=torch.int32))


def paged_case(block_size: int, seed: int = 0):
    """A mixed batch: a fresh prefill, a prefill chunk after a cached prefix, two decodes; GQA 8 heads / 2
    kv."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    q_lens, seq_lens = [5, 3, 1, 1], [5, 140, 9, 130]
    num_blocks = 12
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        need = -(-n // block_size)
        tables[s, :need] = perm[used : used + need].int()
        used += need
    total = sum(seq_lens)
    slots = torch.cat(
        [
            tables[s].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
            for s, n in enumerate(seq_lens)
        ]
    )
    keys = torch.randn(total, num_kv_heads, head_dim, generator=g).to(DTYPE)
    values = torch.randn(total, num_kv_heads, head_dim, generator=g).to(DTYPE)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(DTYPE)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        k_cache,
        v_cache,
        keys,
        values,
        slots,
        query,
        tables,
        starts,
        torch.tensor(seq_lens, dtype=torch.int32),
    )


def test_paged_attention_matches_reference_mixed_batch(npu_backend):
    k_cache, v_cache, keys, values, slots, query, tables, starts, seq_lens = paged_case(block_size=128)
    npu_backend.write_kv_cache(keys, values, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv_cache(keys, values, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    scale = 32**-0.5
    got = npu_backend.paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, scale)
    expected = reference.paged_attention(query, ref_k, ref_v, tables, starts, seq_lens, scale)
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_paged_attention_needs_block_size_128(npu_backend):
    k_cache, v_cache, keys, values, slots, query, tables, starts, seq_lens = paged_case(block_size=16)
    with pytest.raises(UnsupportedError, match="--block-size 128"):
        npu_backend.paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, 0.1)
    import torch_npu  # the emulator: the op itself rejects Q_S > 1 page attention with 16-token blocks

    with pytest.raises(EmulatedContractError, match="multiple of 128"):
        torch_npu.npu_fused_infer_attention_score(
            query,
            k_cache.flatten(2),
            v_cache.flatten(2),
            atten_mask=npu_backend.attention.causal_mask(),
            block_table=tables,
            actual_seq_lengths=starts[1:].tolist(),
            actual_seq_lengths_kv=seq_lens.tolist(),
            num_heads=8,
            num_key_value_heads=2,
            input_layout="TND",
            block_size=16,
            sparse_mode=3,
        )


MOE_CASES = {
    "dense": dict(scheme="dense"),
    "w8a8_dynamic": dict(scheme="w8a8_dynamic"),
    "w8a8_static": dict(scheme="w8a8_static"),
    "w4a16-group32-asym": dict(scheme="w4a16", group_size=32, asym=True),
    "w8a16": dict(scheme="w8a16"),
}


def expert_weights(case: dict, num_experts: int, hidden: int, inter: int):
    def make(out_features, in_features, seed):
        if case["scheme"] == "dense":
            g = torch.Generator().manual_seed(seed)
            return QuantLinearWeights(
                "dense", (torch.randn(out_features, in_features, generator=g) * 0.05).to(DTYPE)
            )
        return quantized_linear(out_features=out_features, in_features=in_features, seed=seed, **case)

    gate = [make(inter, hidden, 3 * e) for e in range(num_experts)]
    up = [make(inter, hidden, 3 * e + 1) for e in range(num_experts)]
    down = [make(hidden, inter, 3 * e + 2) for e in range(num_experts)]
    return gate, up, down


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_matches_reference(npu_backend, case):
    num_experts, hidden, inter, top_k = 16, 64, 64, 4
    gate, up, down = expert_weights(MOE_CASES[case], num_experts, hidden, inter)
    x = torch.randn(11, hidden).to(DTYPE)
    logits = torch.randn(11, num_experts).to(DTYPE)
    weights, ids = npu_backend.select_experts(logits, top_k, renormalize=False)
    ref_weights, ref_ids = reference.select_experts(logits, top_k, renormalize=False)
    assert torch.equal(ids, ref_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(weights, ref_weights)
    got = npu_backend.moe_experts(x, weights, ids, npu_backend.prepare_experts(gate, up, down, DTYPE))
    expected = reference.moe_experts(x, ref_weights, ref_ids, reference.prepare_experts(gate, up, down))
    # bf16 outputs. The static path quantizes the bf16 down-proj input with a fixed scale, so a 1-ulp
    # difference in gate/up (int32-exact accumulation here, fp32 dequantized matmul in the reference) can move
    # it one level.
    tolerance = (0.05 if case == "w8a8_static" else 0.02) * expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tolerance)

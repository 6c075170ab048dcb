"""Kernel backends against independent math: reference vs hand-written dequant, every backend vs reference,
paged attention vs SDPA over contiguous K/V, MoE vs a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from native_support import needs_native, skip_without_native

from ascq.core.errors import AscqError, UnsupportedError
from ascq.kernels import WEIGHT_BITS, QuantLinearWeights, cpu, get_backend, merge_output_dim

# run here on CPU tensors; cuda's GPU-only ops are checked by benchmarks/cuda_check.py
FAST_BACKENDS = (
    "cpu",
    "cuda",
)
FP8 = torch.float8_e4m3fn

# (scheme, out, in, group_size, symmetric): odd sizes, groups the fast kernels lack, asymmetric zero points
LINEAR_CASES = [
    ("dense", 48, 64, None, True),
    ("dense", 40, 200, None, True),
    ("w8a8_dynamic", 48, 256, None, True),
    ("w8a8_dynamic", 40, 200, None, False),
    ("w8a8_dynamic", 32, 384, 128, True),
    ("w8a8_static", 48, 64, None, True),
    ("w8a8_static", 40, 200, None, False),
    ("w4a16", 48, 256, 32, True),
    ("w4a16", 40, 384, 128, False),
    ("w4a16", 32, 256, None, True),
    ("w4a16", 40, 200, 40, False),
    ("w4a16", 24, 200, None, True),
    ("w4a16", 37, 320, 64, False),
    (
        "w4a16",
        24,
        4160,
        None,
        False,
    ),  # per channel wider than the native kernel's largest group: replicated scales
    ("w8a16", 48, 256, None, True),
    ("w8a16", 40, 200, None, False),
    ("w8a16", 32, 384, 64, True),
    ("w8a16", 37, 320, None, False),
    ("w8a16", 24, 4160, 4160, True),  # per channel wider than the native kernel's largest 8-bit group
    ("w4a8_dynamic", 48, 256, None, True),
    ("w4a8_dynamic", 40, 200, None, True),
]
NUM_ROWS = (1, 5, 70, 260)  # crosses the cpu backend's per-M kernel thresholds


def make_weights(scheme, out_features, in_features, group_size=None, symmetric=True, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(out_features, generator=gen) * 0.1 if bias else None
    if scheme == "dense":
        return QuantLinearWeights(
            "dense", torch.randn(out_features, in_features, generator=gen) * 0.05, bias=b
        )
    half = 2 ** (WEIGHT_BITS[scheme] - 1)
    num_groups = 1 if group_size is None else in_features // group_size
    q = torch.randint(-half, half, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, num_groups, generator=gen) * 0.01 + 0.002
    zero = (
        None
        if symmetric
        else torch.randint(-half, half, (out_features, num_groups), generator=gen).to(torch.int8)
    )
    static = scheme == "w8a8_static"
    return QuantLinearWeights(
        scheme,
        q,
        weight_scale=scale,
        zero_point=zero,
        group_size=group_size,
        input_scale=torch.tensor([0.02]) if static else None,
        input_zero_point=torch.tensor([5], dtype=torch.int8) if static and not symmetric else None,
        bias=b,
    )


def independent_linear(x: torch.Tensor, w: QuantLinearWeights) -> torch.Tensor:
    """x @ dequant(w).T in float64, written without the kernels' helpers."""
    x = x.double()
    if w.scheme == "dense":
        weight = w.weight.double()
    else:
        out_features, in_features = w.weight.shape
        num_groups = w.weight_scale.shape[1]
        q = w.weight.double().reshape(out_features, num_groups, in_features // num_groups)
        zero = 0 if w.zero_point is None else w.zero_point.double()[:, :, None]
        weight = ((q - zero) * w.weight_scale.double()[:, :, None]).reshape(out_features, in_features)
    if w.scheme in ("w8a8_dynamic", "w4a8_dynamic"):
        step = torch.stack([row.abs().max() for row in x]).clamp(min=1e-12)[:, None] / 127
        x = torch.clamp(torch.round(x / step), -128, 127) * step
    elif w.scheme == "w8a8_static":
        step, zp = float(w.input_scale), 0 if w.input_zero_point is None else int(w.input_zero_point)
        x = (torch.clamp(torch.round(x / step) + zp, -128, 127) - zp) * step
    y = x @ weight.T
    return y if w.bias is None else y + w.bias.double()


def rel_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize(
    "case", LINEAR_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-g{c[3]}-{'sym' if c[4] else 'asym'}"
)
def test_reference_linear_matches_independent_dequant(case):
    scheme, out_features, in_features, group_size, symmetric = case
    w = make_weights(scheme, out_features, in_features, group_size, symmetric)
    ref = get_backend("reference")
    x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(1))
    y = ref.linear(x, ref.prepare_linear(w, torch.float32))
    assert y.dtype == torch.float32 and y.shape == (7, out_features)
    assert rel_error(y, independent_linear(x, w)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize(
    "case", LINEAR_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-g{c[3]}-{'sym' if c[4] else 'asym'}"
)
def test_backend_linear_matches_reference(case, backend, dtype):
    scheme, out_features, in_features, group_size, symmetric = case
    w = make_weights(scheme, out_features, in_features, group_size, symmetric)
    if dtype == torch.bfloat16 and scheme == "dense":
        w.weight = w.weight.bfloat16()
    ref, fast = get_backend("reference"), get_backend(backend)
    prepared_ref, prepared = ref.prepare_linear(w, dtype), fast.prepare_linear(w, dtype)
    for num_rows in NUM_ROWS:
        x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows)).to(dtype)
        y = fast.linear(x, prepared)
        assert y.dtype == dtype and y.shape == (num_rows, out_features)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel_error(y, ref.linear(x, prepared_ref)) < tolerance, f"M={num_rows}"
    x3 = torch.randn(2, 3, in_features).to(dtype)  # leading dims are flattened and restored
    assert fast.linear(x3, prepared).shape == (2, 3, out_features)


def test_cpu_linear_works_after_use_under_inference_mode():
    """The engine runs under inference mode; buffers it grows must stay usable outside it."""
    cpu = get_backend("cpu")
    # larger than any other layer in this file: grows the workspace
    w = make_weights("dense", 64, 2048, seed=3)
    w.weight = w.weight.bfloat16()
    prepared = cpu.prepare_linear(w, torch.bfloat16)
    x = torch.randn(300, 2048).bfloat16()  # bf16 at large M runs through the fp32 workspace
    with torch.inference_mode():
        inside = cpu.linear(x, prepared)
    outside = cpu.linear(x, prepared)
    assert torch.equal(inside, outside)


@pytest.mark.parametrize(
    "scheme, group_size, dtype, kernel",
    [
        ("w4a16", 32, torch.bfloat16, "native"),
        ("w4a16", None, torch.bfloat16, "native"),
        ("w4a16", 32, torch.float32, "dequant"),
        ("w8a16", None, torch.bfloat16, "native"),
        ("w8a16", 64, torch.bfloat16, "native"),
        ("w8a8_dynamic", None, torch.float32, "native_int8"),
        ("w8a8_static", None, torch.bfloat16, "native_int8"),
        ("w4a8_dynamic", None, torch.bfloat16, "native_int8"),
        ("w8a8_dynamic", 64, torch.bfloat16, "dequant"),
    ],
)
def test_cpu_backend_picks_the_fast_kernels(scheme, group_size, dtype, kernel):
    """The comparisons above only prove speed-ups if the fast kernels are the ones that ran."""
    if kernel.startswith("native"):
        skip_without_native()
    w = make_weights(scheme, 64, 256, group_size)
    prepared = get_backend("cpu").prepare_linear(w, dtype)
    assert prepared.kernel == kernel
    assert prepared.weights.weight.is_meta  # no second reference to the checkpoint's weight
    if WEIGHT_BITS[scheme] == 4 and kernel != "dequant":
        assert prepared.weight is None  # 4-bit kernels keep only their packed copy


@pytest.mark.parametrize(
    ("scheme", "group_size", "symmetric", "kernel"),
    [("w4a16", 64, False, "int4pack"), ("w8a16", None, True, "int8pack")],
)
def test_weight_only_falls_back_to_torch_kernels_without_the_native_kernel(
    monkeypatch, scheme, group_size, symmetric, kernel
):
    """Where the native kernel cannot build (no compiler, no AVX2), torch's int4pack / int8pack kernels
    serve bf16."""
    from ascq.kernels import native

    monkeypatch.setattr(native, "load", lambda: None)
    cpu, ref = get_backend("cpu"), get_backend("reference")
    w = make_weights(scheme, 48, 256, group_size, symmetric=symmetric)
    prepared = cpu.prepare_linear(w, torch.bfloat16)
    assert prepared.kernel == kernel
    for num_rows in (1, 260):
        x = torch.randn(num_rows, 256).bfloat16()
        assert rel_error(cpu.linear(x, prepared), ref.linear(x, ref.prepare_linear(w, torch.bfloat16))) < 2e-2


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_native_packing_round_trips_and_builds_into_its_cache_dir(tmp_path, bits):
    import os
    import subprocess
    import sys

    from ascq.kernels import native

    low, high = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (13, 96), dtype=torch.int8)  # 13: the last tile of 8 features is padded
    scales = torch.rand(13, 3)
    packed = native.pack(q, bits, scales, None, 32)
    assert packed.data.shape == (2, 96 * bits) and packed.data.dtype == torch.uint8
    assert torch.equal(native.unpack_into(packed, torch.empty(13, 96)), q.float())
    lib, threads = native.load(), torch.get_num_threads()
    x = torch.randn(3, 96).bfloat16()
    try:
        torch.set_num_threads(1)
        one_thread = native.weight_only_mm(lib, x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, native.weight_only_mm(lib, x, packed))  # tiles split, never sums
    rows = torch.cat([native.weight_only_mm(lib, x[i : i + 1], packed) for i in range(3)])
    assert torch.equal(one_thread, rows)  # a row's result does not depend on the other rows
    torch.testing.assert_close(
        one_thread, x.float() @ (q.float() * scales.repeat_interleave(32, 1)).T, rtol=1e-3, atol=1e-2
    )
    code = "from ascq.kernels import native; assert native.load() is not None"
    env = {**os.environ, "ASCQ_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    builds = sorted(f.name.split("-")[1] for f in tmp_path.iterdir())
    assert all(f.suffix == ".so" for f in tmp_path.iterdir())  # no temporary file left behind
    assert builds == sorted({"avx2", native.variant()})  # the AVX2 build reads the CPU, then the chosen one
    env["ASCQ_NATIVE_KERNELS"] = "0"
    code = "from ascq.kernels import native; assert native.load() is None"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def int8_activation_product(x, q, scales, zeros, group_size):
    """Plain torch: each row rounded to int8 per group (scale max|x| / 127, half to even), exact integer sums
    per group (float64), then the weight and activation scales."""
    num_rows, k = x.shape
    groups = x.float().view(num_rows, k // group_size, group_size)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    xq = torch.clamp(torch.round(groups * (1 / scale)), -127, 127).double()
    w = q.double().view(q.shape[0], k // group_size, group_size)
    if zeros is not None:
        w = w - zeros.double()[..., None]
    sums = torch.einsum("mgk,ngk->mng", xq, w)
    return (sums * scale[..., 0].double()[:, None, :] * scales.double()[None]).sum(-1).float()


@needs_native
@pytest.mark.parametrize(("group_size", "zeros"), [(32, False), (64, True), (96, True), (128, False)])
def test_native_int4_kernel_with_int8_activations_is_the_integer_product(group_size, zeros):
    from ascq.kernels import native

    torch.manual_seed(group_size)
    n, k = 21, 4 * group_size  # 21: a padded last tile
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scales = torch.rand(n, k // group_size) * 0.01 + 1e-3
    zero_points = torch.randint(-8, 8, (n, k // group_size)).float() if zeros else None
    packed = native.pack(q, 4, scales, zero_points, group_size)
    x = torch.randn(9, k).bfloat16()
    x[:, 5] *= 40  # an outlier channel: its group's scale, not the row's, coarsens
    x[3] = 0  # an all-zero row
    y = native.weight_only_mm(None, x, packed, activation_bits=8)
    expected = int8_activation_product(x, q, scales, zero_points, group_size)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    pairs = [native.weight_only_mm(None, x[i : i + 2], packed, activation_bits=8) for i in range(0, 9, 2)]
    rows = torch.cat(pairs)
    assert torch.equal(rows, y)  # a row's result does not depend on the other rows


@pytest.mark.parametrize(
    ("bits", "weight_zeros", "input_zero_point"),
    [(8, False, None), (8, True, None), (8, True, 0), (8, False, 5), (4, False, None), (4, True, None)],
    ids=["w8-dynamic", "w8-zp-dynamic", "w8-zp-static", "w8-static-zp", "w4-dynamic", "w4-zp-dynamic"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@needs_native
def test_native_int8_activation_kernel_is_the_integer_product(bits, weight_zeros, input_zero_point, dtype):
    """W8A8 / W4A8 on the native kernel: the integers of `integer_activations` (per token, or per tensor with
    a zero point) times the weight's, summed exactly (float64 here), times the weight and input scales."""
    from ascq.core.qmath import quantize_per_token, quantize_static_input
    from ascq.kernels import native

    torch.manual_seed(bits + 3 * weight_zeros)
    n, k = 21, 1536  # 21: a padded last tile; 1536: SmolLM2's down_proj input
    low, high = (-128, 128) if bits == 8 else (-8, 8)
    q = torch.randint(low, high, (n, k), dtype=torch.int8)
    scales = torch.rand(n, 1) * 0.01 + 1e-3
    zeros = torch.randint(low // 2, high // 2, (n, 1)).float() if weight_zeros else None
    group = cpu.native_per_channel_group_size(k, bits)
    repeats = k // group
    packed = native.pack(
        q,
        bits,
        scales.repeat_interleave(repeats, 1),
        None if zeros is None else zeros.repeat_interleave(repeats, 1),
        group,
    )
    x = (torch.randn(9, k) * 2).to(dtype)
    x[:, 7] *= 30  # an outlier channel sets its row's scale
    x[3] = 0  # an all-zero row
    if input_zero_point is None:
        v, x_scale = quantize_per_token(x)
        y = native.int8_activation_mm(None, x, packed)
    else:
        x_scale = torch.tensor(0.03)
        zp = torch.tensor(float(input_zero_point))
        v = quantize_static_input(x, x_scale, zp) - zp
        y = native.int8_activation_mm(None, x, packed, 0.03, input_zero_point)
    weight = q.double() - (0 if zeros is None else zeros.double())
    expected = (v.double() @ weight.T) * scales.double().T * x_scale.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
    rows = torch.cat(
        [
            native.int8_activation_mm(
                None, x[i : i + 2], packed, *(() if input_zero_point is None else (0.03, input_zero_point))
            )
            for i in range(0, 9, 2)
        ]
    )
    assert torch.equal(rows, y)  # a row's result does not depend on the other rows


@needs_native
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "per-tensor"])
def test_native_int8_activations_are_the_schemes_integers(static):
    """Through an identity weight (scale 1) the kernel's output is each integer times its row's scale: the
    rounding is qmath's, bit for bit, ties and the clamp included."""
    from ascq.core.qmath import quantize_per_token, quantize_static_input
    from ascq.kernels import native

    k = 64
    x = torch.randn(6, k) * 3
    x[0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.0, -128.6, 400.0]) * 0.02  # ties, the clamp
    packed = native.pack(torch.eye(k, dtype=torch.int8), 8, torch.ones(k, 1), None, k)
    if static:
        v, scale = quantize_static_input(x, torch.tensor(0.02), torch.tensor(-3.0)) + 3, torch.tensor(0.02)
        y = native.int8_activation_mm(None, x, packed, 0.02, -3)
    else:
        v, scale = quantize_per_token(x)
        y = native.int8_activation_mm(None, x, packed)
    assert torch.equal(y, v * scale)


@needs_native
@pytest.mark.parametrize("scheme", ["w8a8_dynamic", "w8a8_static", "w4a8_dynamic"])
def test_cpu_backend_runs_int8_activations_natively_below_its_threshold_and_on_fbgemm_from_there(
    monkeypatch, scheme
):
    from ascq.kernels import native

    w = make_weights(scheme, 64, 256, symmetric=scheme != "w8a8_static")
    prepared = cpu.prepare_linear(w, torch.float32)
    assert prepared.kernel == "native_int8" and prepared.weight is None  # no int8 copy beside the packed two
    x = torch.randn(cpu.NATIVE_INT8_MAX_M + 2, 256)
    rows = x[: cpu.NATIVE_INT8_MAX_M - 1]
    on_native = cpu.linear(rows, prepared)
    kernel = native.int8_activation_mm(
        None, rows, prepared.packed, prepared.input_scale, prepared.input_zero_point
    )
    assert torch.equal(on_native, kernel + prepared.bias)
    monkeypatch.setattr(cpu, "NATIVE_INT8_MAX_M", 1)
    # the same integer products; only where the scales round differs (fbgemm: int8 activations in two GEMMs)
    assert rel_error(cpu.linear(rows, prepared), on_native) < 1e-6
    reference = get_backend("reference")
    expected = reference.linear(x, reference.prepare_linear(w, torch.float32))
    assert rel_error(cpu.linear(x, prepared), expected) < 1e-5


@needs_native
def test_cpu_backend_takes_int8_activations_for_4_bit_products_of_several_rows(monkeypatch):
    from ascq.kernels import native

    w = make_weights("w4a16", 64, 256, 64, True)
    prepared = cpu.prepare_linear(w, torch.bfloat16)
    assert prepared.kernel == "native"
    monkeypatch.setattr(cpu, "BF16_GEMM_FAST", False)
    x = torch.randn(cpu.W4_A8_MIN_M + 3, 256).bfloat16()
    int8 = (native.weight_only_mm(None, x, prepared.packed, activation_bits=8) + prepared.bias).bfloat16()
    int16 = (native.weight_only_mm(None, x, prepared.packed) + prepared.bias).bfloat16()
    assert not torch.equal(int8, int16)
    monkeypatch.setattr(cpu, "W4_ACTIVATION_BITS", 8)
    assert torch.equal(cpu.linear(x, prepared), int8)
    assert torch.equal(cpu.linear(x[:1], prepared), int16[:1])  # one row: the 16-bit kernel
    monkeypatch.setattr(cpu, "W4_ACTIVATION_BITS", 16)
    assert torch.equal(cpu.linear(x, prepared), int16)
    reference = get_backend("reference")
    expected = reference.linear(x, reference.prepare_linear(w, torch.bfloat16))
    assert rel_error(int8.float(), expected.float()) < 2e-2


def test_merge_output_dim_equals_separate_linears():
    parts = [make_weights("w4a16", n, 256, 64, False, seed=n) for n in (32, 16, 16)]
    ref = get_backend("reference")
    x = torch.randn(3, 256)
    merged = ref.linear(x, ref.prepare_linear(merge_output_dim(parts)))
    separate = torch.cat([ref.linear(x, ref.prepare_linear(p)) for p in parts], dim=-1)
    torch.testing.assert_close(merged, separate)


def test_invalid_weights_and_devices_raise_clear_errors():
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(UnsupportedError, match="w3a16"):
        QuantLinearWeights("w3a16", q, torch.ones(8, 1))
    with pytest.raises(AscqError, match="weight_scale shape"):
        QuantLinearWeights("w4a16", q, torch.ones(8, 3), group_size=32)
    with pytest.raises(AscqError, match="group_size 48"):
        QuantLinearWeights("w4a16", q, torch.ones(8, 1), group_size=48)
    with pytest.raises(AscqError, match="input_scale"):
        QuantLinearWeights("w8a8_static", q, torch.ones(8, 1))
    with pytest.raises(AscqError, match="int8"):
        QuantLinearWeights("w8a16", q.int(), torch.ones(8, 1))
    with pytest.raises(AscqError, match=r"\[-8, 7\], got \[0, 15\]"):  # unsigned int4 by mistake
        QuantLinearWeights("w4a16", torch.arange(16, dtype=torch.int8).repeat(8, 4), torch.ones(8, 1))
    with pytest.raises(UnsupportedError, match="tpu"):
        get_backend("tpu:0")
    assert get_backend("cuda:1").__name__ == "ascq.kernels.cuda"


# ---- paged attention ------------------------------------------------------------------------------------


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def build_paged_batch(
    backend, seqs, block_size, num_kv_heads, head_dim, cache_dtype, k_scale, v_scale, seed=0
):
    """Write each sequence's full K/V through the backend into randomly placed blocks; return cache +
    metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    keys, values = [], []
    for s, (_, seq_len) in enumerate(seqs):
        table = [order.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        positions = torch.arange(seq_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        backend.write_kv_cache(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, block_tables, keys, values


def contiguous_attention(q, k, v, scale):
    """SDPA of q [Lq, H, D] (the last Lq positions) over contiguous k/v [L, Hkv, D], GQA by repetition."""
    query_len, num_heads = q.shape[:2]
    seq_len, num_kv_heads = k.shape[:2]
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
    mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - query_len)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(
        0, 1
    )


# (query_len, seq_len): decodes, a fresh prefill, prefix-cache hits / chunked prefill, a one-token sequence
MIXED_BATCH = [(1, 37), (7, 7), (1, 1), (5, 150), (1, 129), (20, 40), (1, 300)]
DECODE_BATCH = [(1, 37), (1, 1), (1, 300), (1, 129)]  # a pure decode step takes its own batched path
SHORT_BATCH = [(5, 150), (1, 37), (3, 3), (8, 20)]  # verification rows only: all run as one-token rows


@pytest.mark.parametrize("batch", [MIXED_BATCH, DECODE_BATCH, SHORT_BATCH], ids=["mixed", "decode", "short"])
@pytest.mark.parametrize("kv", ["same", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("backend", ("reference",) + FAST_BACKENDS)
def test_paged_attention_matches_contiguous_sdpa(backend, block_size, dtype, kv, batch):
    num_heads, num_kv_heads, head_dim, scale = 8, 2, 32, 32**-0.5
    k_scale, v_scale = (0.5, 0.25) if kv == "fp8" else (1.0, 1.0)
    cache_dtype = FP8 if kv == "fp8" else dtype
    kernels = get_backend(backend)
    k_cache, v_cache, block_tables, keys, values = build_paged_batch(
        kernels, batch, block_size, num_kv_heads, head_dim, cache_dtype, k_scale, v_scale
    )
    query_lens = [q for q, _ in batch]
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(9))
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for _, n in batch], dtype=torch.int32)
    out = kernels.paged_attention(
        query.to(dtype), k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale
    )
    assert out.dtype == dtype and out.shape == query.shape
    for s, (query_len, _) in enumerate(batch):
        k, v = keys[s], values[s]
        if kv == "fp8":
            k, v = fp8_round_trip(k, k_scale), fp8_round_trip(v, v_scale)
        elif dtype == torch.bfloat16:
            k, v = k.bfloat16().float(), v.bfloat16().float()
        rows = slice(int(query_start_loc[s]), int(query_start_loc[s]) + query_len)
        expected = contiguous_attention(query[rows].to(dtype).float(), k, v, scale)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel_error(out[rows], expected) < tolerance, f"sequence {s}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_chunk_rows_equal_each_token_decoded_alone(dtype):
    """cpu backend (native decode kernel, each row reduced alone): a speculative verification chunk (5 query
    rows ending at context 150) gets, row by row, bit for bit the attention each token gets when decoded
    alone, so verification never changes a greedy token. (torch's padded batched path, cuda's, is close but
    not bitwise: the mixed/short cases above check it.)"""
    backend = "cpu"
    num_heads, num_kv_heads, head_dim, scale, chunk, context = 9, 3, 64, 0.125, 5, 150
    kernels = get_backend(backend)
    k_cache, v_cache, block_tables, _, _ = build_paged_batch(
        kernels, [(chunk, context)], 16, num_kv_heads, head_dim, dtype, 1.0, 1.0
    )
    query = torch.randn(chunk, num_heads, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    together = kernels.paged_attention(
        query, k_cache, v_cache, block_tables, torch.tensor([0, chunk]), torch.tensor([context]), scale
    )
    for i in range(chunk):
        alone = kernels.paged_attention(
            query[i : i + 1],
            k_cache,
            v_cache,
            block_tables,
            torch.tensor([0, 1]),
            torch.tensor([context - chunk + 1 + i]),
            scale,
        )
        assert torch.equal(together[i : i + 1], alone), f"row {i}"


@pytest.mark.parametrize("native_available", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, FP8], ids=str)
def test_cpu_decode_attention_native_and_torch_paths(monkeypatch, cache_dtype, native_available):
    """The cpu backend's decode rows: the native kernel reads the cache in place (torch's path must not run),
    or torch's gather path where the kernel cannot build; both against contiguous SDPA."""
    from ascq.kernels import native, paged_sdpa

    cpu = get_backend("cpu")
    if native_available:
        skip_without_native()

        def must_not_run(*args):
            raise AssertionError("torch decode path used although the native kernel is available")

        monkeypatch.setattr(paged_sdpa, "_attend_decode", must_not_run)
    else:
        monkeypatch.setattr(native, "load", lambda: None)
    num_heads, num_kv_heads, head_dim, scale, k_scale, v_scale = 12, 3, 40, 0.15, 0.5, 0.25
    dtype = torch.float32 if cache_dtype in (torch.float32, FP8) else cache_dtype
    k_cache, v_cache, block_tables, keys, values = build_paged_batch(
        cpu, DECODE_BATCH, 16, num_kv_heads, head_dim, cache_dtype, k_scale, v_scale
    )
    query = torch.randn(len(DECODE_BATCH), num_heads, head_dim).to(dtype)
    seq_lens = torch.tensor([n for _, n in DECODE_BATCH], dtype=torch.int32)
    query_start_loc = torch.arange(len(DECODE_BATCH) + 1, dtype=torch.int32)
    out = cpu.paged_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale
    )
    assert out.dtype == dtype
    for s in range(len(DECODE_BATCH)):
        if cache_dtype == FP8:
            k, v = fp8_round_trip(keys[s], k_scale), fp8_round_trip(values[s], v_scale)
        else:
            k, v = keys[s].to(cache_dtype).float(), values[s].to(cache_dtype).float()
        expected = contiguous_attention(query[s : s + 1].float(), k, v, scale)
        assert rel_error(out[s : s + 1], expected) < (1e-5 if dtype == torch.float32 else 2e-2), (
            f"sequence {s}"
        )


@needs_native
def test_native_decode_attention_rejects_block_ids_outside_the_cache():
    from ascq.kernels import native

    lib = native.load()
    cache = torch.zeros(4, 16, 2, 32)
    query = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="out of range"):
        native.paged_decode_attention(
            lib,
            query,
            cache,
            cache,
            torch.tensor([[1, 4]], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32),
            0.2,
            1.0,
            1.0,
        )
    with pytest.raises(ValueError, match="out of range"):  # longer than its block table
        native.paged_decode_attention(
            lib,
            query,
            cache,
            cache,
            torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([17], dtype=torch.int32),
            0.2,
            1.0,
            1.0,
        )


@pytest.mark.parametrize("backend", ("reference",) + FAST_BACKENDS)
def test_fp8_cache_stores_scaled_values_and_leaves_other_slots(backend):
    kernels = get_backend(backend)
    k_cache = torch.zeros(4, 16, 2, 8, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 8) * 100  # some values exceed fp8's range after scaling and must saturate
    value = torch.randn(3, 2, 8)
    slots = torch.tensor([5, 16, 63])
    kernels.write_kv_cache(key, value, k_cache, v_cache, slots, 0.1, 2.0)
    flat_k, flat_v = k_cache.view(-1, 2, 8).float(), v_cache.view(-1, 2, 8).float()
    torch.testing.assert_close(flat_k[slots], (key / 0.1).clamp(-448, 448).to(FP8).float())
    torch.testing.assert_close(flat_v[slots], (value / 2.0).to(FP8).float())
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


# ---- MoE --------------------------------------------------------------------------------------------------


def test_select_experts_is_softmax_top_k():
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(3))
    for renormalize in (False, True):
        weights, ids = get_backend("reference").select_experts(logits, 4, renormalize)
        for t in range(6):
            probs = torch.exp(logits[t].double() - logits[t].double().max())
            probs /= probs.sum()
            expected_ids = sorted(range(16), key=lambda e: -probs[e])[:4]
            assert ids[t].tolist() == expected_ids
            expected = probs[expected_ids] / (probs[expected_ids].sum() if renormalize else 1)
            torch.testing.assert_close(weights[t].double(), expected, rtol=1e-6, atol=1e-7)


def make_experts(scheme, num_experts, hidden, intermediate, group_size=None):
    def one(out_f, in_f, seed):
        return make_weights(scheme, out_f, in_f, group_size, True, bias=False, seed=seed)

    gate = [one(intermediate, hidden, 3 * e) for e in range(num_experts)]
    up = [one(intermediate, hidden, 3 * e + 1) for e in range(num_experts)]
    down = [one(hidden, intermediate, 3 * e + 2) for e in range(num_experts)]
    return gate, up, down


@pytest.mark.parametrize("scheme", ["dense", "w4a16", "w8a8_dynamic"])
def test_reference_moe_matches_per_token_loop(scheme):
    gate, up, down = make_experts(scheme, 8, 64, 32, group_size=32 if scheme == "w4a16" else None)
    ref = get_backend("reference")
    x = torch.randn(5, 64)
    weights, ids = ref.select_experts(torch.randn(5, 8), 3, renormalize=False)
    y = ref.moe_experts(x, weights, ids, ref.prepare_experts(gate, up, down, torch.float32))
    for t in range(5):
        expected = torch.zeros(64, dtype=torch.float64)
        for k in range(3):
            e = int(ids[t, k])
            h = F.silu(independent_linear(x[t : t + 1], gate[e])) * independent_linear(x[t : t + 1], up[e])
            expected += float(weights[t, k]) * independent_linear(h.float(), down[e])[0]
        assert rel_error(y[t], expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", ["dense", "w4a16", "w8a16", "w8a8_dynamic", "w4a8_dynamic"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_backend_moe_matches_reference(backend, scheme, dtype):
    gate, up, down = make_experts(scheme, 16, 256, 128, group_size=128 if scheme == "w4a16" else None)
    if scheme == "dense":
        for w in gate + up + down:
            w.weight = w.weight.to(dtype)
    ref, fast = get_backend("reference"), get_backend(backend)
    for num_tokens in (1, 37):
        x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
        weights, ids = ref.select_experts(torch.randn(num_tokens, 16), 4, renormalize=False)
        expected = ref.moe_experts(x, weights, ids, ref.prepare_experts(gate, up, down, dtype))
        y = fast.moe_experts(x, weights, ids, fast.prepare_experts(gate, up, down, dtype))
        assert y.dtype == dtype
        # int8 activations of the down projection are re-quantized from slightly different fp32 sums, so a
        # few values round to the neighbouring integer
        tolerance = {
            torch.float32: 1e-5 if scheme in ("dense", "w4a16", "w8a16") else 2e-3,
            torch.bfloat16: 3e-2,
        }
        assert rel_error(y, expected) < tolerance[dtype]


@pytest.fixture
def bf16_gemm(monkeypatch):
    """The AMX hosts' bf16 GEMM paths, forced on whatever this CPU is (torch's bf16 GEMM runs everywhere)."""
    monkeypatch.setattr(cpu, "BF16_GEMM_FAST", True)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [None, torch.int8, torch.bfloat16, torch.float32], ids=str)
def test_native_bf16_dequantization_is_torch_dequantization_rounded(bits, zeros):
    from ascq.kernels import native

    skip_without_native()
    gen = torch.Generator().manual_seed(bits)
    low, high = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (13, 128), generator=gen)  # 13: a padded last tile
    scales = torch.rand(13, 4, generator=gen) * 0.1 + 1e-3
    zero = None if zeros is None else torch.randn(13, 4, generator=gen) * 3
    if zeros is torch.int8:
        zero = zero.round()
    elif zeros is torch.bfloat16:
        zero = zero.bfloat16().float()
    packed = native.pack(q, bits, scales, zero, 32, compact=zeros is not torch.float32)
    assert (None if packed.zeros is None else packed.zeros.dtype) == zeros
    grouped = q.float().view(13, 4, 32)
    expected = (grouped if zero is None else grouped - zero[..., None]) * packed_scales(packed)[..., None]
    out = native.dequantize_bf16(None, packed, torch.empty(13, 128, dtype=torch.bfloat16))
    assert torch.equal(out, expected.view(13, 128).bfloat16())


def packed_scales(packed) -> torch.Tensor:
    """The fp32 scales [n, groups] a packed weight holds (compacted to bf16 where exact)."""
    tiles, groups, tile = packed.scales.shape
    return packed.scales.float().transpose(1, 2).reshape(tiles * tile, groups)[: packed.n]


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "dense"])
def test_bf16_gemm_paths_match_reference_and_keep_copies_within_budget(bf16_gemm, monkeypatch, scheme):
    w = make_weights(scheme, 72, 256, None if scheme == "dense" else 64, symmetric=False)
    w.weight = w.weight.bfloat16() if scheme == "dense" else w.weight
    ref = get_backend("reference")
    for budget_mb, kept in ((0, False), (1 << 30, True)):
        monkeypatch.setenv("ASCQ_BF16_WEIGHT_CACHE_MB", str(budget_mb))
        prepared = cpu.prepare_linear(w, torch.bfloat16)
        for num_rows in (1, cpu.BF16_GEMM_NATIVE_MAX_M, 100):
            x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
            y = cpu.linear(x, prepared)
            assert y.dtype == torch.bfloat16
            assert rel_error(y, ref.linear(x, ref.prepare_linear(w, torch.bfloat16))) < 2e-2, f"M={num_rows}"
        expect_copy = kept and (prepared.kernel == "native" or prepared.bf16_prepacked)
        assert (prepared.bf16_weight is not None) == expect_copy


def test_lm_head_bf16_gemm_path_matches_fp32(bf16_gemm):
    from ascq.runtime.layers.embedding import ParallelLMHead

    head = ParallelLMHead(1000, 64)
    head.weight.data = torch.randn(1000, 64).bfloat16()
    for num_rows in (1, cpu.BF16_GEMM_LM_HEAD_MIN_M, 40):
        hidden = torch.randn(num_rows, 64).bfloat16()
        logits = head(hidden)
        assert logits.dtype == torch.float32
        assert rel_error(logits, hidden.double() @ head.weight.double().T) < 1e-2


def test_bf16_copy_budget_rejects_a_bad_value(bf16_gemm, monkeypatch):
    monkeypatch.setenv("ASCQ_BF16_WEIGHT_CACHE_MB", "lots")
    with pytest.raises(AscqError, match="whole number of MiB"):
        cpu.prepare_linear(make_weights("w4a16", 72, 256, 64), torch.bfloat16)

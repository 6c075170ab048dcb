"""The native kernels' ABI lives in ascq_kernels.h alone: the .c files define what it declares, the library
exports its ASCQ_API functions, native.py's ctypes signatures and fused decode's structs are read from it; and
the build is chosen by the CPU's features, every build giving the same bits."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch
from native_support import needs_native

from ascq.kernels import native

KERNELS = Path(native.__file__).parent
HEADER = native.HEADER.read_text()


def defined_functions() -> set[str]:
    """Non-static ascq_* functions the .c files define."""
    names = set()
    for source in native.SOURCES:
        names |= set(
            re.findall(r"^(?:int|void|float) (ascq_\w+)\([^;]*?\)\s*\{", source.read_text(), re.M | re.S)
        )
    return names


def test_every_defined_function_is_declared_once_in_the_header():
    declared = re.findall(r"^(?:ASCQ_API )?(?:int|void|float) (ascq_\w+)\(", HEADER, re.M)
    assert len(declared) == len(set(declared))
    assert defined_functions() == set(declared)
    for source in native.SOURCES:
        text = source.read_text()
        assert '#include "ascq_kernels.h"' in text, source.name
        assert not re.search(r"^(?:int|void|float) ascq_\w+\([^{]*?\);", text, re.M | re.S), (
            f"{source.name} redeclares"
        )
        assert not re.search(r"\}\s*ascq_\w+;", text), f"{source.name} defines a header struct again"


def test_api_signatures_parse_from_the_header():
    api = native.parse_api(HEADER)
    assert api["ascq_bf16_mm"] == (ctypes.c_int, [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4)
    assert api["ascq_cpu_features"] == (ctypes.c_int, [])
    assert api["ascq_group_quant_errors"][1][7:10] == [ctypes.c_float] * 3
    called = set(re.findall(r"lib\.(ascq_\w+)", Path(native.__file__).read_text()))
    fused = {
        name
        for module in (KERNELS.parent / "runtime" / "worker").glob("fused_*.py")
        for name in re.findall(r"\.(ascq_\w+)\(", module.read_text())
    }
    assert {"ascq_fused_decode", "ascq_moe_route"} <= fused
    assert called | fused <= set(api)


def test_feature_bits_match_the_header_enum():
    enum = dict((name.lower(), int(bit)) for name, bit in re.findall(r"ASCQ_CPU_(\w+) = (\d+)", HEADER))
    assert enum == native.FEATURE_BITS


def test_fused_decode_structs_come_from_the_header():
    structs = native.structures()
    fields = [name for name, _ in structs["ascq_fused_model"]._fields_]
    assert fields[:3] == ["num_layers", "hidden", "num_heads"] and fields[-2:] == ["layers", "final_norm"]
    linear = structs["ascq_fused_linear"]
    # eight ints, a float and an int, four pointers: as C lays them out on x86-64
    assert ctypes.sizeof(linear) == 10 * 4 + 4 * 8
    assert dict(linear._fields_)["input_scale"] is ctypes.c_float
    layer = dict(structs["ascq_fused_layer"]._fields_)
    assert layer["qkv"] is linear
    assert layer["moe"] is ctypes.POINTER(structs["ascq_fused_moe"])  # a pointer to a header struct
    moe = dict(structs["ascq_fused_moe"]._fields_)
    assert moe["router"] is linear and moe["gate_up"] is moe["down"] is ctypes.POINTER(linear)


@pytest.mark.parametrize(
    "features, expected",
    [
        ({"avx2", "fma", "f16c"}, "avx2"),
        (set(native.VARIANTS["avx512"]), "avx512"),
        (set(native.VARIANTS["avx512"]) - {"avx512bf16"}, "avx2"),  # Zen 3 / Skylake-SP: AVX-512 without BF16
        ({"avx2", "fma"}, None),  # no F16C
        (set(), None),  # ARM, or x86 without AVX2
    ],
)
def test_the_build_is_chosen_from_the_cpu_features(features, expected):
    assert native.choose_variant(features) == expected


@needs_native
def test_the_chosen_build_matches_this_cpu():
    lib = native.load()
    features = native.features_of(lib.ascq_cpu_features())
    assert native.variant() == native.choose_variant(features)


@needs_native
def test_every_build_this_cpu_runs_gives_the_same_bits():
    lib = native.load()
    features = native.features_of(lib.ascq_cpu_features())
    builds = [v for v, needs in native.VARIANTS.items() if set(needs) <= features]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs one build only ({', '.join(builds)})")
    compiler = native.shutil.which("cc") or native.shutil.which("gcc")
    libs = [native._build(compiler, v) for v in builds]
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (40, 256), dtype=torch.int8, generator=gen)
    packed = native.pack(
        q, 4, torch.rand(40, 8, generator=gen), torch.randint(-8, 8, (40, 8), generator=gen).float(), 32
    )
    int8 = native.pack(q, 8, torch.ones(40, 1), None, 256)
    x = torch.randn(5, 256, generator=gen).bfloat16()
    weight = torch.randn(48, 256, generator=gen).bfloat16()
    cache = torch.randn(6, 16, 2, 64, generator=gen).bfloat16()
    query = torch.randn(3, 4, 64, generator=gen)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([20, 32, 7], dtype=torch.int32)
    results = [
        (
            native.weight_only_mm(lib, x, packed),
            native.bf16_mm(lib, x.float(), weight),
            native.int8_activation_mm(lib, x, packed),
            native.int8_activation_mm(lib, x.float(), int8, 0.01, 3),
            native.paged_decode_attention(lib, query, cache, cache, tables, lens, 0.125, 1.0, 1.0),
        )
        for lib in libs
    ]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))

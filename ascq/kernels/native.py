"""ascq's native CPU kernels (weight_only_mm.c: W4A16 / W8A16 and W8A8 / W4A8 matmul; bf16_mm.c:
bf16-weight matmul for small M; paged_decode_attention.c; fused_decode.c: a decoder stack's decode step in one
call; torch_cpu_ops.c: the torch reductions and MoE routing it reproduces; the converter's gptq_columns.c,
group_quant_error.c and group_fake_quant.c: GPTQ's column loop, the MSE observer's search, min-max fake
quantization and AWQ's clip search), compiled with the system C compiler on first use into one shared library
and loaded via ctypes.

No torch headers are needed (the kernels take raw pointers), so a compile takes about a second. The shared
object is cached under $ASCQ_CACHE_DIR (default ~/.cache/ascq/kernels), named by a hash of source, flags and
compiler, and written to a temporary file then renamed, so concurrent first uses never load a half-written
library. It links OpenMP by its soname, libgomp.so.1: the copy torch has already loaded is the one used, so
the kernel shares torch's thread pool; each call runs on `torch.get_num_threads()` threads.

The kernel functions take the library (None: `load()`'s). Each kernel is also a torch custom op
(`torch.ops.ascq.*`, with a fake implementation for shapes), so a decode step calling them can be captured by
`torch.compile` without graph breaks (ctypes calls cannot be traced); eager callers skip the dispatcher and
call the library directly.

`load()` returns None when ASCQ_NATIVE_KERNELS=0, and with one warning when there is no compiler, the build
fails or the CPU lacks AVX2/FMA; the cpu backend then uses torch's ops (int4pack / int8pack, paged_sdpa's
decode attention).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ascq import envs
from ascq.atomic_file import atomic_output

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "weight_only_mm.c",
        "paged_decode_attention.c",
        "bf16_mm.c",
        "fused_decode.c",
        "torch_cpu_ops.c",
        "gptq_columns.c",
        "group_quant_error.c",
        "group_fake_quant.c",
    )
]
HEADER = Path(__file__).with_name("ascq_kernels.h")  # the ABI: prototypes and structs, declared once
# included by the sources: part of the build's cache key
HEADERS = [
    HEADER,
    Path(__file__).with_name("simd.h"),
]
MAX_GROUP_SIZE = {4: 4096, 8: 2048}  # the kernel's int32 partial sums are exact up to these
COMMON_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# One build per instruction set, the same sources (AVX2 intrinsics; the compiler may use AVX-512 where
# allowed), chosen at run time from the CPU's features (`ascq_cpu_features`), best first. Results are the same
# bits.
VARIANTS = {
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16", "avx512vnni"),
    "avx2": ("avx2", "fma", "f16c"),
}
# ascq_kernels.h's ASCQ_CPU_* (tests/test_native_abi.py checks they agree)
FEATURE_BITS = {
    "avx2": 1,
    "fma": 2,
    "f16c": 4,
    "avx512f": 8,
    "avx512bw": 16,
    "avx512vl": 32,
    "avx512bf16": 64,
    "avx512vnni": 128,
}
CTYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "void": None}


def flags(variant: str) -> list[str]:
    return [*COMMON_FLAGS, *(f"-m{feature}" for feature in VARIANTS[variant])]


def choose_variant(features: set[str]) -> str | None:
    """The best build this CPU runs, or None (no AVX2 + FMA + F16C: torch's ops instead)."""
    return next((name for name, needs in VARIANTS.items() if set(needs) <= features), None)


def features_of(mask: int) -> set[str]:
    return {name for name, bit in FEATURE_BITS.items() if mask & bit}


def _c_type(declaration: str) -> Any:
    """ctypes type of a C parameter or return type: any pointer is a void pointer; int and float by value."""
    if "*" in declaration:
        return ctypes.c_void_p
    base = declaration.replace("const", "").split()[0]
    return CTYPES[base]


def parse_api(header: str) -> dict[str, tuple[Any, list[Any]]]:
    """{name: (restype, argtypes)} of every `ASCQ_API` prototype in the header text."""
    api = {}
    for ret, name, params in re.findall(r"ASCQ_API\s+(\w+)\s+(\w+)\(([^)]*)\);", header):
        args = (
            []
            if params.strip() in ("", "void")
            else [_c_type(p.rsplit(" ", 1)[0] if "*" not in p else p) for p in params.split(",")]
        )
        api[name] = (_c_type(ret), args)
    return api


def parse_structs(header: str) -> dict[str, list[tuple[str, str]]]:
    """{struct name: [(field, C type)]} of the header's `typedef struct {...} name;` definitions, in order."""
    structs = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", header, re.S):
        fields = []
        for declaration in re.sub(r"//[^\n]*", "", body).split(";"):
            declaration = declaration.strip()
            if not declaration:
                continue
            head, *rest = declaration.split(",")
            type_name, first = head.replace("const ", "").rsplit(None, 1)
            for field in [first, *rest]:
                field = field.strip()
                fields.append((field.lstrip("*"), type_name + ("*" if field.startswith("*") else "")))
        structs[name] = fields
    return structs


@functools.cache
def structures() -> dict[str, type[ctypes.Structure]]:
    """ctypes classes of the header's structs (`parse_structs`): a field of a struct type nests it, a pointer
    to one is a POINTER to it, any other pointer a void pointer."""
    classes: dict[str, type[ctypes.Structure]] = {}
    for name, fields in parse_structs(HEADER.read_text()).items():
        members = []
        for field, c_type in fields:
            base = c_type.rstrip("*")
            if base in classes:
                members.append(
                    (field, ctypes.POINTER(classes[base]) if c_type.endswith("*") else classes[base])
                )
            else:
                members.append((field, _c_type(c_type)))
        classes[name] = type(name, (ctypes.Structure,), {"_fields_": members})
    return classes


def _cache_dir() -> Path:
    """The kernel cache folder, created 0700; OSError (the library is then not loaded) when it belongs to
    another user, or when others may write to it and it cannot be made private."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ascq" / "kernels"
    folder = Path(envs.ASCQ_CACHE_DIR or default)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.geteuid():
        raise OSError(f"the kernel cache {folder} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        os.chmod(folder, stat.S_IMODE(info.st_mode) & ~0o022)
    return folder


def _trusted(library: Path) -> bool:
    """Whether a cached library may be loaded: a regular file (not a link) owned by this user that no one
    else may write; any other is rebuilt."""
    try:
        info = library.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _compile(compiler: str, variant: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [source.read_text() for source in [*SOURCES, *HEADERS]]
    key = hashlib.sha256("\0".join([*texts, *flags(variant), version]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"ascq_kernels-{variant}-{key}.so"
    if _trusted(target):
        return target
    with atomic_output(target) as tmp:
        subprocess.run(
            [compiler, *flags(variant), *map(str, SOURCES), "-o", str(tmp)],
            capture_output=True,
            text=True,
            check=True,
        )
        os.chmod(tmp, 0o700)  # `_trusted` whatever the umask
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in parse_api(HEADER.read_text()).items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def _build(compiler: str, variant: str) -> ctypes.CDLL:
    """The `variant` build, compiled on first use; OSError or CalledProcessError when it cannot be built or
    loaded."""
    return _declare(ctypes.CDLL(str(_compile(compiler, variant))))


def _build_error(exc: Exception) -> str:
    return " ".join((getattr(exc, "stderr", "") or str(exc)).split())[:200]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library built for this CPU (`variant()`), or None where it cannot run (one warning says
    why). The AVX2 build runs first to read the CPU's features; an AVX-512 CPU then loads its own build."""
    if not envs.ASCQ_NATIVE_KERNELS:
        _unavailable("ASCQ_NATIVE_KERNELS=0")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None:
        _unavailable(
            f"they need x86-64 and a C compiler; this is {platform.machine()}"
            + ("" if compiler else " without one")
        )
        return None
    try:
        lib = _build(compiler, "avx2")
    except (OSError, subprocess.CalledProcessError) as exc:
        _unavailable(f"the avx2 build failed: {_build_error(exc)}")
        return None
    features = features_of(lib.ascq_cpu_features())
    chosen = choose_variant(features)
    if chosen is None:
        _unavailable(f"this CPU lacks {', '.join(sorted(set(VARIANTS['avx2']) - features))}")
        return None
    if chosen != "avx2":
        try:
            lib = _build(compiler, chosen)
        except (OSError, subprocess.CalledProcessError) as exc:
            warnings.warn(
                f"ascq native CPU kernels: the {chosen} build failed ({_build_error(exc)}); using the avx2 "
                "build",
                stacklevel=2,
            )
            chosen = "avx2"
    _VARIANT[0] = chosen
    return lib


_VARIANT: list[str | None] = [None]
_REASON: list[str] = [""]


def variant() -> str | None:
    """The build `load()` chose ("avx512", "avx2"), or None (no native kernels)."""
    return _VARIANT[0] if load() is not None else None


def unavailable_reason() -> str | None:
    """Why `load()` gives no library (the warning's text), or None when it gives one."""
    return None if load() is not None else _REASON[0]


def _unavailable(reason: str) -> None:
    _REASON[0] = reason
    if reason != "ASCQ_NATIVE_KERNELS=0":
        warnings.warn(f"ascq native CPU kernels unavailable ({reason}); using torch's kernels", stacklevel=3)


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether `load()` gives a library; a constant to `torch.compile` (which cannot trace the build and
    load)."""
    return load() is not None


TILE = 8  # output features per tile of the weight-only layout (weight_only_mm.c)
ZERO_KINDS = {None: 0, torch.int8: 1, torch.bfloat16: 2, torch.float32: 3}  # weight_only_mm.c's zeros_kind


@dataclass
class PackedWeights:
    """A weight-only linear in weight_only_mm.c's tiled layout (`pack`)."""

    data: torch.Tensor  # uint8 [tiles, k * bits]: each tile's 8 output features, quads of 4 inputs
    bits: int
    n: int  # output features (the last tile is padded with zero weights)
    k: int
    group_size: int
    # [tiles, groups, 8]: bf16 where that holds them exactly (fewer bytes per step), else fp32
    scales: torch.Tensor
    # [tiles, groups, 8] zero points: int8, bf16 or fp32 (the most compact exact); None:
    zeros: torch.Tensor | None
    # symmetric


def _tiled(t: torch.Tensor, n_padded: int) -> torch.Tensor:
    """[n, groups] -> [tiles, groups, TILE], zero rows padding n to n_padded."""
    t = F.pad(t, (0, 0, 0, n_padded - t.shape[0]))
    return t.view(n_padded // TILE, TILE, -1).transpose(1, 2).contiguous()


def compact_qparams(t: torch.Tensor, integral: bool) -> torch.Tensor:
    """The fewest bytes that hold `t`'s values exactly: int8 (where `integral`), bf16, else fp32."""
    if integral and torch.equal(t, t.round()) and -128 <= t.min() and t.max() <= 127:
        return t.to(torch.int8)
    return t.bfloat16() if torch.equal(t.bfloat16().float(), t) else t.float()


def pack(
    q: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    compact: bool = True,
) -> PackedWeights:
    """Signed int4 / int8 values q [N, K] (K % 32 == 0), scales and zero points [N, K / group_size] (zeros
    None: symmetric) -> the kernel's layout. `compact`: qparams in the fewest bytes that hold them exactly
    (else fp32)."""
    n, k = q.shape
    n_padded = -(-n // TILE) * TILE
    # t, j, quad, h, p; two's complement bytes: int4 value + 8 (mod 256) is its offset-binary nibble
    q = F.pad(q.to(torch.int8).view(torch.uint8), (0, 0, 0, n_padded - n))
    q = q.view(n_padded // TILE, TILE, k // 4, 2, 2)
    if bits == 4:
        u = (q + 8).permute(0, 2, 1, 4, 3)  # t, quad, j, p, h
        data = u[..., 0] | (u[..., 1] << 4)
    else:
        data = q.permute(0, 2, 3, 1, 4)  # t, quad, h, j, p
    scales, zeros = scales.float(), None if zeros is None else zeros.float()
    if compact:
        scales, zeros = (
            compact_qparams(scales, False),
            None if zeros is None else compact_qparams(zeros, True),
        )
    return PackedWeights(
        data.reshape(n_padded // TILE, k * bits).contiguous(),
        bits,
        n,
        k,
        group_size,
        _tiled(scales, n_padded),
        None if zeros is None else _tiled(zeros, n_padded),
    )


def unpack_into(packed: PackedWeights, buf: torch.Tensor) -> torch.Tensor:
    """The signed values `pack` took, written into `buf` [N, K] (any float dtype)."""
    num_tiles, k = packed.data.shape[0], packed.k
    full = buf if packed.n == num_tiles * TILE else torch.empty(num_tiles * TILE, k, dtype=buf.dtype)
    out = full.view(num_tiles, TILE, k // 4, 2, 2)  # t, j, quad, h, p
    if packed.bits == 4:
        data = packed.data.view(num_tiles, k // 4, TILE, 2).transpose(1, 2)  # t, j, quad, p
        out[..., 0, :].copy_(data & 15)
        out[..., 1, :].copy_(data >> 4)
        out.sub_(8)
    else:
        out.copy_(packed.data.view(torch.int8).view(num_tiles, k // 4, 2, TILE, 2).permute(0, 3, 1, 2, 4))
    if full is not buf:
        buf.copy_(full[: packed.n])
    return buf


def qparam_args(scales: torch.Tensor, zeros: torch.Tensor | None) -> tuple[int, int, int | None, int]:
    """(scales pointer, scales_bf16, zeros pointer or None, zeros_kind): how weight_only_mm.c takes the
    qparams."""
    zeros_ptr = None if zeros is None else zeros.data_ptr()
    return (
        scales.data_ptr(),
        int(scales.dtype == torch.bfloat16),
        zeros_ptr,
        ZERO_KINDS[None if zeros is None else zeros.dtype],
    )


def weight_only_mm(
    lib: ctypes.CDLL | None, x: torch.Tensor, w: PackedWeights, activation_bits: int = 16
) -> torch.Tensor:
    """x [M, K] bf16 or fp32 -> fp32 [M, N]. activation_bits 8 (4-bit `w` only): the activations rounded to
    8 bits per row and group (scale max|x| / 127) inside the kernel, half the multiplies of 16
    (weight_only_mm.c)."""
    args = (x, w.data, w.bits, w.scales, w.zeros, w.group_size, w.n, activation_bits)
    if torch.compiler.is_compiling():
        return torch.ops.ascq.weight_only_mm(*args)
    return _weight_only_mm(lib, *args)


def _weight_only_mm(
    lib: ctypes.CDLL | None,
    x: torch.Tensor,
    data: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    n: int,
    activation_bits: int,
) -> torch.Tensor:
    lib = load() if lib is None else lib
    x = (x if x.dtype in (torch.bfloat16, torch.float32) else x.float()).contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = lib.ascq_weight_only_mm(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        data.data_ptr(),
        bits,
        activation_bits,
        *qparam_args(scales, zeros),
        y.data_ptr(),
        x.shape[0],
        n,
        x.shape[1],
        group_size,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"{bits}-bit kernel with {activation_bits}-bit activations rejected shapes x {tuple(x.shape)}, "
            f"group size {group_size}"
        )
    return y


def int8_activation_mm(
    lib: ctypes.CDLL | None,
    x: torch.Tensor,
    w: PackedWeights,
    input_scale: float | None = None,
    input_zero_point: int = 0,
) -> torch.Tensor:
    """W8A8 / W4A8: x [M, K] bf16 or fp32 rounded to int8 as the scheme defines (input_scale None: per token,
    `qmath.quantize_per_token`; else per tensor, `qmath.quantize_static_input`, the same bits), times `w` (8
    bits; 4 bits with a symmetric input only) -> fp32 [M, N]: the exact integer product times the weight and
    activation scales (weight_only_mm.c)."""
    scale = -1.0 if input_scale is None else float(input_scale)
    args = (x, w.data, w.bits, w.scales, w.zeros, w.group_size, w.n, scale, int(input_zero_point))
    if torch.compiler.is_compiling():
        return torch.ops.ascq.int8_activation_mm(*args)
    return _int8_activation_mm(lib, *args)


def _int8_activation_mm(
    lib: ctypes.CDLL | None,
    x: torch.Tensor,
    data: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    n: int,
    input_scale: float,
    input_zero_point: int,
) -> torch.Tensor:
    lib = load() if lib is None else lib
    x = (x if x.dtype in (torch.bfloat16, torch.float32) else x.float()).contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = lib.ascq_int8_activation_mm(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        data.data_ptr(),
        bits,
        *qparam_args(scales, zeros),
        input_scale,
        input_zero_point,
        y.data_ptr(),
        x.shape[0],
        n,
        x.shape[1],
        group_size,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"{bits}-bit kernel with int8 activations rejected shapes x {tuple(x.shape)}, group size "
            f"{group_size}, input zero point {input_zero_point}"
        )
    return y


def dequantize_bf16(lib: ctypes.CDLL | None, w: PackedWeights, out: torch.Tensor) -> torch.Tensor:
    """The dequantized weight (q - zero) * scale of `w`, rounded to bf16, written into `out` (bf16 [N, K])."""
    lib = load() if lib is None else lib
    assert out.dtype == torch.bfloat16 and out.shape == (w.n, w.k) and out.is_contiguous()
    status = lib.ascq_dequantize_bf16(
        w.data.data_ptr(),
        w.bits,
        *qparam_args(w.scales, w.zeros),
        out.data_ptr(),
        w.n,
        w.k,
        w.group_size,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"{w.bits}-bit dequantization rejected shapes {w.n}x{w.k}, group size {w.group_size}"
        )
    return out


def gptq_columns(
    w: torch.Tensor,
    u: torch.Tensor,
    err: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_of: torch.Tensor,
    first: int,
    last: int,
    float_zero_point: bool,
    q_range: tuple[int, int],
) -> None:
    """GPTQ's column loop over rows [first, last) of one block (gptq_columns.c), in place on `w` [rows, out]
    and `err` [rows, out]; `u` [rows, rows] (a row-major view), `scales`/`zeros` fp32 [groups, out],
    `group_of` int32 [rows]. torch's threads split the `out` columns (independent of each other: the same
    results)."""
    lib = load()
    assert w.dtype == err.dtype == u.dtype == scales.dtype == zeros.dtype == torch.float32
    assert w.is_contiguous() and err.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()
    assert u.stride(1) == 1 and group_of.dtype == torch.int32 and group_of.is_contiguous()
    status = lib.ascq_gptq_columns(
        w.data_ptr(),
        w.shape[1],
        w.shape[0],
        first,
        last,
        u.data_ptr(),
        u.stride(0),
        err.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr(),
        group_of.data_ptr(),
        int(float_zero_point),
        float(q_range[0]),
        float(q_range[1]),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"GPTQ column loop rejected rows {first}..{last} of a {tuple(w.shape)} block")


def group_quant_errors(
    x: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    q_range: tuple[int, int],
    norm: float,
    importance: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ importance · |dequantize(quantize(x)) - x|^norm per group and candidate (group_quant_error.c): x and
    importance (None: 1) fp32 [groups, len], scales / zeros (None: symmetric) fp32 [groups, candidates] ->
    fp32 [groups, candidates]."""
    lib = load()
    assert x.dtype == scales.dtype == torch.float32 and x.is_contiguous() and scales.is_contiguous()
    assert importance is None or (
        importance.dtype == torch.float32 and importance.is_contiguous() and importance.shape == x.shape
    )
    assert scales.shape[0] == x.shape[0] and (
        zeros is None
        or (zeros.dtype == torch.float32 and zeros.is_contiguous() and zeros.shape == scales.shape)
    )
    errors = torch.empty_like(scales)
    status = lib.ascq_group_quant_errors(
        x.data_ptr(),
        None if importance is None else importance.data_ptr(),
        x.shape[0],
        x.shape[1],
        scales.data_ptr(),
        None if zeros is None else zeros.data_ptr(),
        scales.shape[1],
        float(q_range[0]),
        float(q_range[1]),
        float(norm),
        errors.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"quantization error kernel rejected x {tuple(x.shape)}, {scales.shape[1]} candidates"
        )
    return errors


SCALE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # group_fake_quant.c's scale_kind


def group_fake_quant(
    x: torch.Tensor,
    group_len: int,
    q_range: tuple[int, int],
    symmetric: bool,
    scale_dtype: torch.dtype,
    col_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Min-max round-to-nearest fake quantization of x (fp32 [rows, cols]) in groups of `group_len` along a
    row, scales rounded to `scale_dtype`, integer zero points (group_fake_quant.c; torch's values bit for
    bit). `col_scales` (fp32 [cols]): Q(x · s) / s instead, AWQ's candidate weights."""
    lib = load()
    assert x.dtype == torch.float32 and x.dim() == 2 and x.numel() < 2**31
    x = x.contiguous()
    if col_scales is not None:
        assert col_scales.dtype == torch.float32 and col_scales.shape == (x.shape[1],)
        col_scales = col_scales.contiguous()
    out = torch.empty_like(x)
    status = lib.ascq_group_fake_quant(
        x.data_ptr(),
        None if col_scales is None else col_scales.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        group_len,
        float(q_range[0]),
        float(q_range[1]),
        int(symmetric),
        SCALE_KINDS[scale_dtype],
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"fake quantization kernel rejected x {tuple(x.shape)}, group {group_len}")
    return out


def awq_clip_search(
    w: torch.Tensor,
    group_len: int,
    grams: torch.Tensor | None,
    x: torch.Tensor | None,
    shrinks: torch.Tensor,
    q_range: tuple[int, int],
    symmetric: bool,
    scale_dtype: torch.dtype,
) -> torch.Tensor:
    """AWQ's clip search (group_fake_quant.c) on fp32 w [out, in]: grams fp32 [groups, len, len] (the groups'
    xᵀx / n), or tokens x fp32 [n, in] where grams is None; shrinks fp32 [steps] -> best max [out, groups]."""
    lib = load()
    out_dim, in_dim = w.shape
    for t in (w, grams, x, shrinks):
        assert t is None or (t.dtype == torch.float32 and t.is_contiguous())
    best = torch.empty(out_dim, in_dim // group_len)
    status = lib.ascq_awq_clip_search(
        w.data_ptr(),
        out_dim,
        in_dim,
        group_len,
        None if grams is None else grams.data_ptr(),
        None if x is None else x.data_ptr(),
        0 if x is None else x.shape[0],
        shrinks.data_ptr(),
        shrinks.numel(),
        float(q_range[0]),
        float(q_range[1]),
        int(symmetric),
        SCALE_KINDS[scale_dtype],
        best.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"clip search kernel rejected w {tuple(w.shape)}, group {group_len}")
    return best


def bf16_mm(lib: ctypes.CDLL | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (any float dtype; computed in fp32) @ weight.T, weight bf16 [N, K] with K % 16 == 0 -> fp32
    [M, N]; each row's result is independent of M (see bf16_mm.c)."""
    if torch.compiler.is_compiling():
        return torch.ops.ascq.bf16_mm(x, weight)
    lib = load() if lib is None else lib
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    status = lib.ascq_bf16_mm(
        x.data_ptr(),
        weight.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        weight.shape[0],
        x.shape[1],
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"bf16 kernel rejected shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return y


CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def paged_decode_attention(
    lib: ctypes.CDLL | None,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """query [B, H, D], one token per sequence at its last position -> fp32 [B, H, D] (see
    paged_decode_attention.c); caches [num_blocks, block_size, Hkv, D] of a dtype in CACHE_DTYPES."""
    if torch.compiler.is_compiling():
        return torch.ops.ascq.paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, float(k_scale), float(v_scale)
        )
    lib = load() if lib is None else lib
    query = query.float().contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # no-ops for the engine's caches
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    out = torch.empty_like(query)
    status = lib.ascq_paged_decode_attention(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        CACHE_DTYPES[k_cache.dtype],
        num_blocks,
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        query.shape[0],
        query.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        float(k_scale),
        float(v_scale),
        _FP8_VALUES.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            "paged decode attention rejected its inputs (sequence lengths or block ids out of range)"
        )
    return out


# The kernels as torch operators (`torch.ops.ascq.*`) for graph capture: a CPU implementation (this module's
# functions) and a fake one (output shape and dtype only). Registered through `torch.library.Library` rather
# than `torch.library.custom_op`: a call costs a third of custom_op's dispatch overhead, which matters at five
# kernel calls per layer.
_OPS = torch.library.Library("ascq", "DEF")
_OPS.define(
    "weight_only_mm(Tensor x, Tensor weight, int bits, Tensor scales, Tensor? zeros, int group_size, int n, "
    "int activation_bits) -> Tensor"
)
_OPS.define(
    "int8_activation_mm(Tensor x, Tensor weight, int bits, Tensor scales, Tensor? zeros, int group_size, "
    "int n, float input_scale, int input_zero_point) -> Tensor"
)
_OPS.define("bf16_mm(Tensor x, Tensor weight) -> Tensor")
_OPS.define(
    "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, float k_scale, float v_scale) -> Tensor"
)
_OPS.impl("weight_only_mm", functools.partial(_weight_only_mm, None), "CPU")
_OPS.impl("int8_activation_mm", functools.partial(_int8_activation_mm, None), "CPU")
_OPS.impl("bf16_mm", functools.partial(bf16_mm, None), "CPU")
_OPS.impl("paged_decode_attention", functools.partial(paged_decode_attention, None), "CPU")


@torch.library.register_fake("ascq::weight_only_mm", lib=_OPS)
def _(x, weight, bits, scales, zeros, group_size, n, activation_bits):
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


@torch.library.register_fake("ascq::int8_activation_mm", lib=_OPS)
def _(x, weight, bits, scales, zeros, group_size, n, input_scale, input_zero_point):
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


@torch.library.register_fake("ascq::bf16_mm", lib=_OPS)
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("ascq::paged_decode_attention", lib=_OPS)
def _(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale):
    return torch.empty_like(query, dtype=torch.float32)

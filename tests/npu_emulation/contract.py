"""Contract checks shared by the emulated torch_npu ops.

An emulated op raises `EmulatedContractError` where the torch_npu 2.13 documentation
(/work/shared/reference/torch_npu-2.13.0-op-docs.txt and the torch_npu API pages) states a constraint the call
breaks, and `NotImplementedError` for documented features this emulator does not model.
"""

from __future__ import annotations

from itertools import pairwise

import torch

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


class EmulatedContractError(RuntimeError):
    """A call that breaks the documented torch_npu op contract (the real op would reject it or misbehave)."""


def require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise EmulatedContractError(f"{op}: {message}")


def require_dtype(tensor: torch.Tensor, allowed: tuple[torch.dtype, ...], op: str, name: str) -> None:
    require(tensor.dtype in allowed, op, f"{name} dtype {tensor.dtype} not in {allowed}")


def npu_format(tensor: torch.Tensor) -> int:
    """The emulated storage format: FRACTAL_NZ is a tag set by npu_format_cast on the returned tensor
    object."""
    return getattr(tensor, "_emulated_npu_format", ACL_FORMAT_ND)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 words holding 8 signed int4 each (nibble i = element 8*j+i, the emulator's packing) -> int32
    values."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    values = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def decode_int64_scale(scale: torch.Tensor) -> torch.Tensor:
    """An int64 quant scale as npu_trans_quant_param encodes it: the float32 bit pattern in the low 32
    bits."""
    require(
        bool(((scale >> 32) == 0).all()), "npu_quant_matmul", "int64 scale with offset bits is not emulated"
    )
    return (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


def sizes_from_ends(ends: list[int]) -> list[int]:
    """Cumulative ends [e0, e1, ...] -> sizes [e0, e1 - e0, ...] (negative when not non-decreasing)."""
    return [b - a for a, b in pairwise([0, *ends])]

"""A CPU EMULATOR of the torch_npu ops ascq's NPU backend calls -- test code, not torch_npu.

Each op is plain torch written from the op's documented contract (torch_npu 2.13 docstrings in
/work/shared/reference/torch_npu-2.13.0-op-docs.txt, plus the torch_npu API pages for npu_quantize and
npu_convert_weight_to_int4pack): argument names, dtypes, layouts, int4 packing, group-size rules. A call that
breaks a documented constraint raises `EmulatedContractError`; a documented feature the backend does not use
raises `NotImplementedError`. FRACTAL_NZ is modelled as a tag on the tensor, not as a data layout, and the
int4 bit order inside an int32 word is the emulator's own (the real order is internal to the op pair
npu_convert_weight_to_int4pack / matmul). Passing tests here show wiring, layouts and dtypes match the docs;
they do not show the hardware produces the same numbers.

`install()` puts this package into sys.modules as `torch_npu` (tests only).
"""

from __future__ import annotations

import sys
from types import ModuleType

from .attention import _npu_reshape_and_cache, npu_fused_infer_attention_score
from .contract import ACL_FORMAT_FRACTAL_NZ, ACL_FORMAT_ND, EmulatedContractError
from .matmul import npu_quant_matmul, npu_weight_quant_batchmatmul
from .moe import npu_grouped_matmul, npu_moe_gating_top_k_softmax
from .quant import (
    get_npu_format,
    npu_convert_weight_to_int4pack,
    npu_dynamic_quant,
    npu_format_cast,
    npu_quantize,
)

__all__ = [
    "ACL_FORMAT_FRACTAL_NZ",
    "ACL_FORMAT_ND",
    "EmulatedContractError",
    "_npu_reshape_and_cache",
    "get_npu_format",
    "install",
    "npu_convert_weight_to_int4pack",
    "npu_dynamic_quant",
    "npu_format_cast",
    "npu_fused_infer_attention_score",
    "npu_grouped_matmul",
    "npu_moe_gating_top_k_softmax",
    "npu_quant_matmul",
    "npu_quantize",
    "npu_weight_quant_batchmatmul",
]


def install() -> ModuleType | None:
    """Register this emulator as `torch_npu`; returns what was there before (to restore)."""
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = sys.modules[__name__]
    return previous

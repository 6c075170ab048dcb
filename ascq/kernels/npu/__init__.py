"""Ascend NPU backend: the kernel interface (docs/ARCHITECTURE.md "Kernel interface") on torch_npu ops.

Written against the documented torch_npu 2.13 API and exercised in the test suite on the CPU against an
emulator of those ops (tests/npu_emulation); not yet run on Ascend hardware. torch_npu is imported on the
first kernel call (see `runtime.py`), never by `import ascq`.

- `linear.py`: W8A8 dynamic/static via npu_dynamic_quant / npu_quantize + npu_quant_matmul (FRACTAL_NZ
  weights), W4A16/W8A16 via npu_weight_quant_batchmatmul (int4 packed with npu_convert_weight_to_int4pack);
- `attention.py`: _npu_reshape_and_cache + npu_fused_infer_attention_score (TND, block_table, sparse_mode 3);
- `moe.py`: npu_moe_gating_top_k_softmax + npu_grouped_matmul (float, per-token int8, pseudo-quantized).
"""

from ascq.kernels.npu.attention import paged_attention, write_kv_cache
from ascq.kernels.npu.linear import linear, prepare_linear
from ascq.kernels.npu.moe import moe_experts, prepare_experts, select_experts
from ascq.kernels.npu.runtime import device, set_device

__all__ = [
    "device",
    "linear",
    "moe_experts",
    "paged_attention",
    "prepare_experts",
    "prepare_linear",
    "select_experts",
    "set_device",
    "write_kv_cache",
]

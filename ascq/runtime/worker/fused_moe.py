"""DeepSeek-MoE blocks in the fused decode (ascq_kernels.h's `ascq_fused_moe`; fused_decode.c's moe_route
and moe_experts): which blocks it takes, their C view, and the check that torch_cpu_ops.c routes as this
torch does.

The router's softmax + top-k are torch's CPU kernels reproduced in C (vector width, Sleef's exp, libstdc++'s
selection), so at first use each (experts, top-k, renormalize) is checked against the eager `select_experts`
on fixed logits, normal and tie-heavy; where neither vector width agrees bit for bit, the model runs eagerly.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from ascq.kernels import cpu, native
from ascq.runtime.models.deepseek import DeepseekMoEBlock
from ascq.runtime.models.llama import LlamaMLP
from ascq.runtime.worker.fused_linear import Linear, linear_reason, linear_struct, prepared_reason

Moe = native.structures()["ascq_fused_moe"]
MAX_TOP_K = 17  # torch.topk sorts its first k - 1 by insertion sort up to here (torch_cpu_ops.c)
LANES = (16, 8)  # torch's fp32 vector widths (AVX-512, AVX2): the order of its softmax's sum
PROBE_ROWS = 256


def _probe_logits(num_experts: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(PROBE_ROWS, num_experts, generator=generator) * 2
    ties = torch.randint(-4, 4, (PROBE_ROWS, num_experts), generator=generator) * 0.25
    return torch.cat([normal, ties]).bfloat16()


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, lanes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_cpu_ops.c's routing of bf16 logits [rows, experts]: (weights fp32, ids int32) [rows, top_k]."""
    rows, num_experts = logits.shape
    weights = torch.empty(rows, top_k)
    ids = torch.empty(rows, top_k, dtype=torch.int32)
    status = native.load().ascq_moe_route(
        logits.contiguous().data_ptr(),
        rows,
        num_experts,
        top_k,
        int(renormalize),
        lanes,
        weights.data_ptr(),
        ids.data_ptr(),
    )
    if status != 0:
        raise ValueError(f"routing rejected {num_experts} experts, top {top_k}, {lanes} lanes")
    return weights, ids


@functools.cache
def routing_lanes(num_experts: int, top_k: int, renormalize: bool) -> int | None:
    """The vector width with which torch_cpu_ops.c routes as this torch's `select_experts` does, or None."""
    logits = _probe_logits(num_experts)
    expected_weights, expected_ids = cpu.select_experts(logits, top_k, renormalize)
    for lanes in LANES:
        weights, ids = route(logits, top_k, renormalize, lanes)
        if torch.equal(ids.long(), expected_ids) and torch.equal(
            weights.view(torch.int32), expected_weights.view(torch.int32)
        ):
            return lanes
    return None


def block_reason(block: DeepseekMoEBlock) -> str | None:
    """Why the fused decode cannot run this MoE block, or None."""
    experts = block.experts
    if experts.tp_size != 1 or experts.expert_parallel:
        return "tensor or expert parallel experts"
    if experts.backend is not cpu:
        return "the experts are not on the cpu backend"
    if not 0 < experts.top_k <= min(MAX_TOP_K, experts.num_experts):
        return f"top-{experts.top_k} routing of {experts.num_experts} experts"
    shared = block.shared_experts
    if shared is not None and type(shared) is not LlamaMLP:
        return f"shared experts of type {type(shared).__name__}"
    prepared = experts.prepared
    linears = [*prepared.gate_up, *prepared.down]
    for reason in (
        linear_reason(block.gate),
        *(linear_reason(linear) for linear in (shared.gate_up_proj, shared.down_proj) if shared is not None),
        *(prepared_reason(p) for p in linears),
    ):
        if reason:
            return reason
    native_kernels = ("native", "native_int8")
    layouts = {(p.kernel, p.packed.group_size if p.kernel in native_kernels else 0) for p in prepared.gate_up}
    if len(layouts) != 1:
        return "routed experts on different kernels or group sizes"
    if len(set(prepared.intermediate_sizes)) != 1:
        return "routed experts of different sizes"
    if routing_lanes(experts.num_experts, experts.top_k, experts.renormalize) is None:
        return "this torch's softmax / top-k differ from the native routing's"
    return None


@dataclass
class BlockStruct:
    struct: Moe
    arrays: tuple[ctypes.Array, ctypes.Array]  # kept alive: struct.gate_up and struct.down point into them
    max_rows: int  # the most rows every linear's eager kernel serves


def block_struct(block: DeepseekMoEBlock) -> BlockStruct:
    """The C view of a block `block_reason` takes."""
    experts, shared = block.experts, block.shared_experts
    prepared = experts.prepared
    router, max_rows = linear_struct(block.gate.prepared)
    arrays = []
    for linears in (prepared.gate_up, prepared.down):
        array = (Linear * len(linears))()
        for i, p in enumerate(linears):
            array[i], rows = linear_struct(p)
            max_rows = min(max_rows, rows)
        arrays.append(array)
    shared_linears = [Linear(), Linear()]
    if shared is not None:
        for i, linear in enumerate((shared.gate_up_proj, shared.down_proj)):
            shared_linears[i], rows = linear_struct(linear.prepared)
            max_rows = min(max_rows, rows)
    struct = Moe(
        experts.num_experts,
        experts.top_k,
        int(experts.renormalize),
        routing_lanes(experts.num_experts, experts.top_k, experts.renormalize),
        router,
        ctypes.cast(arrays[0], ctypes.POINTER(Linear)),
        ctypes.cast(arrays[1], ctypes.POINTER(Linear)),
        *shared_linears,
    )
    return BlockStruct(struct, (arrays[0], arrays[1]), max_rows)

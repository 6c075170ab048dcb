"""Decode graphs (`enforce_eager=False`): each decoder layer's forward compiled with `torch.compile`
(inductor) for pure decode steps, on the CPU backends (`cpu`, `reference`); cuda and npu capture device graphs
instead (`device_graphs.py`).

Why per layer, not the whole forward: the 30 layers of a model share one code object, so dynamo compiles one
graph (two: the first layer has no residual yet) and every layer reuses it with its own weights as inputs:
startup pays seconds, not the minutes a 30-layer graph takes on 2 cores, and at run time the per-layer call is
a guard check. The native kernels are torch custom ops (`ascq/kernels/native.py`), so a layer is one graph
without breaks; inductor fuses the norms, residual adds, rotary and SiLU-mul around them.

Batch sizes: like vLLM's capture sizes, graphs are made at startup for 1, 2, 4 (MAX_GRAPH_BATCH; larger decode
batches and every other step run eagerly, as vLLM runs eagerly past its largest capture size). Here they are
not one padded graph per size: batch 1 is its own graph, larger batches share one graph with a symbolic batch
(dynamo's automatic dynamic shapes), split only where a kernel's threshold (all powers of two) changes the
path; the block-table width is symbolic too. Inductor's FX graph cache (on by default, under
$TORCHINDUCTOR_CACHE_DIR) makes later startups cheaper.
"""

from __future__ import annotations

import logging
import time

import torch
import torch._inductor.config
from torch import nn

from ascq.platforms import platform_for
from ascq.runtime.layers.attention import AttentionMetadata
from ascq.runtime.models.llama import DecoderLayer

logger = logging.getLogger("ascq.runtime")

MAX_GRAPH_BATCH = 4
"""Larger decode batches run eagerly: from batch 8 the dense bf16 linears leave the native kernel for an fp32
GEMM, which the compiled graph ran slower than eager and with other rounding (greedy tokens changed) on
SmolLM2 (docs/benchmarks.md, decode graphs); a small model's per-op overhead matters most at small batches
anyway."""
RECOMPILE_LIMIT = (
    64  # graphs per layer code object: (first layer or not) x (batch 1, larger) x kernel thresholds
)


def unsupported_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why compiled decode graphs cannot be used here, or None (cuda / npu capture device graphs instead)."""
    if not platform_for(device).is_cpu:
        return (
            f"torch.compile decode graphs are for the CPU backends, not {device.type} (see "
            f"runtime/device_graphs.py)"
        )
    if not any(isinstance(m, DecoderLayer) for m in model.modules()):
        return f"{type(model).__name__} has no decoder layers to compile"
    return None


def capture_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """1, 2, 4, ... up to min(max_num_seqs, limit) (and that size itself)."""
    largest = min(max_num_seqs, limit)
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return [*sizes, largest]


def dummy_decode_inputs(batch: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step of `batch` one-token sequences in block 0 (its slot 0 written: the cache is empty at
    startup)."""
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64),
        block_tables=torch.zeros(batch, num_blocks, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.ones(batch, dtype=torch.int32),
        max_query_len=1,
        use_decode_graph=True,
    )
    return torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64), meta


class DecodeGraphs:
    def __init__(self, model: nn.Module) -> None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # bf16 pointwise ops rounded after each op as eager does (inductor otherwise keeps fp32 in between,
        # which changed greedy tokens of bf16 checkpoints)
        torch._inductor.config.emulate_precision_casts = True
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
        for layer in self.layers:
            layer.decode_graph = torch.compile(layer.run, backend="inductor")

    @torch.inference_mode()
    def capture(self, max_num_seqs: int, device: torch.device) -> None:
        """Compile at startup: one dummy decode step per capture size, block tables of 1 and 2 blocks."""
        sizes = capture_sizes(max_num_seqs)
        logger.info(
            "compiling decode graphs (torch.compile, inductor) for batch sizes %s; --enforce-eager skips it",
            sizes,
        )
        start = time.perf_counter()
        for batch in sizes:
            for num_blocks in (1, 2):
                input_ids, positions, meta = dummy_decode_inputs(batch, num_blocks)
                self.model(input_ids.to(device), positions.to(device), meta.to(device))
            logger.info("decode graphs: batch %d ready (%.1f s)", batch, time.perf_counter() - start)

    def remove(self) -> None:
        for layer in self.layers:
            layer.decode_graph = None

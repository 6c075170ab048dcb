"""Load the model where the engine runs it: in this process (one rank), or across ranks in their own processes
(this one is rank 0, `executor.MultiprocExecutor`); either way the KV cache is sized and allocated and a
runner with `execute(scheduler_output)` is returned (vLLM's uniproc / multiproc executors)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ascq.core.errors import AscqError
from ascq.runtime.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for
from ascq.runtime.worker.loader import load_model
from ascq.runtime.worker.model_runner import ModelRunner


@dataclass
class StartedModel:
    model: torch.nn.Module  # this rank's (all of it in one process)
    quant_config: Any
    runner: Any  # ModelRunner, or the executor's DistributedModelRunner
    block_bytes: int  # KV bytes per block (the largest over ranks)
    num_blocks: int


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (its weights, before the KV cache is allocated)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_cache_bytes(
    args: Any, config: dict[str, Any], free_before_load: int, model: torch.nn.Module, block_bytes: int
) -> int:
    """The KV budget (`EngineArgs.resolve_kv_cache_memory`): by default at least one full sequence."""
    sequence_bytes = -(-args.resolve_max_model_len(config) // args.block_size) * block_bytes
    return args.resolve_kv_cache_memory(free_before_load, module_bytes(model), sequence_bytes)


def start_model(
    args: Any, config: dict[str, Any], dtype: torch.dtype, kv_cache_dtype: torch.dtype
) -> StartedModel:
    if args.world_size > 1:
        return _start_ranks(args, config, dtype)
    free_before_load = args.available_memory()
    model, quant_config = load_model(
        args.model, args.device, dtype, config, load_format=args.load_format, seed=args.seed
    )
    block_bytes = bytes_per_block(model, args.block_size, kv_cache_dtype)
    memory = kv_cache_bytes(args, config, free_before_load, model, block_bytes)
    num_blocks = num_blocks_for(memory, block_bytes, args.num_gpu_blocks_override)
    allocate_kv_cache(model, num_blocks, args.block_size, kv_cache_dtype, args.torch_device)
    runner = ModelRunner(
        model,
        args.block_size,
        args.torch_device,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
    )
    return StartedModel(model, quant_config, runner, block_bytes, num_blocks)


def _start_ranks(args: Any, config: dict[str, Any], dtype: torch.dtype) -> StartedModel:
    """Start the other ranks and load this rank's shard; KV blocks sized by the largest per-rank block."""
    from ascq.runtime.executor.executor import DistributedModelRunner, MultiprocExecutor

    free_before_load = args.available_memory()

    def num_blocks(block_bytes: int, model: torch.nn.Module) -> int | str:
        try:
            memory = kv_cache_bytes(args, config, free_before_load, model, block_bytes)
            return num_blocks_for(memory, block_bytes, args.num_gpu_blocks_override)
        except AscqError as exc:
            return str(exc)

    executor = MultiprocExecutor(args, config, dtype, num_blocks)
    rank = executor.rank
    if not args.enforce_eager:
        logging.getLogger("ascq.runtime").info(
            "enforce_eager=False: decode graphs are single-process only; the ranks run eagerly"
        )
    return StartedModel(
        rank.model,
        rank.quant_config,
        DistributedModelRunner(executor, args.block_size),
        rank.block_bytes,
        rank.num_blocks,
    )

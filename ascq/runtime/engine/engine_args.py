"""Engine settings with vLLM's argument names, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ascq.core.errors import AscqError, UnsupportedError
from ascq.platforms import platform_for
from ascq.runtime.engine.vllm_args import vllm_keywords

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # checkpoints are safetensors only: auto is safetensors
# The scheduler knobs' defaults, and the --performance-mode presets over them: a preset sets only the knobs
# the user left unset (None); an explicit value always wins. Latency keeps batches small and prefill chunks
# short so a long prompt never stalls the running decodes for long; throughput batches as much as the cache
# allows.
SCHEDULER_DEFAULTS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048}
PERFORMANCE_MODES = {
    "latency": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
    "throughput": {"max_num_seqs": 128, "max_num_batched_tokens": 4096},
}


@vllm_keywords  # vLLM's keywords: harmless vLLM-only ones accepted, the rest refused in one line
@dataclass
class EngineArgs:
    model: str | Path
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: the performance mode's, else SCHEDULER_DEFAULTS
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    seed: int = 0
    tokenizer: str | Path | None = None
    served_model_name: str | None = None
    speculative_config: Any = None  # vLLM's dict (or its JSON text); validated into a SpeculativeConfig
    performance_mode: str | None = None  # latency | throughput (PERFORMANCE_MODES), None: the knobs as given
    max_logprobs: int = 20  # vLLM's: most (prompt) logprobs per token a request may ask for; -1: no limit
    # vLLM's names: accepted with their meaning, or rejected with a reason (see check_vllm_args)
    gpu_memory_utilization: float | None = None  # share of free memory (RAM / HBM) for weights + KV cache
    # must match the checkpoint's quant_method; with load_format "dummy", may name a shipped recipe instead
    quantization: str | None = None
    load_format: str = "auto"  # vLLM's: auto / safetensors (the checkpoint), dummy (random weights)
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    swap_space: float = 0
    cpu_offload_gb: float = 0
    # distributed (vLLM's names): ranks = tensor x pipeline; nodes share them equally (see
    # runtime/distributed)
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def __post_init__(self) -> None:
        from ascq.runtime.spec_decode.config import parse_speculative_config

        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is not None and self.world_size > 1:
            raise UnsupportedError(
                "speculative_config runs on one rank only (tensor/pipeline parallel size 1)"
            )
        self._check_parallel()
        self.model = Path(self.model)
        self._apply_performance_mode()
        if not (self.model / "config.json").is_file():
            raise AscqError(f"{self.model} is not a model folder (no config.json)")
        platform_for(self.device)  # an unknown device is refused here
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise UnsupportedError(f"unknown dtype {self.dtype!r}; supported: auto, {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UnsupportedError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; supported: auto, fp8")
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise AscqError(f"{name} must be positive, got {value}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise AscqError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise AscqError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.max_logprobs < -1:
            raise AscqError(f"max_logprobs must be -1 (no limit) or more, got {self.max_logprobs}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise AscqError(f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}")
        self._check_vllm_args()

    def _check_vllm_args(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise UnsupportedError(
                f"load_format {self.load_format!r} is not supported; supported: {', '.join(LOAD_FORMATS)}"
            )
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise AscqError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.trust_remote_code:
            raise UnsupportedError(
                "trust_remote_code=True is not supported: ascq runs only its own model code"
            )
        if self.swap_space:
            raise UnsupportedError(
                "swap_space (CPU swap of preempted KV blocks) is not supported; preempted requests "
                "are recomputed (use swap_space=0)"
            )
        if self.cpu_offload_gb:
            raise UnsupportedError(
                "cpu_offload_gb (weight offloading) is not supported (use cpu_offload_gb=0)"
            )

    def model_config(self) -> dict[str, Any]:
        """config.json; with load_format dummy and a recipe named in `quantization`, plus the
        quantization_config that recipe's conversion writes (`quantize.planned_config`)."""
        from ascq.runtime.worker.loader import read_config

        config = read_config(self.model)
        if not self._dummy_recipe():
            return config
        if config.get("quantization_config") or config.get("compression_config"):
            raise AscqError(
                f"{self.model} is already quantized: drop quantization={self.quantization!r} to make dummy "
                "weights in its own format"
            )
        from ascq.quantize.planned_config import planned_quantization_config

        return {**config, "quantization_config": planned_quantization_config(config, self.quantization)}

    def _dummy_recipe(self) -> bool:
        from ascq.quantize.recipe import available_recipes

        return self.load_format == "dummy" and self.quantization in available_recipes()

    def check_quantization(self, config: dict[str, Any]) -> None:
        """`quantization` is what the user expects the checkpoint to be: a mismatch is an error, never a
        cast."""
        if self.quantization is None or self._dummy_recipe():
            return
        from ascq.quantize.recipe import available_recipes

        if self.quantization in available_recipes():
            raise AscqError(
                f"quantization={self.quantization!r} names a recipe, which makes weights only with "
                "load_format='dummy'; convert real weights with `ascq convert MODEL --recipe "
                f"{self.quantization}`"
            )
        raw = config.get("quantization_config") or config.get("compression_config")
        method = (raw or {}).get("quant_method")
        if method is None:
            raise AscqError(
                f"quantization={self.quantization!r} but {self.model} is not quantized (ascq quantizes "
                "offline: ascq convert); drop quantization to serve it unquantized"
            )
        if self.quantization.replace("_", "-") != method:
            hint = ""
            if method == "compressed-tensors":
                hint = (
                    " (ascq's zoo entries, awq / gptq recipes included, are compressed-tensors checkpoints: "
                    "pass quantization='compressed-tensors' or leave it out)"
                )
            raise AscqError(
                f"quantization={self.quantization!r} but {self.model} is quantized with {method!r}{hint}"
            )

    def check_parallel_layout(self, config: dict[str, Any]) -> None:
        """The model's attention heads must split over the tensor-parallel ranks (vLLM's rule), before any
        rank starts; KV heads are split, or replicated when TP is a multiple of them."""
        from ascq.core.architecture import kv_heads_per_rank

        tp, heads = self.tensor_parallel_size, config["num_attention_heads"]
        if tp > 1 and heads % tp:
            divisors = [d for d in range(2, heads + 1) if heads % d == 0]
            raise AscqError(
                f"{self.model} has {heads} attention heads, which do not split over tensor_parallel_size "
                f"{tp}; sizes that do: {', '.join(map(str, divisors)) or 'none (use 1)'}"
            )
        kv_heads_per_rank(config.get("num_key_value_heads") or heads, tp)

    def _apply_performance_mode(self) -> None:
        if self.performance_mode is not None and self.performance_mode not in PERFORMANCE_MODES:
            raise UnsupportedError(
                f"unknown performance mode {self.performance_mode!r}; supported: "
                f"{', '.join(PERFORMANCE_MODES)}"
            )
        preset = PERFORMANCE_MODES[self.performance_mode] if self.performance_mode else {}
        for name, default in SCHEDULER_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, preset.get(name, default))

    def _check_parallel(self) -> None:
        sizes = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "nnodes": self.nnodes,
        }
        for name, value in sizes.items():
            if value < 1:
                raise AscqError(f"{name} must be positive, got {value}")
        if self.world_size % self.nnodes:
            raise AscqError(
                f"{self.world_size} ranks (tensor x pipeline parallel) cannot be split evenly over "
                f"{self.nnodes} nodes"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise AscqError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise AscqError("several nodes need --master-port (and --master-addr: node 0's address)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise AscqError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise AscqError(
                "enable_expert_parallel splits experts over the tensor-parallel ranks: "
                "set tensor_parallel_size > 1"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_device(self) -> torch.device:
        """The torch device tensors live on; the `reference` backend runs on the CPU."""
        from ascq.kernels import torch_device

        return torch_device(self.device)

    def resolve_dtype(self, config: dict[str, Any]) -> torch.dtype:
        """Compute dtype: explicit, else fp32 on the CPU (fastest GEMMs there) and the checkpoint's dtype
        elsewhere."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        checkpoint = DTYPES.get(
            str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), torch.bfloat16
        )
        return platform_for(self.device).default_dtype(checkpoint, is_weight_only_quantized(config))

    def resolve_max_model_len(self, config: dict[str, Any]) -> int:
        limit = int(config.get("max_position_embeddings", 2048))
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise AscqError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {limit}"
            )
        return self.max_model_len

    def available_memory(self) -> int:
        """Free bytes on the device (host RAM for the CPU backends), read before the weights load."""
        return platform_for(self.torch_device).free_memory(self.torch_device)  # where the tensors live

    def resolve_kv_cache_memory(
        self, free_before_load: int | None = None, weight_bytes: int = 0, sequence_bytes: int = 0
    ) -> int:
        """KV bytes: kv_cache_memory; else gpu_memory_utilization x free memory (before load) minus the
        weights; else a default share of what is free now, but at least `sequence_bytes` (one max_model_len
        sequence: a server refuses to start with less)."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if self.gpu_memory_utilization is not None and free_before_load is not None:
            budget = int(self.gpu_memory_utilization * free_before_load) - weight_bytes
            if budget <= 0:
                raise AscqError(
                    f"gpu_memory_utilization {self.gpu_memory_utilization} of "
                    f"{free_before_load / 2**30:.2f} GiB free "
                    f"leaves no room for the KV cache after {weight_bytes / 2**30:.2f} GiB of weights"
                )
            return budget
        return max(platform_for(self.torch_device).default_kv_cache_bytes(self.torch_device), sequence_bytes)


@vllm_keywords
@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs (for AsyncLLMEngine): the same fields; its request-logging switches are vLLM
    arguments (ascq logs no requests)."""


def is_weight_only_quantized(config: dict[str, Any]) -> bool:
    """A compressed-tensors config whose every group quantizes weights only (W4A16 / W8A16)."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return bool(groups) and all(
        isinstance(g, dict) and g.get("weights") and not g.get("input_activations") for g in groups.values()
    )

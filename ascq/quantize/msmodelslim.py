"""msModelSlim-format checkpoints, the layout vllm-ascend loads with `--quantization ascend`.

`ascq convert MODEL --recipe w8a8 --format msmodelslim` writes, instead of compressed-tensors:
- `quant_model_weights.safetensors` (or `quant_model_weights-0000i-of-0000n.safetensors` + index) with HF tensor
  names; MoE experts keep their per-expert names (`mlp.experts.E.gate_proj.weight`, ...);
- `quant_model_description.json`: `model_quant_type`, `version`, `group_size` (+ `kv_cache_type: C8` when int8 KV
  scales are written) and one label per tensor: `W8A8` (static), `W8A8_DYNAMIC`, `W4A8_DYNAMIC` or `FLOAT`;
- `config.json` = the source config without `quantization_config`.

Per quantized linear (vllm-ascend's AscendW8A8LinearMethod / AscendW8A8DynamicLinearMethod /
AscendW4A8DynamicLinearMethod parameter names):
- W8A8: `weight` int8 [out, in], `input_scale`, `input_offset` [1], `deq_scale` = input_scale * weight_scale [out]
  (fp32 for bf16 models, the fp32 bit pattern as int64 for fp16 models), `quant_bias` int32 [out] =
  round(bias / deq_scale - input_offset * Σ_k weight), `weight_scale`, `weight_offset` [out, 1];
- W8A8_DYNAMIC: `weight` int8 [out, in], `weight_scale`, `weight_offset` [out, 1];
- W4A8_DYNAMIC: `weight` int8 [out, in] holding int4 values, `weight_scale`, `weight_offset` [out, 1],
  `weight_scale_second`, `weight_offset_second` [out, in // group_size] (per-channel weights: second scale 1).
Weights must be symmetric (vllm-ascend's W8A8/W4A8 kernels ignore weight offsets); offsets are written as zeros.

`KVCacheInt8Modifier` (recipe `kv-int8-c8`) calibrates the C8 int8 KV cache: per channel (kv_heads * head_dim)
symmetric scales absmax / 127 of the post-RoPE keys and the values over all calibration tokens, written as
`self_attn.{k,v}_proj.kv_cache_scale` with `kv_cache_offset` zeros (label C8, `kv_cache_type: C8`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ascq.errors import UnsupportedError
from ascq.quantize.ct_writer import ShardWriter
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.modifier import Modifier, QuantizedLinear, check_args
from ascq.quantize.schemes import LinearTarget, RecipeScheme, scheme_name

FORMAT = "msmodelslim"
DESCRIPTION_NAME = "quant_model_description.json"
WEIGHTS_STEM = "quant_model_weights"
VERSION = "1.0.0"
LABELS = {"w8a8_static": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w4a8_dynamic": "W4A8_DYNAMIC"}
MAX_GROUP_SIZE = 256


def deq_scale_tensor(deq_scale: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """fp32 for bf16 models; for fp16 models the fp32 bit pattern zero-extended to int64 (npu_trans_quant_param)."""
    deq_scale = deq_scale.float()
    if model_dtype == torch.float16:
        return deq_scale.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return deq_scale


def w8a8_static_tensors(ql: QuantizedLinear, bias: torch.Tensor | None, model_dtype: torch.dtype) -> dict:
    # deq_scale from the scales as written, so the loaded tensors satisfy the identity exactly
    input_scale = ql.input_scale.reshape(1).to(model_dtype).float()
    input_offset = torch.zeros(1)
    weight_scale = ql.scale.to(model_dtype).float().reshape(-1)
    deq_scale = input_scale * weight_scale
    float_bias = torch.zeros(ql.q.shape[0], dtype=torch.float64) if bias is None else bias.double()
    quant_bias = (float_bias / deq_scale.double() - input_offset.double() * ql.q.double().sum(dim=1)).round()
    return {
        "input_scale": input_scale.to(model_dtype),
        "input_offset": input_offset.to(model_dtype),
        "deq_scale": deq_scale_tensor(deq_scale, model_dtype),
        "quant_bias": quant_bias.to(torch.int32),
    }


def check_recipe_schemes(schemes: list[RecipeScheme]) -> None:
    """Fail before calibrating when a recipe has no msModelSlim equivalent."""
    for recipe_scheme in schemes:
        if recipe_scheme.kv_cache_scheme is not None:
            raise UnsupportedError("--format msmodelslim has no FP8 KV cache; use the kv-int8-c8 recipe instead of fp8-kv")
        for group in recipe_scheme.config_groups.values():
            target = LinearTarget(group.weights, group.input_activations, recipe_scheme)
            _check_scheme(scheme_name(target))
            if not group.weights.symmetric or group.weights.strategy != "channel":
                raise UnsupportedError("--format msmodelslim needs symmetric per-channel weights")


def _check_scheme(scheme: str) -> None:
    if scheme not in LABELS:
        raise UnsupportedError(
            f"--format msmodelslim writes W8A8 (w8a8-static), W8A8_DYNAMIC (w8a8) and W4A8_DYNAMIC (w4a8-dynamic) "
            f"layers; {scheme} has no msModelSlim label (use --format compressed-tensors)"
        )


def linear_tensors(scheme: str, ql: QuantizedLinear, bias: torch.Tensor | None, model_dtype: torch.dtype,
                   group_size: int) -> dict[str, torch.Tensor]:
    """One quantized linear's msModelSlim tensors (local names)."""
    _check_scheme(scheme)
    if ql.zero_point is not None and bool(ql.zero_point.any()):
        raise UnsupportedError(f"--format msmodelslim needs symmetric weights ({scheme} has weight zero points)")
    out_features, in_features = ql.q.shape
    if ql.scale.shape != (out_features, 1):
        raise UnsupportedError(f"--format msmodelslim needs per-channel weight scales, got {tuple(ql.scale.shape)}")
    tensors = {
        "weight": ql.q,
        "weight_scale": ql.scale.to(model_dtype),
        "weight_offset": torch.zeros(out_features, 1, dtype=model_dtype),
    }
    if scheme == "w8a8_static":
        tensors.update(w8a8_static_tensors(ql, bias, model_dtype))
    if scheme == "w4a8_dynamic":
        groups = in_features // group_size
        tensors["weight_scale_second"] = torch.ones(out_features, groups, dtype=model_dtype)
        tensors["weight_offset_second"] = torch.zeros(out_features, groups, dtype=model_dtype)
    if bias is not None:
        tensors["bias"] = bias.to(model_dtype)
    return tensors


def w4a8_group_size(config: dict[str, Any]) -> int:
    """One group size for the whole description: the largest power of two <= 256 dividing every linear's input."""
    dims = [config["hidden_size"], config.get("intermediate_size") or config["hidden_size"]]
    if config.get("moe_intermediate_size"):
        dims += [config["moe_intermediate_size"], config["moe_intermediate_size"] * (config.get("n_shared_experts") or 1)]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dims.append(config["num_attention_heads"] * head_dim)
    common = math.gcd(*dims)
    return min(MAX_GROUP_SIZE, common & -common)


class MsModelSlimWriter(ShardWriter):
    """A ShardWriter that records a label per tensor and writes the description; drop-in for the pipeline."""

    def __init__(self, out_dir: Path, max_shard_bytes: int, model_dtype: torch.dtype, config: dict[str, Any]) -> None:
        super().__init__(out_dir, max_shard_bytes)
        self.model_dtype = model_dtype
        self.group_size = w4a8_group_size(config)
        self.labels: dict[str, str] = {}
        self.kv_cache_type: str | None = None

    def add(self, name: str, tensor: torch.Tensor, label: str = "FLOAT") -> None:
        if name.endswith((".k_scale", ".v_scale")):
            raise UnsupportedError("--format msmodelslim has no FP8 KV cache; use the kv-int8-c8 recipe instead of fp8-kv")
        if name.endswith((".kv_cache_scale", ".kv_cache_offset")):
            label, self.kv_cache_type = "C8", "C8"
        super().add(name, tensor)
        self.labels[name] = label

    def add_linear(self, name: str, target: LinearTarget, ql: QuantizedLinear, bias: torch.Tensor | None) -> None:
        scheme = scheme_name(target)
        for key, tensor in linear_tensors(scheme, ql, bias, self.model_dtype, self.group_size).items():
            self.add(f"{name}.{key}", tensor, LABELS[scheme])

    def finish(self) -> list[str]:
        self.flush()
        single = len(self.shards) == 1
        files, weight_map = [], {}
        for i, (file, names) in enumerate(self.shards, start=1):
            final = f"{WEIGHTS_STEM}.safetensors" if single else f"{WEIGHTS_STEM}-{i:05d}-of-{len(self.shards):05d}.safetensors"
            (self.out_dir / file).rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
            files.append(final)
        if not single:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / f"{WEIGHTS_STEM}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (self.out_dir / DESCRIPTION_NAME).write_text(json.dumps(self.description(), indent=2) + "\n")
        return files

    def description(self) -> dict[str, Any]:
        quantized = sorted({label for label in self.labels.values() if label not in ("FLOAT", "C8")})
        header: dict[str, Any] = {
            "model_quant_type": quantized[0] if len(quantized) == 1 else ("FLOAT" if not quantized else "MIXED"),
            "version": VERSION,
            "group_size": self.group_size if "W4A8_DYNAMIC" in quantized else 0,
        }
        if self.kv_cache_type:
            header["kv_cache_type"] = self.kv_cache_type
        return {**header, **dict(sorted(self.labels.items()))}

    @staticmethod
    def write_config(out_dir: Path, source_config: dict, qconfig: Any = None) -> None:
        """config.json = the source config without quantization_config (the description file carries it)."""
        config = {k: v for k, v in source_config.items() if k not in ("quantization_config", "compression_config")}
        (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class KVCacheInt8Modifier(Modifier):
    """Per-channel symmetric int8 KV-cache scales for vllm-ascend's C8 path (msModelSlim format only)."""

    name = "KVCacheInt8Modifier"

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> KVCacheInt8Modifier:
        check_args(cls.name, args, {})
        return cls()

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        maxima: dict[str, torch.Tensor] = {}

        def observe(key: torch.Tensor, value: torch.Tensor):  # [batch, kv_heads, seq, head_dim]
            for kv, x in (("k", key), ("v", value)):
                channel_max = x.detach().abs().float().amax(dim=(0, 2)).reshape(-1).cpu()
                maxima[kv] = torch.maximum(maxima[kv], channel_max) if kv in maxima else channel_max
            return key, value

        ctx.run(kv_hook=observe)
        for kv, channel_max in maxima.items():
            scale = (channel_max.clamp(min=1e-8) / 127).to(ctx.scale_dtype)
            ctx.extra_tensors[f"self_attn.{kv}_proj.kv_cache_scale"] = scale
            ctx.extra_tensors[f"self_attn.{kv}_proj.kv_cache_offset"] = torch.zeros_like(scale)

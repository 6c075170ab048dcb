"""Writing msModelSlim-format checkpoints (`ascq convert MODEL --recipe w8a8 --format msmodelslim`), the
layout vllm-ascend loads with `--quantization ascend`; the layout itself is `ascq.formats.msmodelslim`.

`KVCacheInt8Modifier` (recipe `kv-int8-c8`) calibrates the C8 int8 KV cache: per channel (kv_heads * head_dim)
symmetric scales absmax / 127 of the post-RoPE keys and the values over all calibration tokens, written as
`self_attn.{k,v}_proj.kv_cache_scale` with `kv_cache_offset` zeros (label C8, `kv_cache_type: C8`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ascq.core.architecture import head_dim_of
from ascq.core.errors import UnsupportedError
from ascq.formats import msmodelslim as ms
from ascq.quantize.ct_writer import ShardWriter
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.modifier import Modifier, QuantizedLinear, check_args
from ascq.quantize.schemes import LinearTarget, RecipeScheme, scheme_name

FORMAT = ms.FORMAT


def check_recipe_schemes(schemes: list[RecipeScheme]) -> None:
    """Fail before calibrating when a recipe has no msModelSlim equivalent."""
    for recipe_scheme in schemes:
        if recipe_scheme.kv_cache_scheme is not None:
            raise UnsupportedError(
                "--format msmodelslim has no FP8 KV cache; use the kv-int8-c8 recipe instead of fp8-kv"
            )
        for group in recipe_scheme.config_groups.values():
            target = LinearTarget(group.weights, group.input_activations, recipe_scheme)
            ms.check_scheme(scheme_name(target))
            if not group.weights.symmetric or group.weights.strategy != "channel":
                raise UnsupportedError("--format msmodelslim needs symmetric per-channel weights")


def linear_input_sizes(config: dict[str, Any]) -> list[int]:
    dims = [config["hidden_size"], config.get("intermediate_size") or config["hidden_size"]]
    if config.get("moe_intermediate_size"):
        dims += [
            config["moe_intermediate_size"],
            config["moe_intermediate_size"] * (config.get("n_shared_experts") or 1),
        ]
    dims.append(config["num_attention_heads"] * head_dim_of(config))
    return dims


class MsModelSlimWriter(ShardWriter):
    """A ShardWriter that records a label per tensor and writes the description; drop-in for the pipeline."""

    def __init__(
        self, out_dir: Path, max_shard_bytes: int, model_dtype: torch.dtype, config: dict[str, Any]
    ) -> None:
        super().__init__(out_dir, max_shard_bytes)
        self.model_dtype = model_dtype
        self.group_size = ms.w4a8_group_size(linear_input_sizes(config))
        self.labels: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor, label: str = "FLOAT") -> None:
        if name.endswith((".k_scale", ".v_scale")):
            raise UnsupportedError(
                "--format msmodelslim has no FP8 KV cache; use the kv-int8-c8 recipe instead of fp8-kv"
            )
        if name.endswith(ms.KV_CACHE_SUFFIXES):
            label = ms.KV_CACHE_LABEL
        super().add(name, tensor)
        self.labels[name] = label

    def add_linear(
        self, name: str, target: LinearTarget, ql: QuantizedLinear, bias: torch.Tensor | None
    ) -> None:
        scheme = scheme_name(target)
        for key, tensor in ms.compress_linear(scheme, ql, bias, self.model_dtype, self.group_size).items():
            self.add(f"{name}.{key}", tensor, ms.LABELS[scheme])

    def finish(self, stem: str = ms.WEIGHTS_STEM) -> list[str]:
        files = super().finish(stem)
        (self.out_dir / ms.DESCRIPTION_NAME).write_text(json.dumps(self.description(), indent=2) + "\n")
        return files

    def description(self) -> dict[str, Any]:
        return ms.description(self.labels, self.group_size)

    @staticmethod
    def write_config(out_dir: Path, source_config: dict, qconfig: Any = None) -> None:
        """config.json = the source config without quantization_config (the description file carries it)."""
        config = {
            k: v for k, v in source_config.items() if k not in ("quantization_config", "compression_config")
        }
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
        if not ctx.in_block("self_attn"):
            return
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

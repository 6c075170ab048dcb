"""ascq's own dequantized reference forward of a compressed-tensors checkpoint (and of the converter's
layers).

Weights: decompressed by `ascq.formats.compressed_tensors` (the byte layout of the pinned library) and
dequantized with `qmath`. Activations: fake-quantized at each quantized linear's input as the scheme says
(dynamic symmetric per token, or the static per-tensor `input_scale`). FP8 KV: post-RoPE keys/values
fake-quantized to e4m3 with `k_scale`/`v_scale`. Everything in fp32, one decoder layer in memory at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from torch import nn
from torch.utils.hooks import RemovableHandle

from ascq.core import qmath
from ascq.core.errors import AscqError
from ascq.formats import QuantizedLinear
from ascq.formats import compressed_tensors as ct
from ascq.formats.safetensors import CheckpointReader
from ascq.kernels import cpu
from ascq.platforms import platform_for
from ascq.quantize.architectures import KVHook, architecture_from_config
from ascq.quantize.schemes import LinearTarget, RecipeScheme, resolve_target


def activation_pre_hook(args: QuantizationArgs, input_scale: torch.Tensor | None, shared: dict | None = None):
    """Fake-quantize a linear's input. `shared`: one dict for the linears of a layer, so that linears reading
    the same tensor with the same quantizer (q/k/v, gate/up) quantize it once (the last input is kept in
    it)."""

    def hook(module: nn.Module, inputs: tuple) -> tuple:
        x = inputs[0]

        def fake_quantize() -> torch.Tensor:
            if args.dynamic:
                return qmath.per_token_fake_quantize(x, args.num_bits)
            return qmath.static_fake_quantize(x, input_scale.to(x.device), args.num_bits)

        key = ("fake", args, None if input_scale is None else tuple(input_scale.reshape(-1).tolist()))
        out = fake_quantize() if shared is None else shared_result(shared, x, key, fake_quantize)
        return (out, *inputs[1:])

    return hook


def install_quantized(
    layer: nn.Module, quantized: dict[str, tuple[LinearTarget, QuantizedLinear]], integer_gemm: bool = False
) -> list[RemovableHandle]:
    """Replace each linear's weight by its dequantized value and fake-quantize its input; returns the hook
    handles. `integer_gemm` (the converter's propagation): where `integer_gemm_applies`, the linear multiplies
    the integer codes instead (`integer_forward`); the reference forward keeps the fake-quantized fp32
    product, which the served reference backend reproduces bit for bit."""
    handles, shared = [], {}
    for name, (target, ql) in quantized.items():
        linear = layer.get_submodule(name)
        set_dequantized_weight(linear, target, ql)
        if integer_gemm and integer_gemm_applies(target, linear):
            linear.forward = functools.partial(integer_forward, IntegerWeights.of(target, ql, linear), shared)
        elif target.input_activations is not None:
            handles.append(
                linear.register_forward_pre_hook(
                    activation_pre_hook(target.input_activations, ql.input_scale, shared)
                )
            )
    return handles


def set_dequantized_weight(linear: nn.Linear, target: LinearTarget, ql: QuantizedLinear) -> None:
    """The linear's weight replaced by the dequantized value of what will be written."""
    weight = qmath.dequantize_weight(ql.q, ql.scale, ql.zero_point, target.weights)
    linear.weight.data = weight.to(linear.weight.device, linear.weight.dtype)


def shared_result(shared: dict, x: torch.Tensor, key: object, compute) -> object:
    """`compute()` of the input `x`, reused while linears read the same, unchanged tensor with the same
    quantizer (`key`): q/k/v and gate/up quantize their input once. `shared` holds the last one (one dict per
    layer)."""
    if shared.get("input") is x and shared["version"] == x._version and shared["key"] == key:
        return shared["output"]
    output = compute()
    shared.update(input=x, version=x._version, key=key, output=output)
    return output


def integer_gemm_applies(target: LinearTarget, linear: nn.Linear) -> bool:
    """Symmetric integer weights with one scale per output row and symmetric integer activations (W8A8, W4A8):
    the product of the codes is exact in int32, so it runs as torch's int8 GEMM where that is fast
    (`cpu.INT8_GEMM_FAST`) instead of an fp32 GEMM of the fake-quantized values; the two agree up to fp32
    rounding."""
    w, a = target.weights, target.input_activations
    return (
        cpu.INT8_GEMM_FAST
        and platform_for(linear.weight.device).is_cpu
        and a is not None
        and w.type == "int"
        and a.type == "int"
        and w.symmetric
        and a.symmetric
        and w.num_bits <= 8
        and a.num_bits <= 8
        and str(w.strategy) in ("channel", "tensor")
        and str(a.strategy) in ("token", "tensor")
    )


@dataclasses.dataclass
class IntegerWeights:
    codes: torch.Tensor  # int8 [in, out]
    scale: torch.Tensor  # fp32 [out] (or [1])
    bias: torch.Tensor | None
    activations: QuantizationArgs
    input_scale: torch.Tensor | None  # static per-tensor activations

    @classmethod
    def of(cls, target: LinearTarget, ql: QuantizedLinear, linear: nn.Linear) -> IntegerWeights:
        bias = None if linear.bias is None else linear.bias.detach().float()
        input_scale = None if ql.input_scale is None else ql.input_scale.float().reshape(())
        return cls(
            ql.q.t().contiguous(), ql.scale.float().reshape(-1), bias, target.input_activations, input_scale
        )


def integer_codes(
    x: torch.Tensor, weights: IntegerWeights, shared: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [tokens, in], fp32 scale [tokens, 1] or []) of a linear's input, as served; linears reading
    the same tensor with the same quantizer (q/k/v, gate/up) reuse it through `shared`."""

    def codes() -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.reshape(-1, x.shape[-1])
        num_bits = weights.activations.num_bits
        if weights.activations.dynamic:
            q, scale = qmath.quantize_per_token(rows, num_bits)
        else:
            q, scale = (
                qmath.quantize_static_input(rows, weights.input_scale, None, num_bits),
                weights.input_scale,
            )
        return q.to(torch.int8), scale

    key = (
        "integer",
        weights.activations,
        None if weights.input_scale is None else weights.input_scale.item(),
    )
    return shared_result(shared, x, key, codes)


def integer_forward(weights: IntegerWeights, shared: dict, x: torch.Tensor) -> torch.Tensor:
    q, scale = integer_codes(x, weights, shared)
    y = torch._int_mm(q, weights.codes).float().mul_(scale).mul_(weights.scale)
    if weights.bias is not None:
        y += weights.bias
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def fp8_kv_hook(k_scale: torch.Tensor, v_scale: torch.Tensor) -> KVHook:
    def hook(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qmath.fp8_fake_quantize(key, k_scale.to(key.device)), qmath.fp8_fake_quantize(
            value, v_scale.to(value.device)
        )

    return hook


class QuantizedCheckpoint:
    """A compressed-tensors checkpoint folder read one layer at a time."""

    def __init__(self, entry_dir: Path) -> None:
        self.entry_dir = Path(entry_dir)
        config = json.loads((self.entry_dir / "config.json").read_text())
        if "quantization_config" not in config:
            raise AscqError(f"{entry_dir}: config.json has no quantization_config")
        self.qconfig = QuantizationConfig.model_validate(config["quantization_config"])
        self.scheme = RecipeScheme(
            "checkpoint", dict(self.qconfig.config_groups), list(self.qconfig.ignore or [])
        )
        self.arch = architecture_from_config({k: v for k, v in config.items() if k != "quantization_config"})
        self.reader = CheckpointReader(self.entry_dir)

    def layer(
        self, index: int, device: str = "cpu"
    ) -> tuple[nn.Module, dict[str, tuple[LinearTarget, QuantizedLinear]], KVHook | None]:
        prefix = self.arch.layer_prefix(index)
        raw = self.reader.get_prefix(prefix)
        with torch.device("meta"):
            skeleton = self.arch.new_layer(index)
        state, quantized = {}, {}
        for name, module in skeleton.named_modules():
            target = (
                resolve_target(prefix + name, module, [self.scheme])
                if isinstance(module, nn.Linear)
                else None
            )
            if target is not None:
                quantized[name] = (target, self._quantized_linear(raw, name, target))
                state[f"{name}.weight"] = torch.empty(module.weight.shape)
        k_scale, v_scale = raw.pop("self_attn.k_scale", None), raw.pop("self_attn.v_scale", None)
        for key, tensor in raw.items():
            module, _, param = key.rpartition(".")
            if module not in quantized or param == "bias":
                state[key] = tensor.float()
        layer = self.arch.build_layer(index, state).to(device)
        install_quantized(layer, quantized)
        kv_hook = (
            fp8_kv_hook(k_scale, v_scale) if k_scale is not None and self.qconfig.kv_cache_scheme else None
        )
        return layer, quantized, kv_hook

    def _quantized_linear(
        self, raw: dict[str, torch.Tensor], name: str, target: LinearTarget
    ) -> QuantizedLinear:
        prefix = f"{name}."
        tensors = {
            k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix) and k[len(prefix) :] != "bias"
        }
        return ct.quantized_linear(tensors, target.weights.num_bits)


@torch.no_grad()
def reference_logits(entry_dir: str | Path, input_ids: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """fp32 logits [batch, seq, vocab] of a converted entry for `input_ids` [batch, seq]."""
    ckpt = QuantizedCheckpoint(Path(entry_dir))
    arch, reader = ckpt.arch, ckpt.reader
    input_ids = input_ids.to(device)
    hidden = arch.embed(reader.get("model.embed_tokens.weight").to(device), input_ids)
    position_ids = torch.arange(input_ids.shape[1], device=device)[None]
    for index in range(arch.num_layers):
        layer, _, kv_hook = ckpt.layer(index, device)
        hidden = arch.forward_layer(layer, hidden, position_ids, kv_hook=kv_hook)
        del layer
    hidden = arch.final_norm(hidden, reader.get("model.norm.weight").float().to(device))
    return hidden @ _head(ckpt).to(device).T


def _head(ckpt: QuantizedCheckpoint) -> torch.Tensor:
    """The LM head's fp32 weight: dequantized when the checkpoint quantizes it (`lm_head` in a config
    group), else the stored lm_head or the tied embedding."""
    reader = ckpt.reader
    if "lm_head.weight_scale" in reader:
        scheme = ct.match_scheme("lm_head", ckpt.qconfig.config_groups.values(), [])
        if scheme is None:
            raise AscqError(f"{ckpt.entry_dir}: lm_head is stored quantized but no config group targets it")
        ql = ct.quantized_linear(reader.get_prefix("lm_head."), scheme.weights.num_bits)
        return qmath.dequantize_weight(ql.q, ql.scale, ql.zero_point, scheme.weights).float()
    tied = ckpt.arch.tie_word_embeddings and "lm_head.weight" not in reader
    return reader.get("model.embed_tokens.weight" if tied else "lm_head.weight").float()

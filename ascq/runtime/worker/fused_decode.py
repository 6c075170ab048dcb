"""Fused decode (CPU): a pure decode step's whole decoder stack in one native call
(ascq/kernels/fused_decode.c).

Why: at batch 1 an eager layer of a small model is a few dozen torch ops and native calls from Python, which
cost several times what streaming its int4 weights costs (a DeepSeek-MoE layer: a few hundred, its routed
experts grouped in Python); in one call the step's layers cost what their kernels cost (measurements:
docs/benchmarks.md). The C code runs the eager path's kernels and rounds to bf16 where eager does, so tokens
are the eager path's (tests/test_fused_decode.py, tests/test_fused_decode_moe.py).

Used for a step when all of these hold, else the step runs eagerly, unchanged:
- the model: `DecoderModel` of `DecoderLayer`s whose MLP is a `LlamaMLP` (Llama, Mistral, Qwen2) or a
  `DeepseekMoEBlock` (DeepSeek-MoE: router, routed experts, shared experts; fused_moe.py says which), one
  rank (no tensor or expert parallelism), the cpu backend with its native library, bf16 activations and KV
  cache, every linear on the native weight-only kernel (W4A16 / W8A16) or the native bf16 kernel (dense bf16);
- the step: one token per sequence (`max_query_len == 1`: no prefill, no speculative verification), fewer rows
  than the linears' native-kernel thresholds (`cpu.DENSE_BF16_MAX_M` with dense layers, else
  `cpu.native_max_m()`; a MoE block's router is dense).
On by default in eager mode (`enforce_eager=True`, the CPU default); `ASCQ_FUSED_DECODE=0` (or
`ASCQ_NATIVE_KERNELS=0`) turns it off, and with decode graphs (`--no-enforce-eager`) the graphs run instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascq import envs
from ascq.kernels import cpu, native
from ascq.platforms import platform_for
from ascq.runtime.layers.attention import AttentionMetadata
from ascq.runtime.models.deepseek import DeepseekMoEBlock
from ascq.runtime.models.llama import DecoderLayer, DecoderModel, LlamaMLP
from ascq.runtime.worker import fused_moe
from ascq.runtime.worker.fused_linear import linear_reason, linear_struct

_Layer = native.structures()["ascq_fused_layer"]  # the C structs, read from ascq_kernels.h
_Model = native.structures()["ascq_fused_model"]


def silu_table() -> torch.Tensor:
    """torch's bf16 silu of every bf16 bit pattern, as int16 [65536] indexed by the pattern."""
    patterns = torch.arange(65536, dtype=torch.int32)
    patterns = torch.where(patterns >= 32768, patterns - 65536, patterns).to(torch.int16)
    return F.silu(patterns.view(torch.bfloat16)).view(torch.int16).contiguous()


def _mlp_reason(mlp: torch.nn.Module) -> str | None:
    if type(mlp) is DeepseekMoEBlock:
        return fused_moe.block_reason(mlp)
    if type(mlp) is not LlamaMLP:
        return f"{type(mlp).__name__} is neither a Llama MLP nor a DeepSeek-MoE block"
    return linear_reason(mlp.gate_up_proj) or linear_reason(mlp.down_proj)


def unsupported_reason(model: DecoderModel) -> str | None:
    """Why `model` cannot run fused decode steps, or None."""
    if native.load() is None:
        return "no native kernel library"
    if (
        model.embed_tokens.weight.dtype != torch.bfloat16
        or not platform_for(model.embed_tokens.weight.device).is_cpu
    ):
        return "activations are not bf16 on the CPU"
    if getattr(model.embed_tokens, "tp_size", 1) != 1:
        return "tensor parallel"
    if not len(model.layers):
        return "no layers"
    for layer in model.layers:
        if type(layer) is not DecoderLayer:
            return f"{type(layer).__name__} is not a Llama-family decoder layer"
        attn = layer.self_attn
        if attn.q_norm is not None:
            return "per-head q/k norms (Qwen 3) are not in the fused decode"
        reason = linear_reason(attn.qkv_proj) or linear_reason(attn.o_proj) or _mlp_reason(layer.mlp)
        if reason:
            return reason
        if attn.attn.k_cache.dtype != torch.bfloat16 or attn.attn.v_cache.dtype != torch.bfloat16:
            return "the KV cache is not bf16"
    norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(n.weight.dtype != torch.bfloat16 or n.eps != model.norm.eps for n in [*norms, model.norm]):
        return "norm weights are not bf16 or norms differ in eps"
    return None


@dataclass
class _Plan:
    struct: _Model
    layers: ctypes.Array  # kept alive: struct.layers points into it
    blocks: list[fused_moe.BlockStruct]  # kept alive: MoE layers' struct.moe point to them
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # the caches the plan's pointers are for
    max_rows: int


class FusedDecode:
    """`DecoderModel.fused_decode`: runs a step's layers in one native call, or returns None (the step runs
    eagerly)."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self.silu = silu_table()
        self.plan: _Plan | None = None
        # looked up once: Module.__getattr__ is slow
        self.attentions = [layer.self_attn.attn for layer in model.layers]

    def _caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(a.k_cache, a.v_cache) for a in self.attentions]

    def _build(self) -> _Plan:
        layers = self.model.layers
        structs = (_Layer * len(layers))()
        blocks = []
        max_rows = cpu.native_max_m()
        for layer, s in zip(layers, structs, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [("qkv", attn.qkv_proj), ("o", attn.o_proj)]
            if type(mlp) is DeepseekMoEBlock:
                blocks.append(fused_moe.block_struct(mlp))
                s.moe = ctypes.pointer(blocks[-1].struct)
                max_rows = min(max_rows, blocks[-1].max_rows)
            else:
                linears += [("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)]
            for name, linear in linears:
                struct, rows = linear_struct(linear.prepared)
                setattr(s, name, struct)
                max_rows = min(max_rows, rows)
            s.input_norm = layer.input_layernorm.weight.data_ptr()
            s.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            s.k_cache, s.v_cache = attn.attn.k_cache.data_ptr(), attn.attn.v_cache.data_ptr()
        first = layers[0].self_attn
        k_cache = first.attn.k_cache
        model = _Model(
            len(layers),
            self.model.embed_tokens.weight.shape[1],
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            k_cache.shape[1],
            k_cache.shape[0],
            layers[0].input_layernorm.eps,
            first.attn.scale,
            self.silu.data_ptr(),
            ctypes.cast(structs, ctypes.POINTER(_Layer)),
            self.model.norm.weight.data_ptr(),
        )
        return _Plan(model, structs, blocks, self._caches(), max_rows)

    def __call__(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """x: the step's embeddings [T, hidden] -> the final hidden states (after the model's norm), or None
        where not applicable."""
        if meta.max_query_len != 1 or x.dtype != torch.bfloat16:
            return None
        if self.plan is None or any(
            a is not k or b is not v for (a, b), (k, v) in zip(self.plan.caches, self._caches(), strict=True)
        ):
            self.plan = self._build()
        num_rows = x.shape[0]
        if not 0 < num_rows <= self.plan.max_rows:
            return None
        x = x.contiguous()
        residual = torch.empty_like(x)
        cos, sin = (t.reshape(num_rows, -1).contiguous() for t in cos_sin)
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int32).contiguous()
        status = native.load().ascq_fused_decode(
            ctypes.byref(self.plan.struct),
            x.data_ptr(),
            residual.data_ptr(),
            num_rows,
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError("fused decode rejected the step (shapes, sequence lengths, slots or block ids)")
        return x


def enabled() -> bool:
    return envs.ASCQ_FUSED_DECODE


def attach(model: torch.nn.Module) -> str | None:
    """Give the model's `DecoderModel` a `FusedDecode`; returns why not, or None when attached."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel):
        return f"{type(model).__name__} has no Llama decoder"
    reason = unsupported_reason(decoder)
    if reason is None:
        decoder.fused_decode = FusedDecode(decoder)
    return reason


def detach(model: torch.nn.Module) -> None:
    decoder = getattr(model, "model", None)
    if isinstance(decoder, DecoderModel):
        decoder.fused_decode = None

"""The layer-streaming conversion loop: one decoder layer in memory at a time.

Layer 0's inputs are embedding rows read straight from the checkpoint. For each layer: load only its tensors,
build the module (fp32, on the compute device), run the recipe's modifiers, write its tensors to the current
output shard, then swap in the quantized weights (dequantized, activations fake-quantized, fp8 KV applied) and
run the calibration batches again: the next layer sees the quantized model's hidden states, as in
llm-compressor. When an eval token stream is given, its windows travel along two paths (full precision,
quantized) for perplexity before/after without ever holding the whole model.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from torch import nn
from tqdm import tqdm

from ascq.core import qmath
from ascq.core.errors import AscqError
from ascq.core.heap import trim_heap
from ascq.core.qmath import linear_group_size
from ascq.evaluate import eval_windows, perplexity
from ascq.formats.safetensors import CheckpointReader
from ascq.kernels import cpu
from ascq.platforms import platform_for
from ascq.quantize import observer
from ascq.quantize.architectures import Architecture, LayerBlock
from ascq.quantize.ct_writer import ShardWriter, quantization_config
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.layout import decoder_linears
from ascq.quantize.mixed import MixedPlan, build_units, mixed_config_groups, plan_from_units
from ascq.quantize.modifier import QuantizedLinear
from ascq.quantize.recipe import ComposedRecipe
from ascq.quantize.reference_forward import fp8_kv_hook, install_quantized, shared_result
from ascq.quantize.schemes import (
    GroupSizeFit,
    LinearTarget,
    RecipeScheme,
    fit_group_sizes,
    resolve_target,
    scheme_name,
)

log = logging.getLogger(__name__)
EVAL_SEQ_LEN = 256
BATCH_SIZE = 8


@dataclasses.dataclass
class StreamResult:
    qconfig: QuantizationConfig
    scheme: str
    fallbacks: dict[str, str]  # full linear name -> why its group size fell back to per-channel
    group_size_fits: list[GroupSizeFit]  # config groups whose recipe group size was lowered (or fell back)
    layers: dict[int, dict[str, Any]]
    num_quantized_linears: int
    perplexity_base: float | None = None
    perplexity: float | None = None
    mixed: MixedPlan | None = None  # the bits budget's allocation (`mixed`), if the recipe has one
    lm_head: dict[str, Any] | None = None  # how the LM head was quantized (None: kept as the source's)


def return_freed_memory_to_os() -> None:
    """glibc: serve allocations >= 4 MiB by mmap so freed layer tensors go back to the OS. For models with
    routed experts (`Architecture.has_routed_experts`), whose tensors vary in size with each expert's routed
    tokens.

    With glibc's default (a threshold that grows to 32 MiB), those many tensor-sized temporaries of a layer
    are carved out of the heap and fragment it: peak RSS on deepseek-moe-16b shapes doubled. A dense layer
    allocates the same shapes in every layer, which the heap reuses; there the threshold only made every
    temporary page-fault in fresh (slower, with the same peak RSS). Measurements: docs/benchmarks.md.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD


def checkpoint_dtypes(reader: CheckpointReader) -> tuple[torch.dtype, torch.dtype]:
    """(dtype of written full-precision tensors, dtype of scales): the source's float dtype."""
    dtype = reader.dtype()
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise AscqError(f"{reader.model_dir}: weights are {dtype}; expected float16, bfloat16 or float32")
    return dtype, dtype


def layer_targets(
    layer: nn.Module, prefix: str, schemes: list[RecipeScheme]
) -> tuple[dict[str, LinearTarget], list[str], dict[str, str]]:
    """(targets by relative name, ignored linears' full names, group-size fallbacks: full name -> reason)."""
    targets, ignored, fallbacks = {}, [], {}
    for name, module in layer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        target = resolve_target(prefix + name, module, schemes)
        if target is None:
            ignored.append(prefix + name)
            continue
        group = target.weights.group_size
        if target.weights.strategy == "group" and linear_group_size(group, module.in_features) is None:
            channel = target.weights.model_copy(update={"strategy": "channel", "group_size": None})
            target = LinearTarget(channel, target.input_activations, target.owner)
            fallbacks[prefix + name] = (
                f"in_features {module.in_features} not divisible by group_size {group}: per-channel"
            )
        targets[name] = target
    return targets, ignored, fallbacks


CALIBRATION_DTYPES = ("auto", "float32", "bfloat16")


def check_calibration_dtype(choice: str) -> None:
    if choice not in CALIBRATION_DTYPES:
        raise AscqError(f"--calibration-dtype {choice!r}: use one of {', '.join(CALIBRATION_DTYPES)}")


def calibration_gemm_dtype(choice: str, device: str, recipe: ComposedRecipe) -> torch.dtype:
    """The dtype of the linears' products in the converter's forwards (`--calibration-dtype`). auto: bfloat16
    on a CPU whose bf16 GEMM outruns its fp32 GEMM (`cpu.BF16_GEMM_FAST`: AMX or AVX-512 BF16) when every
    modifier of the recipe keeps its quality with them (`Modifier.calibrates_in_bf16`: GPTQ), else float32.
    Measured on SmolLM2 (docs/benchmarks.md): AWQ's α search compares block-output losses, which bf16 products
    blur, and SmoothQuant's w8a8 lost perplexity with them."""
    check_calibration_dtype(choice)
    if choice == "auto":
        bf16 = all(m.calibrates_in_bf16 for m in recipe.modifiers)
        return (
            torch.bfloat16 if cpu.BF16_GEMM_FAST and platform_for(device).is_cpu and bf16 else torch.float32
        )
    if choice == "bfloat16" and platform_for(device).is_cpu and not cpu.BF16_GEMM_FAST:
        log.warning(
            "--calibration-dtype bfloat16: this CPU has no fast bf16 GEMM (AMX / AVX-512 BF16), so the "
            "calibration forwards run several times slower than with float32 (auto picks float32 here)"
        )
    return getattr(torch, choice)


def fast_layer(layer: nn.Module, gemm_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The layer set up for the converter's forwards: torch's fused attention kernel (`decoder.Attention.
    fused_attention`: the same function up to float rounding, several times faster than the reference
    backend's attention), and with a `gemm_dtype` other than float32 the attention and every linear's product
    in that dtype (`gemm_in`)."""
    casts: dict = {}  # linears reading one tensor (q/k/v, gate/up) round it once
    for module in layer.modules():
        if hasattr(module, "fused_attention"):
            module.fused_attention = gemm_dtype
        if isinstance(module, nn.Linear) and gemm_dtype != torch.float32:
            gemm_in(module, gemm_dtype, casts)
    return layer


def gemm_in(linear: nn.Linear, dtype: torch.dtype, casts: dict) -> None:
    """`linear` computes its product in `dtype`: input and weight (whatever the weight is when called) rounded
    to it, the GEMM accumulating in fp32 (oneDNN's bf16 GEMM), the output back in the input's dtype plus the
    bias. Hooks still see the input at full precision (Hessians, activation statistics); only the products are
    rounded: on SmolLM2 the bf16 output differs from fp32 by 2^-9 relative per input. `casts`: one dict for
    the linears of a layer, which then round an input they share once (`reference_forward.shared_result`)."""

    # weakly: the function lives on the linear, and a strong reference would be a cycle that only the cyclic
    # collector frees, whenever it runs (at deepseek-moe-16b's shape: GiBs of fp32 experts per layer)
    module = weakref.ref(linear)

    def forward(x: torch.Tensor) -> torch.Tensor:
        lin = module()
        cast = shared_result(casts, x, dtype, lambda: x.to(dtype))
        y = F.linear(cast, lin.weight.to(dtype)).to(x.dtype)
        return y if lin.bias is None else y.add_(lin.bias)

    linear.forward = forward


def _batches(arch: Architecture, embed: torch.Tensor, ids: torch.Tensor, device: str) -> list[torch.Tensor]:
    return [arch.embed(embed, chunk).to(device) for chunk in ids.split(BATCH_SIZE)]


def _forward_all(
    arch: Architecture,
    layer: nn.Module,
    batches: list[torch.Tensor],
    kv_hook=None,
    block: LayerBlock | None = None,
) -> list[torch.Tensor]:
    """Every batch through one of the layer's residual halves (None: the whole layer)."""
    return [
        arch.forward_block(layer, block, x, torch.arange(x.shape[1], device=x.device)[None], kv_hook)
        for x in batches
    ]


def _round_as_written(layer: nn.Module, block: LayerBlock | None, dtype: torch.dtype) -> None:
    """The block's (None: the layer's) full-precision tensors (norms, router, biases) rounded to the written
    dtype in place: the propagated layer uses what will be written."""
    for key, tensor in layer.state_dict().items():
        if block is None or block.contains(key.rsplit(".", 1)[0]):
            tensor.data.copy_(tensor.to(dtype))


def _write_layer(
    writer: ShardWriter,
    prefix: str,
    layer: nn.Module,
    targets: dict[str, LinearTarget],
    ctx: LayerContext,
    dtype: torch.dtype,
) -> None:
    for key, tensor in layer.state_dict().items():
        owner, leaf = key.rsplit(".", 1)
        if owner not in ctx.results or leaf not in ("weight", "bias"):
            writer.add(prefix + key, tensor.to(dtype))
    for name in sorted(ctx.results):
        bias = layer.get_submodule(name).bias
        writer.add_linear(
            f"{prefix}{name}",
            targets[name],
            ctx.results[name],
            bias.detach().to(dtype) if bias is not None else None,
        )
    for key, tensor in sorted(ctx.extra_tensors.items()):
        writer.add(prefix + key, tensor)


@dataclasses.dataclass
class LayerJob:
    """What every layer's conversion reads and does not change."""

    reader: CheckpointReader
    arch: Architecture
    recipe: ComposedRecipe
    writer: ShardWriter
    device: str
    dtype: torch.dtype  # of the written full-precision tensors
    scale_dtype: torch.dtype
    source_block_size: int | None = None  # the source's quantization block (`qmath.source_block_size`)
    source_float_min: bool = False  # its blocks have float minima (`qmath.source_has_float_min`)
    # of the linears' products in the forwards (`calibration_gemm_dtype`)
    gemm_dtype: torch.dtype = torch.float32
    schemes: list[RecipeScheme] = dataclasses.field(init=False)
    group_size_fits: list[GroupSizeFit] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.schemes = self.recipe.schemes()
        self.group_size_fits = fit_group_sizes(
            self.schemes,
            decoder_linears(self.arch),
            self.source_block_size,
            self.source_float_min,
            self.scale_dtype,
        )
        for fit in self.group_size_fits:
            log.warning("%s", fit.message())


@torch.no_grad()
def plan_mixed_precision(
    reader: CheckpointReader,
    arch: Architecture,
    schemes: list[RecipeScheme],
    batches: list[torch.Tensor],
    device: str,
    scale_dtype: torch.dtype,
    gemm_dtype: torch.dtype = torch.float32,
) -> MixedPlan | None:
    """For the recipe scheme with a bits budget (`mixed`): one full-precision pass of the calibration batches
    through every layer recording mean x² per input column of each linear it quantizes, the linears reading
    one input grouped into a unit, each unit's weighted error per candidate, the allocation; the scheme's
    config group is replaced by one explicit group per chosen candidate (in place, so the modifiers that own
    the scheme quantize with them). None when no scheme has a budget."""
    scheme = next((s for s in schemes if s.budget is not None), None)
    if scheme is None:
        return None
    (base,) = scheme.config_groups.values()
    units = []
    for index in range(arch.num_layers):
        prefix = arch.layer_prefix(index)
        layer = fast_layer(
            arch.build_layer(index, reader.get_prefix(prefix, torch.float32)).to(device), gemm_dtype
        )
        targets, _, _ = layer_targets(layer, prefix, [scheme])
        squares = _InputSquares(layer, list(targets))
        try:
            batches = _forward_all(arch, layer, batches)
        finally:
            squares.remove()
        linears = {prefix + n: (layer.get_submodule(n), base.weights) for n in targets}
        importance = {prefix + n: x2 for n, x2 in squares.mean().items()}
        shared = [[prefix + n for n in names] for names in squares.shared()]
        units += build_units(linears, importance, shared, scheme.budget, scale_dtype)
        del layer
        trim_heap()
    plan = plan_from_units(units, scheme.budget)
    scheme.config_groups = mixed_config_groups(base, plan.choice)
    return plan


class _InputSquares:
    """Σ x² per input column and the token count at each named linear's input while registered, and which
    linears read one tensor (their fused product: q/k/v, gate/up)."""

    def __init__(self, layer: nn.Module, names: list[str]) -> None:
        self.layer, self.names = layer, names
        self.sums: dict[str, torch.Tensor] = {}
        self.counts = dict.fromkeys(names, 0)
        self.first: dict[str, torch.Tensor] = {}  # the first input each received
        self.handles = [layer.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in names]

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            self.sums[name] = x.pow(2).sum(0) + self.sums.get(name, 0)
            self.counts[name] += x.shape[0]
            self.first.setdefault(name, args[0])

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def mean(self) -> dict[str, torch.Tensor]:
        """mean x² per input column (zeros for a linear that saw no token: an unrouted expert)."""
        return {
            n: self.sums[n] / self.counts[n]
            if self.counts[n]
            else torch.zeros(self.layer.get_submodule(n).in_features)
            for n in self.names
        }

    def shared(self) -> list[list[str]]:
        """The names grouped by the tensor they first read (the same object), in order."""
        groups: list[list[str]] = []
        for name in self.names:
            x = self.first.get(name)
            group = next((g for g in groups if x is not None and self.first.get(g[0]) is x), None)
            if group is None:
                groups.append([name])
            else:
                group.append(name)
        self.first.clear()
        return groups


@dataclasses.dataclass
class StreamState:
    """What travels from one layer to the next: hidden states, and what the result will record."""

    inputs: list[torch.Tensor]  # calibration hidden states through the quantized layers so far
    eval_fp: list[torch.Tensor]  # eval windows through the full-precision layers
    eval_q: list[torch.Tensor]  # ... and through the quantized layers
    ignored: list[str] = dataclasses.field(default_factory=list)
    fallbacks: dict[str, str] = dataclasses.field(default_factory=dict)
    fallback_targets: dict[str, LinearTarget] = dataclasses.field(default_factory=dict)
    reports: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    names_seen: set[str] = dataclasses.field(default_factory=set)
    num_quantized: int = 0


def _blocks(job: LayerJob) -> tuple[LayerBlock | None, ...]:
    """The parts of a layer calibrated, quantized and propagated in turn: its residual blocks (attention, then
    MLP: the MLP calibrated on the quantized attention's output, and SmoothQuant's statistics cost no forward
    at all), or the whole layer (None) when a modifier calibrates on the full-precision layer, as
    llm-compressor does (`Modifier.per_block`). GPTQ and AWQ do: on SmolLM2 (w4a16-gptq, 16 x 512 calibration
    tokens, GPL-3 perplexity) per-block GPTQ scored 37.60 and 38.24, per-layer 35.80, 36.31 and 37.48, each
    pair differing only by float rounding in the solve (GPTQ's 4-bit codes diverge from layer to layer: a
    spread of about 5 %)."""
    return job.arch.blocks if all(m.per_block for m in job.recipe.modifiers) else (None,)


@torch.no_grad()
def convert_layer(job: LayerJob, state: StreamState, index: int) -> None:
    """Load, calibrate, quantize and write decoder layer `index`, then move `state` past it."""
    arch, prefix = job.arch, job.arch.layer_prefix(index)
    layer = fast_layer(
        arch.build_layer(index, job.reader.get_prefix(prefix, torch.float32)).to(job.device), job.gemm_dtype
    )
    targets, layer_ignored, layer_fallbacks = layer_targets(layer, prefix, job.schemes)
    state.ignored += layer_ignored
    state.fallbacks.update(layer_fallbacks)
    state.fallback_targets.update(
        {prefix + n: t for n, t in targets.items() if prefix + n in layer_fallbacks}
    )
    state.eval_fp = _forward_all(arch, layer, state.eval_fp)
    ctx = LayerContext(
        index,
        prefix,
        arch,
        layer,
        state.inputs,
        {},
        job.scale_dtype,
        job.source_block_size,
        job.source_float_min,
    )
    for block in _blocks(job):
        ctx.block, ctx.inputs, ctx.propagated = block, state.inputs, None
        ctx.propagate_in_place = block is None and len(job.recipe.modifiers) == 1
        ctx.targets = {n: t for n, t in targets.items() if block is None or block.contains(n)}
        for modifier in job.recipe.modifiers:
            modifier.process_layer(ctx)
        missing = sorted(set(ctx.targets) - set(ctx.results))
        if missing:
            raise AscqError(f"layer {index}: no modifier in the recipe quantized {prefix}{missing[0]}")
        _round_as_written(layer, block, job.dtype)
        install_quantized(layer, {n: (targets[n], ctx.results[n]) for n in ctx.targets}, integer_gemm=True)
        k_scale, v_scale = (
            ctx.extra_tensors.get("self_attn.k_scale"),
            ctx.extra_tensors.get("self_attn.v_scale"),
        )
        kv_hook = fp8_kv_hook(k_scale, v_scale) if k_scale is not None else None
        if ctx.propagated is not None and kv_hook is None:
            state.inputs = ctx.propagated
        else:
            state.inputs = _forward_all(arch, layer, state.inputs, kv_hook, block)
        state.eval_q = _forward_all(arch, layer, state.eval_q, kv_hook, block)
    _write_layer(job.writer, prefix, layer, targets, ctx, job.dtype)
    state.num_quantized += len(targets)
    state.names_seen.update(scheme_name(t) for t in targets.values())
    if ctx.report:
        state.reports[index] = ctx.report


@torch.no_grad()
def stream_convert(
    reader: CheckpointReader,
    arch: Architecture,
    recipe: ComposedRecipe,
    calib_ids: torch.Tensor,
    out_dir: Path,
    device: str = "cpu",
    max_shard_bytes: int = 1 << 30,
    eval_ids: torch.Tensor | None = None,
    progress: bool = True,
    writer: ShardWriter | None = None,
    source_block_size: int | None = None,
    source_float_min: bool = False,
    gemm_dtype: torch.dtype = torch.float32,
) -> StreamResult:
    """`writer` picks the output format (default: compressed-tensors shards; see
    msmodelslim.MsModelSlimWriter); `source_block_size`: the source checkpoint's quantization block
    (`qmath.source_block_size`), `source_float_min`: whether its blocks have float minima
    (`qmath.source_has_float_min`); `gemm_dtype`: the linears' products in the forwards
    (`calibration_gemm_dtype`)."""
    if arch.has_routed_experts:
        return_freed_memory_to_os()
    dtype, scale_dtype = checkpoint_dtypes(reader)
    embed = reader.get("model.embed_tokens.weight")
    calib_batches = _batches(arch, embed, calib_ids, device)
    mixed = plan_mixed_precision(
        reader, arch, recipe.schemes(), calib_batches, device, scale_dtype, gemm_dtype
    )
    job = LayerJob(
        reader,
        arch,
        recipe,
        writer or ShardWriter(out_dir, max_shard_bytes),
        device,
        dtype,
        scale_dtype,
        source_block_size,
        source_float_min,
        gemm_dtype,
    )
    job.writer.add("model.embed_tokens.weight", embed)
    windows = eval_windows(eval_ids, EVAL_SEQ_LEN) if eval_ids is not None else None
    eval_batches = _batches(arch, embed, windows, device) if windows is not None else []
    state = StreamState(calib_batches, eval_batches, eval_batches)
    del embed, calib_batches
    for index in tqdm(range(arch.num_layers), desc="converting layers", unit="layer", disable=not progress):
        convert_layer(job, state, index)
        trim_heap()
    result = _finish(job, state, windows)
    result.mixed = mixed
    return result


def quantized_head(
    head: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype
) -> tuple[QuantizedLinear, torch.Tensor]:
    """The LM head rounded to nearest on `args` (int8 per output channel: each vocabulary row its own
    scale), and its dequantized fp32 weight."""
    q, scale, zero_point = observer.quantize_weight(head.float(), args, scale_dtype)
    return QuantizedLinear(q, scale, zero_point), qmath.dequantize_weight(q, scale, zero_point, args).float()


def _finish(job: LayerJob, state: StreamState, windows: torch.Tensor | None) -> StreamResult:
    """Write the final norm and the head (quantized as `RecipeScheme.lm_head` says: a tied embedding's is
    written as an untied `lm_head`, since transformers' compressed-tensors loader does not decompress a
    quantized `Embedding`), close the writer, and measure perplexity before/after."""
    reader = job.reader
    norm = reader.get("model.norm.weight")
    job.writer.add("model.norm.weight", norm)
    head_name = "lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight"
    head_owner = next((s for s in job.schemes if s.lm_head is not None), None)
    head = reader.get(head_name)
    quantized = dict(state.fallback_targets)
    head_record = None
    if head_owner is not None:
        target = LinearTarget(head_owner.lm_head, None, head_owner)
        ql, head = quantized_head(head, head_owner.lm_head, job.scale_dtype)
        job.writer.add_linear("lm_head", target, ql, None)
        quantized["lm_head"] = target
        head_record = {
            "scheme": "int8 per output channel, symmetric, round-to-nearest",
            "untied_from_embedding": head_name != "lm_head.weight",
        }
    elif "lm_head.weight" in reader:
        job.writer.add("lm_head.weight", head)
    ignored = [  # tied or not (schemes.ALWAYS_IGNORE)
        *(["lm_head"] if head_owner is None else []),
        "model.embed_tokens",
        *state.ignored,
    ]
    job.writer.finish()
    result = StreamResult(
        qconfig=quantization_config(job.schemes, quantized, ignored),
        lm_head=head_record,
        scheme="+".join(sorted(state.names_seen)) or "dense",
        fallbacks=state.fallbacks,
        group_size_fits=job.group_size_fits,
        layers=state.reports,
        num_quantized_linears=state.num_quantized,
    )
    if windows is not None:
        base_head = reader.get(head_name).float().to(job.device)
        result.perplexity_base = _perplexity(state.eval_fp, windows, norm, base_head, job.arch)
        result.perplexity = _perplexity(state.eval_q, windows, norm, head.float().to(job.device), job.arch)
    return result


def _perplexity(
    hidden: list[torch.Tensor],
    windows: torch.Tensor,
    norm: torch.Tensor,
    head: torch.Tensor,
    arch: Architecture,
) -> float:
    """`ascq.evaluate.perplexity` over the windows whose last hidden states are `hidden` (same order, same
    batches)."""
    batches = iter(hidden)

    def logits_fn(batch_ids: torch.Tensor) -> torch.Tensor:
        h = next(batches)
        if h.shape[0] != batch_ids.shape[0]:
            raise RuntimeError("eval batches out of order")
        return arch.final_norm(h, norm.to(h.device)) @ head.T

    return perplexity(logits_fn, windows.flatten(), EVAL_SEQ_LEN, batch_size=BATCH_SIZE)

"""AWQ (Lin et al., MLSys 2024) as AutoAWQ implements it: activation-aware scale search, then clip search.

For one balance group (the linears that read the same input, e.g. q/k/v after `input_layernorm`):
  x_mean = mean |x| per input channel, w_mean = group-normalised |W| averaged over output rows,
  s(α) = x_mean^α / w_mean^(1-α), normalised by sqrt(max·min), for α on a 20-step grid;
  the α whose fake-quantised weights `Q(W·s)/s` give the smallest MSE of the block's output wins.
The scales are then folded into the producer of the group's input (the RMSNorm weight or the previous linear's
rows), which leaves the full-precision function unchanged. The clip search then shrinks each weight group's
range by up to 50% and keeps the shrink that minimises that group's partial-output MSE.

`fake_quantize` is the caller's quantize-dequantize of a weight matrix (the recipe's scheme); the functions
here only search and fold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ascq.kernels import native
from ascq.quantize.observer import MinMaxGrid

FakeQuantize = Callable[[torch.Tensor], torch.Tensor]

# weight elements quantized per call of the clip search (shrink steps stacked as rows)
CLIP_STACK_ELEMENTS = 8 << 20
WEIGHT_MEAN_ROWS = 4096  # rows per step of `weight_mean`


@dataclasses.dataclass
class AWQSearchConfig:
    num_grid: int = 20  # α steps in [0, 1)
    duo_scaling: bool = True  # False: s = x_mean^α (the paper's first variant)
    max_shrink: float = 0.5  # the clip search shrinks a group's max by up to this fraction
    num_clip_steps: int = 20
    max_clip_tokens: int = 512  # tokens sampled for the clip search
    max_search_tokens: int = 4096  # calibration tokens the α search runs its block on (mean |x| uses all)
    group_size: int = 128
    # also score s = 1 (no smoothing; reported as α None): the modifier sets it where the weights already lie
    # on the quantization grid (a GGUF source kept by float zero points), which any other s moves them off
    identity_candidate: bool = False
    # > 0: the block loss judges only this many grid points, those with the smallest loss of the linears' own
    # outputs (the Gram loss, no forward); 0: every grid point runs the block
    shortlist: int = 0

    def __post_init__(self) -> None:
        if self.num_grid < 1 or self.num_clip_steps < 1:
            raise ValueError("AWQ: num_grid and num_clip_steps must be >= 1")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError("AWQ: max_shrink must be in [0, 1)")
        if self.group_size < 1 or self.max_clip_tokens < 1 or self.max_search_tokens < 1:
            raise ValueError("AWQ: group_size, max_clip_tokens and max_search_tokens must be >= 1")
        if self.shortlist < 0:
            raise ValueError("AWQ: shortlist must be >= 0")


def activation_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean |x| per input channel over all tokens: [..., in] -> [in] (float32)."""
    return x.reshape(-1, x.shape[-1]).float().abs().mean(dim=0)


def weight_mean(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """|W| normalised by its quantization group's max, averaged over all output rows of the group: -> [in].
    Summed WEIGHT_MEAN_ROWS rows at a time (a MoE block's experts together hold GiBs in fp32)."""
    total = None
    num_rows = 0
    for weight in weights:
        cols = weight.shape[1]
        size = _group(cols, group_size)
        for rows in weight.split(WEIGHT_MEAN_ROWS):
            w = rows.float().abs().view(-1, size)
            w = w / w.amax(dim=1, keepdim=True).clamp(min=1e-12)
            part = w.view(rows.shape[0], cols).sum(dim=0)
            total = part if total is None else total + part
        num_rows += weight.shape[0]
    return total / num_rows


def _group(in_features: int, group_size: int) -> int:
    """The caller passes the linear's own group size (`qmath.linear_group_size`; in_features when per
    channel)."""
    if in_features % group_size:
        raise ValueError(f"AWQ: in_features {in_features} is not a multiple of group_size {group_size}")
    return group_size


def duo_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """s = x_mean^α / w_mean^(1-α) (or x_mean^α without w_mean), normalised so that max·min = 1."""
    if w_mean is None:
        scales = x_mean.pow(alpha).clamp(min=1e-4)
    else:
        scales = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """Scales rounded to the nearest power of two (in log space): multiplying or dividing a float by them is
    exact, so a full-precision consumer folded with them (the MoE router) computes bit for bit what it did
    before."""
    return torch.exp2(torch.log2(scales).round())


@torch.no_grad()
def search_scales(
    x_mean: torch.Tensor,
    linears: Sequence[nn.Linear],
    block_output: Callable[[], torch.Tensor] | None,
    fake_quantize: FakeQuantize | Sequence[FakeQuantize],
    config: AWQSearchConfig,
    exact: bool = False,
    gram: torch.Tensor | None = None,
    rows_independent: bool = False,
    minmax_grids: Sequence[MinMaxGrid | None] = (),
) -> tuple[torch.Tensor, float | None, list[float]]:
    """Best per-input-channel scales for `linears` (which all read the same input, of mean |x| `x_mean`).

    `exact`: every candidate is rounded to powers of two (`power_of_two`), for groups whose producer also
    feeds a linear that stays full precision.

    `block_output()` runs the computation that contains the linears (e.g. the attention or MLP module) on the
    calibration input with the linears' current weights. Returns (scales [in], best α, loss per judged α); the
    linears' weights are restored before returning. `fake_quantize` may be one function or one per linear.

    `gram`: their shared input's xᵀx / n, for the loss of the linears' own outputs: mean((x·Dᵀ)²) of a weight
    change D (the linears' changes stacked as rows) is Σ (D·G) ⊙ D / out, without running anything (out · in²
    instead of n · out · in multiply-adds per grid point; equal up to float rounding); or, where the input has
    fewer rows than columns, those rows x [n, in] (mean((x·Dᵀ)²) from them is then the cheaper form). With
    `gram` alone that loss judges (exact when the block is one linear); with both, it only shortlists the
    `config.shortlist` best grid points for the block loss (all of them when shortlist is 0).
    `rows_independent`: every quantizer treats each row on its own, so the scaled weights of several grid
    points are stacked as rows and quantized in one call. `minmax_grids` (one per linear): where every
    linear's `fake_quantize` is min-max round-to-nearest on the native kernel, each candidate's Q(W·s)/s is
    one native call per linear.
    """
    if block_output is None and gram is None:
        raise ValueError("AWQ: search_scales needs block_output or gram")
    quantizers = [fake_quantize] * len(linears) if callable(fake_quantize) else list(fake_quantize)
    w_mean = weight_mean([lin.weight for lin in linears], config.group_size) if config.duo_scaling else None
    # s = 1, reported as α None
    candidates = [(None, torch.ones_like(x_mean))] if config.identity_candidate else []
    candidates += [
        (step / config.num_grid, duo_scales(x_mean, w_mean, step / config.num_grid))
        for step in range(config.num_grid)
    ]
    if exact:
        candidates = [(alpha, power_of_two(scales)) for alpha, scales in candidates]
    # kept as they are: the candidates replace the weight tensors, never write into them
    originals = [lin.weight.data for lin in linears]

    def linear_loss() -> float:
        change = torch.cat(
            [lin.weight.float() - w.float() for lin, w in zip(linears, originals, strict=True)]
        )
        if gram.shape[0] < gram.shape[1]:  # the input's rows themselves
            return (gram @ change.t()).pow(2).mean().item()
        return ((change @ gram) * change).sum().item() / change.shape[0]

    reference = block_output().float() if block_output is not None else None
    try:
        if gram is not None and (block_output is None or 0 < config.shortlist < len(candidates)):
            losses = _candidate_losses(
                candidates, linears, originals, quantizers, linear_loss, rows_independent, minmax_grids
            )
            if block_output is not None:
                best_first = sorted(range(len(candidates)), key=losses.__getitem__)
                candidates = [candidates[i] for i in sorted(best_first[: config.shortlist])]
        if block_output is not None:
            losses = _candidate_losses(
                candidates,
                linears,
                originals,
                quantizers,
                lambda: (block_output().float() - reference).pow(2).mean().item(),
                rows_independent,
                minmax_grids,
            )
    finally:
        for lin, w in zip(linears, originals, strict=True):
            lin.weight.data = w
    best = min(range(len(candidates)), key=losses.__getitem__)
    alpha, scales = candidates[best]
    if not torch.isfinite(scales).all():
        raise FloatingPointError("AWQ scale search produced non-finite scales")
    return scales, alpha, losses


def _candidate_losses(
    candidates: list[tuple[float | None, torch.Tensor]],
    linears: Sequence[nn.Linear],
    originals: list[torch.Tensor],
    quantizers: list[FakeQuantize],
    loss: Callable[[], float],
    rows_independent: bool,
    minmax_grids: Sequence[MinMaxGrid | None] = (),
) -> list[float]:
    """`loss()` with each candidate's fake-quantized weights Q(W·s)/s set on `linears` (left set on
    return)."""
    if minmax_grids and all(grid is not None for grid in minmax_grids):
        weights = [w.float() for w in originals]
        losses = []
        for _, scales in candidates:
            for lin, w, original, grid in zip(linears, weights, originals, minmax_grids, strict=True):
                lin.weight.data = grid.fake_quantize(w, scales.float()).to(original.dtype)
            losses.append(loss())
        return losses
    largest = max(w.numel() for w in originals)
    per_call = max(1, CLIP_STACK_ELEMENTS // largest) if rows_independent else 1
    losses = []
    for first in range(0, len(candidates), per_call):
        chunk = candidates[first : first + per_call]
        stacked = torch.stack([scales for _, scales in chunk])[:, None, :]  # [k, 1, in]
        quantized = [
            (
                quantize((w.float()[None] * stacked).view(-1, w.shape[1])).view(len(chunk), *w.shape)
                / stacked
            ).to(w.dtype)
            for w, quantize in zip(originals, quantizers, strict=True)
        ]
        for index in range(len(chunk)):
            for lin, q in zip(linears, quantized, strict=True):
                lin.weight.data = q[index]
            losses.append(loss())
    return losses


@torch.no_grad()
def fold_into_norm(norm: nn.Module, consumers: Sequence[nn.Linear], scales: torch.Tensor) -> None:
    """norm's multiplier /= s and every consumer's input columns *= s: the composed function is unchanged.

    `consumers` includes every linear that reads the norm's output (for MoE, the router too, unquantized).
    """
    offset = getattr(norm, "weight_offset", 0.0)  # Gemma's norms multiply by (1 + weight)
    norm.weight.data = ((norm.weight.float() + offset) / scales - offset).to(norm.weight.dtype)
    if getattr(norm, "bias", None) is not None:
        norm.bias.data = (norm.bias.float() / scales).to(norm.bias.dtype)
    for lin in consumers:
        lin.weight.data = (lin.weight.float() * scales).to(lin.weight.dtype)


@torch.no_grad()
def fold_into_linear(producer: nn.Linear, consumers: Sequence[nn.Linear], scales: torch.Tensor) -> None:
    """producer's output rows /= s and the consumers' input columns *= s (v->o, up->down)."""
    producer.weight.data = (producer.weight.float() / scales[:, None]).to(producer.weight.dtype)
    if producer.bias is not None:
        producer.bias.data = (producer.bias.float() / scales).to(producer.bias.dtype)
    for lin in consumers:
        lin.weight.data = (lin.weight.float() * scales).to(lin.weight.dtype)


def sample_tokens(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """At most `max_tokens` rows of `x` flattened to [tokens, features], evenly spaced."""
    x = x.reshape(-1, x.shape[-1]).float()
    step = max(1, x.shape[0] // max_tokens)
    return x[::step][:max_tokens]


@torch.no_grad()
def search_clip(
    weight: torch.Tensor,
    x: torch.Tensor,
    fake_quantize: FakeQuantize,
    config: AWQSearchConfig,
    rows_independent: bool = False,
    minmax_grid: MinMaxGrid | None = None,
) -> torch.Tensor:
    """Per (output row, group) clip bound max|w| · (1 - shrink), shrink in {0, max_shrink/steps, ...,
    max_shrink}.

    Each group's bound minimises the MSE of its partial output x_g · w_gᵀ over the sampled tokens `x`: with d
    = q_g - w_g that is d · H_g · dᵀ / n, H_g = x_gᵀ x_g, evaluated from the per-group Gram matrices when a
    group is shorter than the token count (out · in · s multiply-adds per step instead of n · out · in, and no
    [n, out, groups] temporaries). `rows_independent`: `fake_quantize` treats every row on its own
    (per-channel or per-group parameters), so several shrink steps are stacked as extra rows and quantized in
    one call. `minmax_grid`: `fake_quantize` is min-max round-to-nearest on that grid, and the search runs in
    one native call (group_fake_quant.c: the same steps per group, the errors summed in its own order).
    Returns max_val [out, num_groups].
    """
    w = weight.float()
    out_dim, in_dim = w.shape
    size = _group(in_dim, config.group_size)
    num_groups = in_dim // size
    xs = sample_tokens(x, config.max_clip_tokens).view(-1, num_groups, size)  # [n, g, s]
    w_groups = w.view(out_dim, num_groups, size)
    original_max = w.abs().view(out_dim, num_groups, size).amax(dim=-1)  # [out, g]
    gram = torch.einsum("ngs,ngt->gst", xs, xs) / xs.shape[0] if size < xs.shape[0] else None  # [g, s, s]
    steps = range(config.num_clip_steps + 1)
    shrinks = [1 - config.max_shrink * step / config.num_clip_steps for step in steps]
    if minmax_grid is not None and minmax_grid.group_len == size:
        return native.awq_clip_search(
            w.contiguous(),
            size,
            None if gram is None else gram.contiguous(),
            None if gram is not None else xs.reshape(xs.shape[0], -1).contiguous(),
            torch.tensor(shrinks),
            minmax_grid.q_range,
            minmax_grid.symmetric,
            minmax_grid.scale_dtype,
        )
    reference = torch.einsum("ngs,ogs->nog", xs, w_groups) if gram is None else None
    best_err = torch.full_like(original_max, float("inf"))
    best_max = original_max.clone()
    steps = list(steps)
    per_call = max(1, CLIP_STACK_ELEMENTS // w.numel()) if rows_independent else 1
    for first in range(0, len(steps), per_call):
        chunk = steps[first : first + per_call]
        shrink = torch.tensor([shrinks[step] for step in chunk])
        max_vals = original_max[None] * shrink[:, None, None]  # [k, out, g]
        bound = max_vals.repeat_interleave(size, dim=2)  # [k, out, in]
        clipped = torch.maximum(torch.minimum(w[None], bound), -bound)
        q = fake_quantize(clipped.view(-1, in_dim)).view(len(chunk), out_dim, num_groups, size)
        if gram is None:
            err = (torch.einsum("ngs,kogs->knog", xs, q) - reference).pow(2).mean(dim=1)  # [k, out, g]
        else:
            d = q - w_groups
            err = (torch.einsum("kogs,gst->kogt", d, gram) * d).sum(dim=-1)
        for err_k, max_k in zip(err, max_vals, strict=True):  # in step order: ties keep the smaller shrink
            better = err_k < best_err
            best_err = torch.where(better, err_k, best_err)
            best_max = torch.where(better, max_k, best_max)
    return best_max


@torch.no_grad()
def apply_clip(linear: nn.Linear, max_val: torch.Tensor) -> None:
    """Clamp each (row, group) of the weight to [-max_val, max_val]."""
    w = linear.weight
    bound = max_val.repeat_interleave(w.shape[1] // max_val.shape[1], dim=1).to(w.dtype)
    w.data = torch.maximum(torch.minimum(w.data, bound), -bound)

"""Mixed precision under a bits budget: which weight scheme each linear gets (`bits_per_weight`).

Before the layer loop, one full-precision pass over the calibration data (`measure_sensitivity`) records each
target linear's input importance h_j = mean x_j² per input column (the diagonal of GPTQ's Hessian, llama.cpp's
imatrix). A linear's error under a candidate scheme c is then Σ_i Σ_j h_j (w_ij - Q_c(w)_ij)²: the mean square
of the error its quantized weight adds to its output per token, without the Hessian's off-diagonal terms
(`weighted_error`). Linears that read the same input (q/k/v, gate/up: what vLLM and ascq's runtime fuse into
one product, which must have one scheme) form one unit. `allocate` spends the budget greedily on the unit
upgrades with the most error removed per extra stored bit, along each unit's lower convex hull of (bits,
error): the multiple-choice knapsack's greedy, optimal for its relaxation.

Bits are counted as the card counts them (`ascq.zoo.card.quantized_weight_bits`): the stored weights, scales
and zero points (`formats.compressed_tensors.linear_stored_bits`) over the quantized parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from torch import nn

from ascq.core.errors import AscqError, UnsupportedError
from ascq.formats import compressed_tensors as ct
from ascq.quantize import observer

# candidate name -> the weight arguments it changes in the recipe's int4 group scheme
CANDIDATES: dict[str, dict[str, Any]] = {
    "int8": {"num_bits": 8, "strategy": "channel", "group_size": None},
    "int4-g32": {"num_bits": 4, "strategy": "group", "group_size": 32},
    "int4-g64": {"num_bits": 4, "strategy": "group", "group_size": 64},
    "int4-g128": {"num_bits": 4, "strategy": "group", "group_size": 128},
}
DEFAULT_CANDIDATES = tuple(CANDIDATES)


@dataclasses.dataclass(frozen=True)
class BitsBudget:
    """A recipe scheme's budget: mean stored bits per quantized weight over its linears, and the schemes
    each linear may get."""

    bits_per_weight: float
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES


def check_budget(owner: str, bits_per_weight: Any, candidates: Any) -> BitsBudget:
    if isinstance(bits_per_weight, bool) or not isinstance(bits_per_weight, (int, float)):
        raise AscqError(f"{owner}: bits_per_weight must be a number, got {bits_per_weight!r}")
    if not 2 < bits_per_weight <= 16:
        raise AscqError(f"{owner}: bits_per_weight {bits_per_weight} is outside (2, 16]")
    names = DEFAULT_CANDIDATES if candidates is None else candidates
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise AscqError(f"{owner}: mixed_schemes must be a non-empty list of names, got {candidates!r}")
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise UnsupportedError(
            f"{owner}: mixed_schemes {unknown[0]!r} is not supported; use some of {', '.join(CANDIDATES)}"
        )
    return BitsBudget(float(bits_per_weight), tuple(dict.fromkeys(names)))


def check_base_scheme(owner: str, scheme: QuantizationScheme) -> None:
    """The scheme a budget varies: weight-only int4 per group with integer zero points (W4A16 /
    W4A16_ASYM)."""
    w = scheme.weights
    if (
        scheme.input_activations is not None
        or w.num_bits != 4
        or str(w.strategy) != "group"
        or (w.zp_dtype is not None and w.zp_dtype.is_floating_point)
    ):
        raise UnsupportedError(
            f"{owner}: bits_per_weight varies a weight-only int4 group scheme with integer zero points "
            "(W4A16, W4A16_ASYM)"
        )


def candidate_args(base: QuantizationArgs, name: str) -> QuantizationArgs:
    """The recipe's weight arguments (symmetry, observer) with candidate `name`'s bits and grouping."""
    return base.model_copy(update=CANDIDATES[name])


def candidate_fits(args: QuantizationArgs, in_features: int) -> bool:
    return args.strategy != "group" or in_features % int(args.group_size) == 0


def stored_bits(args: QuantizationArgs, out_features: int, in_features: int) -> int:
    return ct.linear_stored_bits(args, None, out_features, in_features)


def weighted_error(
    weight: torch.Tensor, importance: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype
) -> float:
    """Σ_ij h_j (w_ij - Q(w)_ij)²: the output error's mean square per token that round-to-nearest on `args`
    adds, with `importance` h = mean x² per input column (the off-diagonal terms of xᵀx left out)."""
    w = weight.float()
    error = observer.fake_quantize_weight(w, args, scale_dtype).float() - w
    return float((error.pow(2) * importance.float()[None]).sum())


@dataclasses.dataclass
class Unit:
    """Linears that read one input (full names), and per candidate (name, stored bits, weighted error)."""

    names: list[str]
    params: int
    options: list[tuple[str, int, float]]


def _hull(options: Sequence[tuple[str, int, float]]) -> list[tuple[str, int, float]]:
    """The options on the lower convex hull of (bits, error), by increasing bits, each removing error: the
    only ones a greedy over error removed per bit reaches."""
    best: dict[int, tuple[str, int, float]] = {}
    for option in options:  # the smallest error at each bit count
        if option[1] not in best or option[2] < best[option[1]][2]:
            best[option[1]] = option
    hull: list[tuple[str, int, float]] = []
    for option in sorted(best.values(), key=lambda o: o[1]):
        if hull and option[2] >= hull[-1][2]:
            continue  # more bits, no less error
        while len(hull) >= 2:
            (_, b0, e0), (_, b1, e1) = hull[-2], hull[-1]
            # the middle point lies on or above the line from hull[-2] to the new option
            if (e0 - e1) * (option[1] - b0) <= (e0 - option[2]) * (b1 - b0):
                hull.pop()
            else:
                break
        hull.append(option)
    return hull


def allocate(units: Sequence[Unit], bits_per_weight: float) -> list[str]:
    """One candidate name per unit, total stored bits <= bits_per_weight x total parameters: every unit
    starts at its fewest bits, then the upgrades along the units' hulls are taken in order of error removed
    per extra bit while they fit (one that does not fit is skipped, a cheaper later one may still)."""
    budget = bits_per_weight * sum(u.params for u in units)
    hulls = [_hull(u.options) for u in units]
    spent = sum(h[0][1] for h in hulls)
    if spent > budget:
        raise AscqError(
            f"bits_per_weight {bits_per_weight} is below the fewest bits the candidates allow "
            f"({spent / sum(u.params for u in units):.3f})"
        )
    steps = [
        ((h[k][2] - h[k + 1][2]) / (h[k + 1][1] - h[k][1]), i, k)
        for i, h in enumerate(hulls)
        for k in range(len(h) - 1)
    ]
    level = [0] * len(units)
    # by gain per bit; along one hull the gains decrease, so a unit's steps come in order
    for _, i, k in sorted(steps, key=lambda s: (-s[0], s[1], s[2])):
        if level[i] != k:
            continue  # an earlier step of this unit did not fit
        extra = hulls[i][k + 1][1] - hulls[i][k][1]
        if spent + extra <= budget:
            spent += extra
            level[i] = k + 1
    return [h[level[i]][0] for i, h in enumerate(hulls)]


@dataclasses.dataclass
class MixedPlan:
    """What the allocation chose (recorded in the manifest as `conversion.mixed_precision`)."""

    target_bits_per_weight: float
    candidates: tuple[str, ...]
    choice: dict[str, str]  # full linear name -> candidate
    bits: int
    params: int
    errors: dict[str, dict[str, float]]  # unit (its first linear) -> candidate -> weighted error

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.params

    def record(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for name in self.choice.values():
            counts[name] = counts.get(name, 0) + 1
        return {
            "target_bits_per_weight": self.target_bits_per_weight,
            "bits_per_weight": round(self.bits_per_weight, 4),
            "candidates": list(self.candidates),
            "num_linears": dict(sorted(counts.items())),
            "sensitivity": "sum_j mean(x_j^2) * sum_i (w_ij - Q(w)_ij)^2, round-to-nearest",
            "choice": dict(self.choice),
            "errors": self.errors,
        }


def build_units(
    linears: dict[str, tuple[nn.Linear, QuantizationArgs]],
    importance: dict[str, torch.Tensor],
    shared: list[list[str]],
    budget: BitsBudget,
    scale_dtype: torch.dtype,
) -> list[Unit]:
    """A unit per list of `shared` (linears reading one input; names of `linears`, full names), with every
    candidate that fits all its linears' widths."""
    units = []
    for names in shared:
        options = []
        for candidate in budget.candidates:
            bits, error = 0, 0.0
            fits = True
            for name in names:
                linear, base = linears[name]
                args = candidate_args(base, candidate)
                out_features, in_features = linear.weight.shape
                if not candidate_fits(args, in_features):
                    fits = False
                    break
                bits += stored_bits(args, out_features, in_features)
                error += weighted_error(linear.weight, importance[name], args, scale_dtype)
            if fits:
                options.append((candidate, bits, error))
        if not options:
            raise UnsupportedError(
                f"no candidate of {', '.join(budget.candidates)} fits the input width of {names[0]}"
            )
        params = sum(linears[n][0].weight.numel() for n in names)
        units.append(Unit(list(names), params, options))
    return units


def plan_from_units(units: list[Unit], budget: BitsBudget) -> MixedPlan:
    picks = allocate(units, budget.bits_per_weight)
    choice, bits = {}, 0
    for unit, pick in zip(units, picks, strict=True):
        choice.update(dict.fromkeys(unit.names, pick))
        bits += next(b for name, b, _ in unit.options if name == pick)
    return MixedPlan(
        budget.bits_per_weight,
        budget.candidates,
        choice,
        bits,
        sum(u.params for u in units),
        {u.names[0]: {name: error for name, _, error in u.options} for u in units},
    )


def mixed_config_groups(base: QuantizationScheme, choice: dict[str, str]) -> dict[str, QuantizationScheme]:
    """One config group per chosen candidate, targeting its linears by full name (what vLLM's and
    transformers' compressed-tensors matchers select exactly), in the candidates' order."""
    groups = {}
    for candidate in CANDIDATES:
        names = [n for n, c in choice.items() if c == candidate]
        if names:
            groups[f"mixed_{candidate.replace('-', '_')}"] = QuantizationScheme(
                targets=names,
                weights=candidate_args(base.weights, candidate),
                input_activations=None,
            )
    return groups

"""MoE calibration coverage: how many calibration tokens each routed expert saw, and what to calibrate it on.

With a small calibration set some experts receive few or no routed tokens; statistics from them (AWQ's mean
|x|, GPTQ's Hessian) would be empty or noisy and give NaN/inf scales. An expert below `min_tokens` is
calibrated on every token that reaches the MoE block, passed through it densely (calibrate-all-experts mode,
as llm-compressor's `moe_calibrate_all_experts`); the manifest lists the per-expert token counts and which
experts fell back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

DEFAULT_MIN_TOKENS = 8
_EXPERT = re.compile(r"^(?P<moe>.+)\.experts\.(?P<index>\d+)$")


@dataclasses.dataclass
class ExpertCoverage:
    min_tokens: int = DEFAULT_MIN_TOKENS
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # expert module name -> routed tokens

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")

    def needs_dense(self, expert: str) -> bool:
        """Below the threshold, or no routed token at all (even with min_tokens = 0: never empty
        statistics)."""
        return self.tokens.get(expert, 0) < max(1, self.min_tokens)

    def report(self) -> dict[str, Any]:
        """Per MoE block: routed token count per expert index and the experts calibrated densely."""
        blocks: dict[str, dict[str, Any]] = {}
        for name, count in sorted(self.tokens.items(), key=lambda kv: _sort_key(kv[0])):
            match = _EXPERT.match(name)
            moe, index = (match["moe"], int(match["index"])) if match else (name, -1)
            block = blocks.setdefault(
                moe, {"min_tokens": self.min_tokens, "tokens_per_expert": [], "dense_fallback": []}
            )
            block["tokens_per_expert"].append(count)
            if count < max(1, self.min_tokens):
                block["dense_fallback"].append(index)
        return blocks


@dataclasses.dataclass
class CoverageLog:
    """The expert coverage a modifier saw in every MoE layer (its manifest summary's `expert_coverage`)."""

    owner: str  # the modifier's name, for the error message
    min_tokens: int = DEFAULT_MIN_TOKENS
    # full MoE block name -> ExpertCoverage.report()
    blocks: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            from ascq.quantize.schemes import RecipeError

            raise RecipeError(f"{self.owner}: min_expert_tokens must be >= 0")

    def layer(self, prefix: str, tokens: dict[str, int]) -> ExpertCoverage:
        """The coverage of one layer's experts (routed token counts by relative name), recorded under
        `prefix`."""
        coverage = ExpertCoverage(self.min_tokens, tokens)
        self.blocks.update({f"{prefix}{k}": v for k, v in coverage.report().items()})
        return coverage


def _sort_key(name: str) -> tuple[str, int]:
    match = _EXPERT.match(name)
    return (match["moe"], int(match["index"])) if match else (name, -1)


def num_tokens(inputs: list[torch.Tensor]) -> int:
    return sum(x.reshape(-1, x.shape[-1]).shape[0] for x in inputs)


@torch.no_grad()
def dense_mlp_inputs(expert: nn.Module, block_inputs: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The inputs each linear of a gated MLP expert receives when *every* token goes through it."""
    flat = [x.reshape(-1, x.shape[-1]) for x in block_inputs]
    down = [torch.nn.functional.silu(expert.gate_proj(x)) * expert.up_proj(x) for x in flat]
    return {"gate_proj": flat, "up_proj": flat, "down_proj": down}

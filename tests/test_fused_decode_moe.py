"""Fused decode of DeepSeek-MoE (ascq/runtime/worker/fused_moe.py, the MoE block of
ascq/kernels/fused_decode.c, the routing of ascq/kernels/torch_cpu_ops.c): the eager path's hidden states bit
for bit on the tiny fixture in bf16, W4A16 and W8A16, batches 1 and 4 whose rows pick different (and shared)
experts, with and without renormalized routing weights; the native routing against torch's; what stays
eager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fused_decode_support import PROMPTS, assert_fused_matches_eager, rows_bound_of_at_least_eight  # noqa: F401
from native_support import needs_native

from ascq import LLM
from ascq.kernels import cpu
from ascq.runtime.worker import fused_decode, fused_moe

pytestmark = needs_native


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The expert ids eager steps of up to 4 rows route to (the routing probe's larger batches left out)."""
    calls: list[torch.Tensor] = []
    select = cpu.select_experts

    def recording(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select(logits, top_k, renormalize)
        if logits.shape[0] <= 4:
            calls.append(ids.clone())
        return weights, ids

    monkeypatch.setattr(cpu, "select_experts", recording)
    return calls


def assert_rows_route_apart_and_together(routed: list[torch.Tensor]) -> None:
    """Some step's rows chose different experts, and some expert took several rows of one step."""
    batched = [ids for ids in routed if ids.shape[0] > 1]
    assert batched
    assert any(len({frozenset(row.tolist()) for row in ids}) > 1 for ids in batched)
    assert any(ids.flatten().bincount().max() > 1 for ids in batched)


def test_bf16_fused_matches_eager(
    tiny_deepseek_moe_dir: Path, monkeypatch: pytest.MonkeyPatch, routed: list[torch.Tensor]
) -> None:
    assert assert_fused_matches_eager(tiny_deepseek_moe_dir, "bfloat16", monkeypatch) >= 11  # batch 4
    assert_rows_route_apart_and_together(routed)
    assert assert_fused_matches_eager(tiny_deepseek_moe_dir, "bfloat16", monkeypatch, PROMPTS[2:3]) == 11


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w8a16"])
def test_weight_only_fused_matches_eager(
    recipe: str,
    tiny_deepseek_moe_dir: Path,
    converted_entry,
    monkeypatch: pytest.MonkeyPatch,
    routed: list[torch.Tensor],
) -> None:
    entry = converted_entry(tiny_deepseek_moe_dir, (recipe,), num_samples=4, seq_len=16, max_eval_tokens=256)
    assert assert_fused_matches_eager(entry, "auto", monkeypatch) >= 11
    assert_rows_route_apart_and_together(routed)
    assert assert_fused_matches_eager(entry, "auto", monkeypatch, PROMPTS[1:2]) == 11


def test_renormalized_routing_fused_matches_eager(
    tiny_deepseek_moe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """norm_topk_prob: the top-k weights divided by their sum (torch's order of that sum)."""
    for source in tiny_deepseek_moe_dir.iterdir():
        (tmp_path / source.name).symlink_to(source)
    config = json.loads((tiny_deepseek_moe_dir / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "norm_topk_prob": True}))
    assert assert_fused_matches_eager(tmp_path, "bfloat16", monkeypatch, max_tokens=6) >= 5


@pytest.mark.parametrize(
    "num_experts, top_k, renormalize",
    [
        (64, 6, False),
        (64, 6, True),
        (16, 4, False),
        (64, 1, False),
        (256, 4, True),
        (20, 3, True),
        (8, 2, False),
    ],
)
def test_native_routing_is_torchs(num_experts: int, top_k: int, renormalize: bool) -> None:
    """Weights and ids in torch.topk's order, bit for bit, on normal and tie-heavy logits; (64, 1) and
    (256, 4) take torch's partial-sort path (a heap), the others its nth_element one."""
    lanes = fused_moe.routing_lanes(num_experts, top_k, renormalize)
    assert lanes in fused_moe.LANES
    generator = torch.Generator().manual_seed(1)
    for logits in (
        torch.randn(2000, num_experts, generator=generator) * 3,
        torch.randint(-3, 3, (2000, num_experts), generator=generator) * 0.5,
        torch.randn(2000, num_experts, generator=generator) * 40,  # probabilities underflowing to 0
    ):
        logits = logits.bfloat16()
        expected_weights, expected_ids = cpu.select_experts(logits, top_k, renormalize)
        weights, ids = fused_moe.route(logits, top_k, renormalize, lanes)
        assert torch.equal(ids.long(), expected_ids)
        assert torch.equal(weights.view(torch.int32), expected_weights.view(torch.int32))


def test_parallel_experts_and_unmatched_routing_stay_eager(
    tiny_deepseek_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASCQ_FUSED_DECODE", "1")
    llm = LLM(str(tiny_deepseek_moe_dir), dtype="bfloat16", kv_cache_memory=8 << 20)
    decoder = llm.engine.model.model
    assert decoder.fused_decode is not None, llm.engine.runner.fused_decode_reason
    assert fused_decode.unsupported_reason(decoder) is None
    experts = decoder.layers[1].mlp.experts
    monkeypatch.setattr(experts, "expert_parallel", True)
    assert fused_decode.unsupported_reason(decoder) == "tensor or expert parallel experts"
    monkeypatch.setattr(experts, "expert_parallel", False)
    monkeypatch.setattr(fused_moe, "routing_lanes", lambda *args: None)
    assert "softmax / top-k" in fused_decode.unsupported_reason(decoder)

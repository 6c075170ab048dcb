"""Fused decode of W8A8 / W4A8 checkpoints (int8 activations rounded inside the native kernel, as the eager
path's `cpu.linear` rounds them): the eager path's hidden states bit for bit, batches 1-4."""

from __future__ import annotations

from pathlib import Path

import pytest
from fused_decode_support import PROMPTS, assert_fused_matches_eager, rows_bound_of_at_least_eight  # noqa: F401
from native_support import needs_native

from ascq.kernels import cpu


@needs_native
@pytest.mark.parametrize(
    "recipe",
    [
        "w8a8",
        pytest.param("w8a8-static", marks=pytest.mark.slow),
        pytest.param("w4a8-dynamic", marks=pytest.mark.slow),
    ],
)
def test_int8_activation_tiny_llama_fused_matches_eager(
    recipe: str, tiny_llama_dir: Path, converted_entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu, "NATIVE_INT8_MAX_M", max(cpu.NATIVE_INT8_MAX_M, 8))  # batches of 4 fuse
    entry = converted_entry(tiny_llama_dir, (recipe,), max_eval_tokens=256)
    assert assert_fused_matches_eager(entry, "bfloat16", monkeypatch) >= 11  # batch 4 decode steps
    assert assert_fused_matches_eager(entry, "bfloat16", monkeypatch, PROMPTS[1:2]) == 11  # batch 1

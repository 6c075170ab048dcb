"""Fused decode against eager (tests/test_fused_decode.py, tests/test_fused_decode_moe.py): greedy tokens and
every step's final hidden states of both paths, and the host row bounds raised so small batches fuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ascq import LLM, SamplingParams
from ascq.kernels import cpu

PROMPTS = [[5 + (7 * i + j) % 200 for j in range(3 + 9 * i)] for i in range(4)]  # 3..30 tokens


def decode(
    model: Path | str,
    dtype: str,
    fused: bool,
    prompts: list[list[int]],
    max_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
    max_num_seqs: int = 4,
) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens, every step's final hidden states, and the number of steps the fused path ran."""
    monkeypatch.setenv("ASCQ_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(str(model), dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_memory=64 << 20)
    decoder = llm.engine.model.model
    assert (decoder.fused_decode is not None) == fused, llm.engine.runner.fused_decode_reason
    num_fused = 0
    if fused:
        inner = decoder.fused_decode

        def counting(*args):
            nonlocal num_fused
            out = inner(*args)
            num_fused += out is not None
            return out

        decoder.fused_decode = counting
    hidden: list[torch.Tensor] = []
    logits = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: (hidden.append(h.clone()), logits(h))[1]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, hidden, num_fused


def assert_fused_matches_eager(
    model: Path | str,
    dtype: str,
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = 12,
    max_num_seqs: int = 4,
) -> int:
    fused_tokens, fused_hidden, num_fused = decode(
        model, dtype, True, prompts, max_tokens, monkeypatch, max_num_seqs
    )
    eager_tokens, eager_hidden, _ = decode(
        model, dtype, False, prompts, max_tokens, monkeypatch, max_num_seqs
    )
    assert fused_tokens == eager_tokens
    assert len(fused_hidden) == len(eager_hidden)
    for step, (a, b) in enumerate(zip(fused_hidden, eager_hidden, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a.float() - b.float()).abs().max()}"
    return num_fused


@pytest.fixture(autouse=True)
def rows_bound_of_at_least_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches up to 4 must fuse whatever this host's measured row bounds are (on AVX-512 BF16 hosts the bf16
    GEMM takes over from 3-4 rows): the tests check the fused step's results, not the thresholds."""
    monkeypatch.setattr(cpu, "BF16_GEMM_NATIVE_MAX_M", max(cpu.BF16_GEMM_NATIVE_MAX_M, 8))
    monkeypatch.setattr(cpu, "DENSE_BF16_MAX_M", max(cpu.DENSE_BF16_MAX_M, 8))

"""The converter measures what the server runs: its fake-quantized W8A8 forward of a converted entry and the
reference backend's served prefill give identical logits (same activation quantizer, RMSNorm, rotary,
attention), and the NPU emulator's npu_dynamic_quant is that quantizer too."""

from __future__ import annotations

from pathlib import Path

import torch
from test_runtime_loader import prefill_logits

from ascq.core import qmath
from ascq.evaluate import eval_windows, load_eval_token_ids
from ascq.quantize.reference_forward import reference_logits
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.llm_engine import LLMEngine


def test_converter_fake_quant_logits_equal_served_reference_logits(
    tmp_path: Path, tiny_llama_dir: Path, eval_text_path: Path, converted_entry
) -> None:
    short_eval = tmp_path / "eval.txt"  # the manifest's perplexity is not what this test checks
    short_eval.write_text(eval_text_path.read_text()[:4000])
    entry = converted_entry(tiny_llama_dir, ("w8a8",), num_samples=4, seq_len=32, eval_text=short_eval)
    windows = eval_windows(load_eval_token_ids(tiny_llama_dir), 96)[:2]
    converter = reference_logits(entry, windows)
    engine = LLMEngine(EngineArgs(entry, device="reference", dtype="float32", kv_cache_memory=8 << 20))
    for window, expected in zip(windows, converter, strict=True):
        served = prefill_logits(engine, window.tolist())
        assert torch.equal(served, expected)


def test_npu_emulator_dynamic_quant_is_the_shared_quantizer() -> None:
    from npu_emulation.quant import npu_dynamic_quant

    x = (torch.randn(5, 64) * torch.linspace(0.1, 4, 64)).to(torch.bfloat16)
    y, scale = npu_dynamic_quant(x)
    q, expected_scale = qmath.quantize_per_token(x)
    assert (
        y.dtype == torch.int8 and torch.equal(y.float(), q) and torch.equal(scale, expected_scale.squeeze(-1))
    )

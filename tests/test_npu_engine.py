"""The engine end to end with `--device npu` on the CPU torch_npu EMULATOR: greedy tokens equal the reference
backend's for W8A8 dynamic, W8A8 static and W4A16 on both fixtures, and the NPU path really ran the torch_npu
ops (counted on the emulator)."""

from __future__ import annotations

from collections import Counter

import npu_emulation
import pytest

from ascq import LLM, SamplingParams

RECIPES = {"w8a8_dynamic": "w8a8", "w8a8_static": "w8a8-static", "w4a16": "w4a16-rtn"}
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\nclass Config:\n",
    "    for key, value in sorted(items.items()):\n        if",
]
NUM_TOKENS = 12
OPS = {
    "w8a8_dynamic": {"npu_dynamic_quant", "npu_quant_matmul", "npu_format_cast"},
    "w8a8_static": {"npu_quantize", "npu_quant_matmul", "npu_format_cast"},
    "w4a16": {"npu_weight_quant_batchmatmul", "npu_convert_weight_to_int4pack"},
}
ATTENTION_OPS = {"_npu_reshape_and_cache", "npu_fused_infer_attention_score"}
MOE_OPS = {"npu_moe_gating_top_k_softmax", "npu_grouped_matmul"}


def greedy_tokens(model_dir, device: str) -> list[list[int]]:
    llm = LLM(str(model_dir), device=device, dtype="bfloat16", block_size=128, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def count_op_calls(monkeypatch) -> Counter:
    calls: Counter = Counter()
    for name in npu_emulation.__all__:
        op = getattr(npu_emulation, name)
        if callable(op) and (name.startswith("npu_") or name.startswith("_npu_")):
            def counted(*args, _op=op, _name=name, **kwargs):
                calls[_name] += 1
                return _op(*args, **kwargs)

            monkeypatch.setattr(npu_emulation, name, counted)
    return calls


@pytest.mark.parametrize("scheme", RECIPES)
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_deepseek_moe_dir"])
def test_npu_engine_greedy_tokens_equal_reference(npu_backend, monkeypatch, request, npu_converted, model, scheme):
    entry = npu_converted(request.getfixturevalue(model), RECIPES[scheme])
    expected = greedy_tokens(entry, "reference")
    calls = count_op_calls(monkeypatch)
    got = greedy_tokens(entry, "npu")
    assert got == expected
    wanted = OPS[scheme] | ATTENTION_OPS | (MOE_OPS if "moe" in model else set())
    assert wanted <= set(calls), f"NPU ops never called: {sorted(wanted - set(calls))}"

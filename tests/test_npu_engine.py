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


NEAR_TIE = (
    0.02  # nats: bf16 NPU math vs the fp32 reference flipped one greedy choice 0.0024 apart on a Zen 2 host
)


def greedy_tokens(model_dir, device: str) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Each prompt's greedy tokens, and each step's top-2 logprobs."""
    llm = LLM(str(model_dir), device=device, dtype="bfloat16", block_size=128, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    outputs = [out.outputs[0] for out in llm.generate(PROMPTS, params)]
    return [o.token_ids for o in outputs], [o.logprobs for o in outputs]


def assert_same_up_to_near_ties(
    got: list[list[int]], expected: list[list[int]], logprobs: list[list[dict[int, float]]]
) -> None:
    """Tokens equal, except that a sequence may leave the reference where the reference's own top two were
    within NEAR_TIE and `got` took the second (every later token then follows another prefix, so comparison
    stops there)."""
    for tokens, reference, steps in zip(got, expected, logprobs, strict=True):
        assert len(tokens) == len(reference)
        for position, (token, wanted) in enumerate(zip(tokens, reference, strict=True)):
            if token != wanted:
                top = steps[position]
                gap = top[wanted] - top.get(token, float("-inf"))
                assert gap < NEAR_TIE, (
                    f"token {position}: {token} instead of {wanted} (reference gap {gap:.4f})"
                )
                break


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
def test_npu_engine_greedy_tokens_equal_reference(
    npu_backend, monkeypatch, request, npu_converted, model, scheme
):
    entry = npu_converted(request.getfixturevalue(model), RECIPES[scheme])
    expected, logprobs = greedy_tokens(entry, "reference")
    calls = count_op_calls(monkeypatch)
    got, _ = greedy_tokens(entry, "npu")
    assert_same_up_to_near_ties(got, expected, logprobs)
    wanted = OPS[scheme] | ATTENTION_OPS | (MOE_OPS if "moe" in model else set())
    assert wanted <= set(calls), f"NPU ops never called: {sorted(wanted - set(calls))}"

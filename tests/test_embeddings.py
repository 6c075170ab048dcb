"""Embeddings of a decoder model (vLLM's LAST pooling): the prompt's last-token final hidden state,
L2-normalized, against transformers' own model on the same weights (fp32), through chunked prefill and the
prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from ascq.runtime.engine.llm import LLM
from ascq.runtime.sampling.sampling_params import SamplingParams

PROMPTS = ["def add(a, b):", "import os\nprint(os.getcwd())", "class Stack:\n    def push(self, x):" * 6]


def reference_embedding(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return F.normalize(hidden, dim=-1)


def test_embed_matches_transformers_through_chunks_and_cache(tiny_llama_dir: Path) -> None:
    # chunks of 16 tokens: the long prompt's last token is computed in a later step than its first
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    try:
        first = llm.embed(PROMPTS)
        # full blocks now come from the prefix cache
        again = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, pooling="last"))
        generated = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))
    finally:
        llm.shutdown()
    assert len(first[2].prompt_token_ids) > 3 * 16 and again[2].num_cached_tokens >= 16
    for output, cached in zip(first, again, strict=True):
        reference = reference_embedding(tiny_llama_dir, output.prompt_token_ids)
        embedding = torch.tensor(output.outputs.embedding)
        assert embedding.shape == reference.shape
        assert (embedding - reference).abs().max() < 1e-5
        assert (torch.tensor(cached.prompt_embedding) - reference).abs().max() < 1e-5
    assert generated[0].prompt_embedding is None  # only requests asking for pooling pay for it


def test_pooling_is_validated() -> None:
    with pytest.raises(ValueError, match="pooling must be None or 'last'"):
        SamplingParams(pooling="mean")
    with pytest.raises(ValueError, match="pooling needs n = 1"):
        SamplingParams(pooling="last", n=2)

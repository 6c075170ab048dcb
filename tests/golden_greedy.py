"""Greedy tokens of the fixtures (and SmolLM2 when imported) through the public API, recorded before the
layout refactor of issue 33 (`python tests/golden_greedy.py > tests/data/golden_greedy.json` at commit
de466cd) and compared by tests/test_golden_greedy.py, so a change that moves code cannot change what the model
says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, item):",
    "The quick brown fox",
]
MODELS = {
    "tiny-llama": ROOT / "zoo" / "tiny-llama",
    "tiny-deepseek-moe": ROOT / "zoo" / "tiny-deepseek-moe",
    "smollm2-135m-instruct": ROOT / "zoo" / "smollm2-135m-instruct",
}
NUM_TOKENS = 24


def greedy_tokens(model: Path, dtype: str) -> list[list[int]]:
    from ascq import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def main() -> None:
    record = {}
    for name, path in MODELS.items():
        if path.is_dir() and any(path.glob("*.safetensors")):
            record[name] = {dtype: greedy_tokens(path, dtype) for dtype in ("float32", "bfloat16")}
    json.dump(record, sys.stdout, indent=1)


if __name__ == "__main__":
    main()

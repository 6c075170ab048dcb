"""`import ascq` and every CLI command except `--device npu` work with torch_npu absent and never try to
import it (installed without the CANN toolkit it breaks `import torch`). In a fresh interpreter a meta-path
finder records every lookup of `torch_npu` made from ascq's own code (transformers probes for it too; that is
not ascq's doing) and answers "absent"; the positive control shows `--device npu` does look it up and fails
with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Split

RUNNER = textwrap.dedent("""
    import importlib.abc, json, sys, traceback
    lookups = []

    class RecordAbsent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch_npu":
                callers = [f.filename for f in traceback.extract_stack()[:-1]
                           if "importlib" not in f.filename and not f.filename.startswith("<")]
                lookups.append(callers[-1] if callers else "?")
            return None

    sys.meta_path.insert(0, RecordAbsent())
    from ascq.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        before = len(lookups)
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        ours = [f for f in lookups[before:] if "/ascq/" in f]
        in_modules = "torch_npu" in sys.modules
        results.append({"argv": argv, "code": code, "ascq_lookups": ours, "in_modules": in_modules})
    print("RESULTS " + json.dumps(results))
""")


def tiny_llama(path: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    vocab = {"<unk>": 0, **{chr(97 + i): i + 1 for i in range(26)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(path)
    return path


def run_cli(commands: list[list[str]], zoo: Path) -> list[dict]:
    env = {**os.environ, "ASCQ_ZOO": str(zoo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(commands)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.slow
def test_only_device_npu_looks_for_torch_npu(tmp_path):
    model = str(tiny_llama(tmp_path / "tiny"))
    generate = ["generate", model, "--prompt", "ab", "--max-tokens", "2"]
    commands = [
        ["--help"],
        ["convert", "--help"],
        ["serve", "--help"],
        ["recipes"],
        ["zoo", "list"],
        [*generate, "--device", "cpu"],
        [*generate, "--device", "npu", "--block-size", "128"],
    ]
    *plain, npu = run_cli(commands, tmp_path / "zoo")
    for result in plain:
        assert result["code"] == 0 and not result["ascq_lookups"] and not result["in_modules"], result
    assert npu["code"] == 1 and npu["ascq_lookups"] and not npu["in_modules"], npu
    assert any(f.endswith("kernels/npu/runtime.py") for f in npu["ascq_lookups"])

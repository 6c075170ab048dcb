"""The committed fixture models: they load, their manifests are true, they are trained, and the CLI lists
them.

The fp32 held-out evaluation of each model (the slow part) is computed once per module and shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from ascq.evaluate import load_eval_token_ids, perplexity
from ascq.formats.manifest import read_manifest, verify_files
from ascq.reference.deepseek_moe import load_deepseek

MAX_FILE_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def llama_eval(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = load_eval_token_ids(tiny_llama_dir)
    return model, perplexity(lambda x: model(x).logits, ids)


@pytest.fixture(scope="module")
def moe_eval(tiny_deepseek_moe_dir):
    model = load_deepseek(tiny_deepseek_moe_dir)
    model.record_routing(True)
    ppl = perplexity(model, load_eval_token_ids(tiny_deepseek_moe_dir))
    return model, ppl


def test_tiny_llama_loads_with_auto_model_and_uses_gqa(llama_eval, tiny_llama_dir):
    model, _ = llama_eval
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] < config["num_attention_heads"]
    assert (
        type(model).__name__ == "LlamaForCausalLM" and config["torch_dtype"] == config["dtype"] == "bfloat16"
    )
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


@pytest.mark.parametrize("entry", ["llama", "moe"])
def test_recomputed_perplexity_matches_manifest_and_beats_unigram(entry, request):
    model_dir = request.getfixturevalue("tiny_llama_dir" if entry == "llama" else "tiny_deepseek_moe_dir")
    _, ppl = request.getfixturevalue(f"{entry}_eval")
    metrics = read_manifest(model_dir)["metrics"]
    assert ppl == pytest.approx(metrics["perplexity"], rel=0.01)
    assert ppl <= 0.25 * metrics["unigram_perplexity"]
    assert metrics["num_eval_tokens"] == load_eval_token_ids(model_dir).numel()


def test_moe_has_no_dead_experts_on_eval_text(moe_eval, tiny_deepseek_moe_dir):
    model, _ = moe_eval
    counts = model.routed_token_counts().double()
    shares = counts / counts.sum(dim=1, keepdim=True)
    assert counts.shape == (3, 16)
    assert shares.min().item() >= 0.01, shares
    manifest_shares = torch.tensor(read_manifest(tiny_deepseek_moe_dir)["metrics"]["routed_token_share"])
    torch.testing.assert_close(shares, manifest_shares.double(), atol=2e-3, rtol=0)


def test_moe_config_and_tensor_names_follow_deepseek_moe_16b(tiny_deepseek_moe_dir):
    config = json.loads((tiny_deepseek_moe_dir / "config.json").read_text())
    expected = {
        "model_type": "deepseek",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "n_routed_experts": 16,
        "n_shared_experts": 2,
        "num_experts_per_tok": 4,
        "architectures": ["DeepseekForCausalLM"],
        "torch_dtype": "bfloat16",
    }
    assert {k: config[k] for k in expected} == expected and "auto_map" not in config
    with safe_open(tiny_deepseek_moe_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_shape() == [16, 256]
        assert f.get_tensor("model.layers.3.mlp.experts.15.down_proj.weight").dtype == torch.bfloat16
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"} <= keys


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-moe"])
def test_entry_files_match_manifest_and_fit_size_limit(name, tiny_llama_dir):
    entry = tiny_llama_dir.parent / name
    manifest = read_manifest(entry)
    verify_files(entry, manifest)
    assert manifest["recipe"] is None and manifest["format"] == "hf" and manifest["license"] == "apache-2.0"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        manifest["files"]
    )
    assert all(record["size"] <= MAX_FILE_BYTES for record in manifest["files"].values())
    # the trainer lives in tests/fixtures/ now; the committed fixtures record the module path it had when they
    # were trained (ascq.zoo.train_fixture), which is the same code
    assert manifest["training"]["command"].startswith(
        ("python -m tests.fixtures.train_fixture", "python -m ascq.zoo.train_fixture")
    )


def test_chat_template_renders_chatml(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef "
        "f():<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1 and ids.count(2) == 2
    assert tokenizer.bos_token == tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ascq.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_help_zoo_list_and_one_line_errors():
    assert run_cli("--help").returncode == 0
    listing = run_cli("zoo", "list")
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert {"tiny-llama", "tiny-deepseek-moe"} <= set(rows) and "ascq/tiny-llama" in rows["tiny-llama"]
    for bad in (["no-such-command"], ["zoo", "list", "--no-such-option"]):
        result = run_cli(*bad)
        assert result.returncode != 0 and result.stdout == ""
        assert result.stderr.startswith("error:") and result.stderr.count("\n") == 1, result.stderr

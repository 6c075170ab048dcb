"""vLLM's offline and asyncio engine API under `ascq`: scripts written for vLLM run unchanged after
`s/vllm/ascq/` (each in its own Python process, as a user runs it), and vLLM's engine keywords are accepted,
refused or corrected in one line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ascq
from ascq.core.errors import AscqError, UnsupportedError

ROOT = Path(__file__).resolve().parents[1]
VLLM_NAMES = [
    "LLM",
    "SamplingParams",
    "EngineArgs",
    "AsyncEngineArgs",
    "LLMEngine",
    "AsyncLLMEngine",
    "TokensPrompt",
    "TextPrompt",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
]
GREEDY_PROMPT = "A robot may not injure a human being"

# vLLM's examples/offline_inference/llm_engine_example.py, reduced to what runs on a small CPU model
OFFLINE_SCRIPT = """
import json
import sys

from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams, TextPrompt, TokensPrompt


def create_test_prompts(tokenizer):
    return [
        (
            "A robot may not injure a human being",
            SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=1),
        ),
        (
            TextPrompt(prompt="To be or not to be,"),
            SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=12, seed=1),
        ),
        (
            TokensPrompt(prompt_token_ids=tokenizer.encode("What is the meaning of life?")),
            SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1, max_tokens=12, seed=2),
        ),
    ]


def process_requests(engine: LLMEngine, test_prompts) -> None:
    request_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(json.dumps({
                    "request_id": request_output.request_id,
                    "prompt_token_ids": request_output.prompt_token_ids,
                    "prompt_logprobs": request_output.prompt_logprobs is not None
                    and len(request_output.prompt_logprobs),
                    "outputs": [
                        {
                            "token_ids": list(o.token_ids),
                            "text": o.text,
                            "finish_reason": o.finish_reason,
                            "logprobs": o.logprobs is not None and len(o.logprobs),
                        }
                        for o in request_output.outputs
                    ],
                }))


def initialize_engine(model: str) -> LLMEngine:
    engine_args = EngineArgs(
        model=model, max_model_len=256, gpu_memory_utilization=0.05, enforce_eager=True, dtype="float32"
    )
    return LLMEngine.from_engine_args(engine_args)


def main() -> None:
    engine = initialize_engine(sys.argv[1])
    process_requests(engine, create_test_prompts(engine.get_tokenizer()))
    # a request aborted after its first step ends with finish_reason "abort"
    engine.add_request("aborted", "Once upon a time", SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request(["aborted"])
    while engine.has_unfinished_requests():
        for output in engine.step():
            reason = output.outputs[0].finish_reason
            print(json.dumps({"request_id": output.request_id, "finish_reason": reason}))


if __name__ == "__main__":
    main()
"""

# an asyncio client of vLLM's AsyncLLMEngine: two requests streamed concurrently, a third aborted
ASYNC_SCRIPT = """
import asyncio
import json
import sys

from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams


async def stream(engine, prompt, request_id, order, outputs):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    async for output in engine.generate(prompt, params, request_id):
        order.append(request_id)
        outputs[request_id] = output


async def stream_then_abort(engine, outputs):
    async for output in engine.generate("Once upon a time", SamplingParams(max_tokens=200), "c"):
        outputs["c"] = output
        await engine.abort("c")


async def main():
    engine_args = AsyncEngineArgs(
        model=sys.argv[1], max_model_len=256, gpu_memory_utilization=0.05, enforce_eager=True, dtype="float32"
    )
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    order, outputs = [], {}
    await asyncio.gather(
        stream(engine, "A robot may not injure a human being", "a", order, outputs),
        stream(engine, "The capital of France is", "b", order, outputs),
        stream_then_abort(engine, outputs),
    )
    print(json.dumps({
        "order": order,
        "outputs": {
            request_id: {
                "request_id": output.request_id,
                "finished": output.finished,
                "token_ids": list(output.outputs[0].token_ids),
                "text": output.outputs[0].text,
                "finish_reason": output.outputs[0].finish_reason,
            }
            for request_id, output in outputs.items()
        },
    }))


if __name__ == "__main__":
    asyncio.run(main())
"""


def run_vllm_script(source: str, model: Path, tmp_path: Path) -> str:
    """Run a vLLM script after `s/vllm/ascq/`, as its own process; its stdout."""
    script = tmp_path / "script.py"
    script.write_text(source.replace("vllm", "ascq"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(script), str(model)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def offline_results(tiny_llama_dir, tmp_path_factory) -> dict[str, dict]:
    stdout = run_vllm_script(OFFLINE_SCRIPT, tiny_llama_dir, tmp_path_factory.mktemp("offline"))
    return {r["request_id"]: r for r in map(json.loads, stdout.splitlines())}


def test_vllm_names_import_from_ascq() -> None:
    for name in VLLM_NAMES:
        assert getattr(ascq, name).__name__ == name
    assert set(VLLM_NAMES) <= set(ascq.__all__)


def test_offline_engine_script_runs_unchanged(offline_results) -> None:
    greedy, sampled, two = offline_results["0"], offline_results["1"], offline_results["2"]
    for result in (greedy, sampled, two):
        for output in result["outputs"]:
            assert output["token_ids"] and output["text"]
            assert output["finish_reason"] in ("length", "stop")
    assert greedy["outputs"][0]["logprobs"] == len(greedy["outputs"][0]["token_ids"])
    assert greedy["prompt_logprobs"] == len(greedy["prompt_token_ids"])
    assert sampled["outputs"][0]["logprobs"] is False
    assert [len(two["outputs"])] == [2]
    assert offline_results["aborted"]["finish_reason"] == "abort"


def test_async_engine_script_streams_concurrently(offline_results, tiny_llama_dir, tmp_path) -> None:
    result = json.loads(run_vllm_script(ASYNC_SCRIPT, tiny_llama_dir, tmp_path))
    order, outputs = result["order"], result["outputs"]
    for request_id in ("a", "b"):
        assert outputs[request_id]["request_id"] == request_id
        assert outputs[request_id]["finished"] and outputs[request_id]["finish_reason"] in ("length", "stop")
        assert order.count(request_id) >= 2  # streamed: one output per step
    # concurrent, not one after the other: b streamed before a finished
    assert order.index("b") < len(order) - 1 - order[::-1].index("a")
    # the same engine gives the same greedy tokens offline and async
    assert outputs["a"]["token_ids"] == offline_results["0"]["outputs"][0]["token_ids"]
    assert outputs["c"]["finished"] is False and len(outputs["c"]["token_ids"]) < 200


# ---- EngineArgs keywords ---------------------------------------------------------------------------------


def test_seed_snippet_names_the_vllm_field(tiny_llama_dir) -> None:
    with pytest.raises(TypeError, match=r"'speculative_decoding'; did you mean 'speculative_config'\?$"):
        ascq.EngineArgs(
            model=str(tiny_llama_dir),
            quantization="awq",
            max_model_len=8192,
            gpu_memory_utilization=0.9,
            speculative_decoding="small-model",
        )


def test_vllm_only_keywords_accepted_when_harmless(tiny_llama_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="ascq"):
        args = ascq.AsyncEngineArgs(
            model=str(tiny_llama_dir),
            enable_chunked_prefill=True,
            disable_log_stats=True,
            enable_log_requests=False,
            kv_cache_memory_bytes=1 << 22,
            tokenizer_mode="auto",
            generation_config="vllm",
        )
    assert args.kv_cache_memory == 1 << 22  # vLLM's name for ascq's setting
    logged = [r.getMessage() for r in caplog.records]
    assert any("enable_chunked_prefill=True): accepted, changes nothing here" in m for m in logged)
    assert any("disable_log_stats=True): accepted" in m for m in logged)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"enable_chunked_prefill": False}, r"enable_chunked_prefill=False\) is not supported: .*chunks"),
        ({"enable_lora": True}, "LoRA"),
        ({"data_parallel_size": 2}, "data parallelism"),
        ({"scheduling_policy": "priority"}, "first come, first served"),
        ({"tokenizer_mode": "mistral"}, "Hugging Face tokenizer"),
        ({"reasoning_parser": "qwen3"}, "offline: ascq applies it in ascq serve --reasoning-parser"),
        ({"generation_config": "auto"}, "--generation-config"),
    ],
)
def test_vllm_only_keywords_refused_when_they_would_change_something(tiny_llama_dir, keywords, message):
    with pytest.raises(UnsupportedError, match=message) as caught:
        ascq.EngineArgs(model=str(tiny_llama_dir), **keywords)
    assert "\n" not in str(caught.value)


def test_quantization_checked_against_the_checkpoint(tiny_llama_dir, tmp_path) -> None:
    entry = tmp_path / "awq-model"
    entry.mkdir()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (entry / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    for method in ("awq", "gptq", "compressed-tensors"):
        args = ascq.EngineArgs(model=str(entry), quantization=method)
        checkpoint = json.loads((entry / "config.json").read_text())
        if method == "awq":
            args.check_quantization(checkpoint)  # what vLLM accepts for an AWQ checkpoint
        else:
            with pytest.raises(AscqError, match=f"quantization='{method}' but .* is quantized with 'awq'"):
                args.check_quantization(checkpoint)
    plain = ascq.EngineArgs(model=str(tiny_llama_dir), quantization="gptq")
    with pytest.raises(AscqError, match="is not quantized"):
        plain.check_quantization(config)


def test_request_options_beyond_vllm_defaults_refused(tiny_llama_dir) -> None:
    from ascq.runtime.engine.inputs import check_request_options

    check_request_options()
    for options, message in [
        ({"lora_request": object()}, "LoRA"),
        ({"priority": 1}, "first come, first served"),
        ({"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs"),
    ]:
        with pytest.raises(UnsupportedError, match=message):
            check_request_options(**options)


def test_pooling_params_refuse_what_the_pooler_does_not_do() -> None:
    assert ascq.PoolingParams().to_sampling_params().pooling == "last"
    assert ascq.PoolingParams(task="embed", normalize=True).to_sampling_params().max_tokens == 1
    for keywords in ({"dimensions": 8}, {"normalize": False}, {"task": "classify"}):
        with pytest.raises(UnsupportedError, match="PoolingParams"):
            ascq.PoolingParams(**keywords)

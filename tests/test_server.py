"""`ascq serve` end to end: a real server process (uvicorn) on 127.0.0.1 with the real engine, driven by the
official `openai` client and httpx. One server for the whole module."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ascq.core.errors import AscqError
from ascq.runtime.server import launcher

API_KEY = "test-key-5f2c9a"
PROMPTS = ["def parse_args(argv):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self"]


# ---- server process (ascq/runtime/server/launcher.py) --------------------------------------------------


def launch_server(
    model_dir: Path,
    log_path: Path,
    *extra: str,
    api_key: str | None = None,
    startup_timeout_s: float = 120.0,
    env_vars: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """`ascq serve` with a small KV cache, one thread, no inherited API key; returns (process, base url)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ASCQ_API_KEY", None)
    env.pop("VLLM_API_KEY", None)
    env.update(env_vars or {})
    if api_key:
        env["ASCQ_API_KEY"] = api_key  # via the environment: a key on the command line shows in `ps`
    try:
        return launcher.launch_server(
            model_dir,
            log_path,
            "--kv-cache-memory",
            str(64 << 20),
            "--max-model-len",
            "512",
            *extra,
            env=env,
            startup_timeout_s=startup_timeout_s,
        )
    except AscqError as exc:
        raise AssertionError(str(exc)) from None


def stop_server(process: subprocess.Popen, log_path: Path, secret: str) -> None:
    """SIGTERM drain; the process is killed on every path (a drain that does not finish too); then the log
    checks."""
    assert launcher.stop_server(process, timeout_s=20) == 0
    log = log_path.read_text()
    assert "Traceback" not in log, log[log.find("Traceback") :][:5000]
    assert secret not in log


@contextlib.contextmanager
def running_server(
    model_dir: Path,
    log_dir: Path,
    *extra: str,
    api_key: str | None = None,
    env_vars: dict[str, str] | None = None,
    secret: str | None = None,
    startup_timeout_s: float = 120.0,
) -> Iterator[tuple[str, Path]]:
    """A module's server: (base url, log path) while it runs; stopped and its log checked afterwards."""
    log_path = log_dir / "server.log"
    process, base_url = launch_server(
        model_dir, log_path, *extra, api_key=api_key, env_vars=env_vars, startup_timeout_s=startup_timeout_s
    )
    try:
        yield base_url, log_path
    finally:
        stop_server(process, log_path, secret or api_key)


def openai_client(server: tuple[str, Path], api_key: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("server"),
        "--served-model-name",
        "tiny-llama",
        api_key=API_KEY,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server, API_KEY)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path):
    from ascq import LLM

    return LLM(str(tiny_llama_dir), max_model_len=512, kv_cache_memory=16 << 20)


free_port = launcher.free_port
metrics = launcher.server_metrics


def wait_idle(base_url: str, timeout_s: float = 20.0) -> dict[str, float]:
    return launcher.idle_metrics(base_url, timeout_s)


# ---- OpenAI client: completions and chat, greedy equals LLM.generate ------------------------------------


def test_models_health_version(server, client: openai.OpenAI) -> None:
    base_url, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert httpx.get(f"{base_url}/health").status_code == 200  # open without a key
    assert httpx.get(f"{base_url}/version").json()["version"]


def test_completions_greedy_equal_llm_generate(client: openai.OpenAI, llm) -> None:
    from ascq import SamplingParams

    tokenizer = llm.get_tokenizer()
    for prompt in PROMPTS:
        (expected,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))
        done = expected.outputs[0]
        response = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0)
        assert response.choices[0].text == done.text
        assert response.choices[0].finish_reason == done.finish_reason
        assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert response.usage.completion_tokens == len(done.token_ids)
        chunks = list(
            client.completions.create(
                model="tiny-llama",
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.text
        assert chunks[-1].usage.completion_tokens == len(done.token_ids) and not chunks[-1].choices
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.finish_reason


def test_chat_greedy_equal_llm_chat(client: openai.OpenAI, llm) -> None:
    from ascq import SamplingParams

    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
    ]
    (expected,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=20))
    text = expected.outputs[0].text
    response = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_completion_tokens=20, temperature=0
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=20, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_sampling_parameters(client: openai.OpenAI) -> None:
    sampled = [
        client.completions.create(
            model="tiny-llama",
            prompt=PROMPTS[0],
            max_tokens=16,
            temperature=0.9,
            top_p=0.9,
            seed=123,
            extra_body={"top_k": 50, "min_p": 0.01},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # same seed, same text
    greedy = client.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=24, temperature=0)
    text = greedy.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    batch = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[:2], max_tokens=4, temperature=0.7, n=2
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert 4 <= batch.usage.completion_tokens <= 16 and batch.usage.prompt_tokens > 0


def test_logprobs(client: openai.OpenAI) -> None:
    choice = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=3
    ).choices[0]
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 6
    for token, logprob, top in zip(
        choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True
    ):
        # greedy = top-1
        assert logprob <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(logprob)
        assert token in top
    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


# ---- hostile input -------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HOSTILE = [  # (name, path, httpx request kwargs, expected status)
    ("bad json", COMPLETIONS, {"content": b'{"prompt": "a",'}, 400),
    ("invalid utf-8", COMPLETIONS, {"content": b'{"prompt": "\xff\xfe"}'}, 400),
    ("lone surrogate", COMPLETIONS, {"content": b'{"prompt": "\\ud800"}'}, 400),
    ("not an object", COMPLETIONS, {"json": ["prompt"]}, 400),
    ("missing prompt", COMPLETIONS, {"json": {"model": "tiny-llama"}}, 400),
    ("prompt wrong type", COMPLETIONS, {"json": {"prompt": 7}}, 400),
    ("max_tokens zero", COMPLETIONS, {"json": {"prompt": "a", "max_tokens": 0}}, 400),
    ("max_tokens negative", COMPLETIONS, {"json": {"prompt": "a", "max_tokens": -5}}, 400),
    ("max_tokens as string", COMPLETIONS, {"json": {"prompt": "a", "max_tokens": "5"}}, 400),
    ("huge max_tokens", COMPLETIONS, {"json": {"prompt": "a", "max_tokens": 10**15}}, 400),
    ("over-long prompt", COMPLETIONS, {"json": {"prompt": "x = 1\n" * 600, "max_tokens": 4}}, 400),
    ("temperature < 0", COMPLETIONS, {"json": {"prompt": "a", "temperature": -0.5}}, 400),
    ("temperature NaN", COMPLETIONS, {"content": b'{"prompt": "a", "temperature": NaN}'}, 400),
    ("top_p zero", COMPLETIONS, {"json": {"prompt": "a", "top_p": 0}}, 400),
    ("top_p above one", COMPLETIONS, {"json": {"prompt": "a", "top_p": 1.01}}, 400),
    ("stop wrong type", COMPLETIONS, {"json": {"prompt": "a", "stop": {"x": 1}}}, 400),
    ("token id out of vocab", COMPLETIONS, {"json": {"prompt": [1, 2, 10**9]}}, 400),
    ("empty prompt", COMPLETIONS, {"json": {"prompt": ""}}, 400),
    ("repetition_penalty zero", COMPLETIONS, {"json": {"prompt": "a", "repetition_penalty": 0}}, 400),
    ("logit_bias key not a token id", COMPLETIONS, {"json": {"prompt": "a", "logit_bias": {"x": 1}}}, 400),
    ("logit_bias out of range", COMPLETIONS, {"json": {"prompt": "a", "logit_bias": {"5": 101}}}, 400),
    (
        "logit_bias token out of vocab",
        COMPLETIONS,
        {"json": {"prompt": "a", "logit_bias": {"999999": 1}}},
        400,
    ),
    ("bad regex", COMPLETIONS, {"json": {"prompt": "a", "guided_regex": "("}}, 400),
    (
        "two constraints",
        COMPLETIONS,
        {"json": {"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}},
        400,
    ),
    (
        "json_schema without schema",
        CHAT,
        {
            "json": {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"},
            }
        },
        400,
    ),
    (
        "auto tools without the flags",
        CHAT,
        {
            "json": {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            }
        },
        400,
    ),
    ("top_k beyond int64", COMPLETIONS, {"json": {"prompt": "a", "top_k": 10**20}}, 400),
    ("seed beyond int64", COMPLETIONS, {"json": {"prompt": "a", "seed": -(10**30)}}, 400),
    ("logprobs too many", COMPLETIONS, {"json": {"prompt": "a", "logprobs": 1000}}, 400),
    ("deep nesting", COMPLETIONS, {"content": b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"}, 400),
    ("unknown model", COMPLETIONS, {"json": {"model": "gpt-4o", "prompt": "a"}}, 404),
    ("oversized body", COMPLETIONS, {"content": b'{"prompt": "' + b"a" * (17 << 20) + b'"}'}, 413),
    ("empty messages", CHAT, {"json": {"messages": []}}, 400),
    ("missing messages", CHAT, {"json": {"model": "tiny-llama"}}, 400),
    ("bad role", CHAT, {"json": {"messages": [{"role": "root", "content": "x"}]}}, 400),
    ("content wrong type", CHAT, {"json": {"messages": [{"role": "user", "content": 12}]}}, 400),
    (
        "huge max_completion_tokens",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99999}},
        400,
    ),
    ("wrong key", COMPLETIONS, {"json": {"prompt": "a"}, "headers": {"Authorization": "Bearer wrong"}}, 401),
    (
        "missing key",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": "x"}]}, "headers": {"Authorization": ""}},
        401,
    ),
]


def test_hostile_requests_get_openai_errors(server, client: openai.OpenAI) -> None:
    base_url, log_path = server
    failures = []
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        for name, path, kwargs, status in HOSTILE:
            response = http.post(path, **kwargs)
            error = (
                response.json().get("error", {})
                if response.headers.get("content-type") == "application/json"
                else {}
            )
            if response.status_code != status or set(error) != {"message", "type", "param", "code"}:
                failures.append(f"{name}: {response.status_code} {response.text[:200]}")
        over_long = http.post(COMPLETIONS, json={"prompt": "x = 1\n" * 600, "max_tokens": 4}).json()
        assert "512" in over_long["error"]["message"] and "4" in over_long["error"]["message"]
        assert http.get("/v1/nowhere").json()["error"]["code"] == "not_found"
    assert not failures, "\n".join(failures)
    assert httpx.get(f"{base_url}/health").status_code == 200
    answer = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop") and answer.usage.completion_tokens >= 1
    assert "Traceback" not in log_path.read_text()


# ---- metrics, disconnects, load ------------------------------------------------------------------------


def test_metrics_parse_and_move(server, client: openai.OpenAI) -> None:
    base_url, _ = server
    before = wait_idle(base_url)
    client.completions.create(
        model="tiny-llama", prompt=PROMPTS[0], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = wait_idle(base_url)
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert (
        after["vllm:time_to_first_token_seconds_count"]
        == before["vllm:time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["vllm:inter_token_latency_seconds_count"]
        == before["vllm:inter_token_latency_seconds_count"] + 4
    )
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:e2e_request_latency_seconds_sum",
    ):
        assert name in after


def test_disconnect_mid_stream_frees_blocks(server) -> None:
    base_url, _ = server
    before = wait_idle(base_url)
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        with http.stream("POST", COMPLETIONS, json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert metrics(base_url)["ascq:num_free_blocks"] < metrics(base_url)["ascq:num_total_blocks"]
    after = wait_idle(base_url)  # the abort reached the engine: nothing runs, every block is free
    assert after["vllm:num_requests_running"] == 0
    assert after["ascq:num_free_blocks"] == after["ascq:num_total_blocks"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 400  # cut short
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up is noticed too
        # 480 tokens take about 1.1 s on a quiet 2-core machine: a client giving up at 1.0 s raced the finish
        httpx.post(
            f"{base_url}{COMPLETIONS}",
            json=dict(body, stream=False, max_tokens=480),
            timeout=0.25,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    final = wait_idle(base_url)
    assert final["ascq:num_free_blocks"] == final["ascq:num_total_blocks"]
    assert final["vllm:generation_tokens_total"] - after["vllm:generation_tokens_total"] < 480


async def _client(http: httpx.AsyncClient, client_id: int, num_requests: int) -> tuple[int, int]:
    """One client's requests; every 8th (over all clients) streams and disconnects after its first chunk."""
    num_ok = num_disconnected = 0
    for i in range(num_requests):
        prompt = f"{PROMPTS[(client_id + i) % 3]}x{client_id}_{i} = "
        if (client_id * num_requests + i) % 8 == 3:
            body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
            async with http.stream("POST", COMPLETIONS, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
            num_disconnected += 1
            continue
        stream = i % 2 == 0
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.5, "seed": i, "stream": stream}
        if stream:
            async with http.stream("POST", COMPLETIONS, json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines[:-1]]
            assert finish[-1] in ("length", "stop")
        else:
            response = await http.post(COMPLETIONS, json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
        num_ok += 1
    return num_ok, num_disconnected


@pytest.mark.slow
def test_load_64_clients_with_disconnects(server, client: openai.OpenAI) -> None:
    base_url, _ = server

    async def run() -> list[tuple[int, int]]:
        limits = httpx.Limits(max_connections=128)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(_client(http, c, 8) for c in range(64)))

    results = asyncio.run(run())
    assert sum(ok for ok, _ in results) == 64 * 7 and sum(gone for _, gone in results) == 64
    after = wait_idle(base_url)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["ascq:num_free_blocks"] == after["ascq:num_total_blocks"]
    assert httpx.get(f"{base_url}/health").status_code == 200
    answer = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens >= 1


def test_bench_serve_reports(server, tmp_path: Path) -> None:
    base_url, _ = server
    result = tmp_path / "bench.json"
    env = dict(os.environ, OPENAI_API_KEY=API_KEY)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ascq.cli",
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--num-prompts",
            "12",
            "--input-len",
            "16",
            "--output-len",
            "6",
            "--max-concurrency",
            "4",
            "--result-json",
            str(result),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "Output token throughput" in run.stdout and "P99 ITL" in run.stdout
    data = json.loads(result.read_text())["metrics"]
    assert data["completed"] == 12 and data["failed"] == 0
    assert 0 < data["p50_ttft_ms"] <= data["p99_ttft_ms"] and data["output_throughput"] > 0
    assert API_KEY not in result.read_text()

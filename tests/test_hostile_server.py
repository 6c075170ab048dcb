"""Hostile and careless clients against a real `ascq serve` (tiny-llama on loopback, httpx and the official
openai client): reused request ids, amplifying and huge requests, a stopped engine, and the server bugs
vLLM's own entrypoint tests found (issue 45). One server for the module; its shutdown is checked too (every
handler done, no process left behind)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import psutil
import pytest
from test_server import launch_server, stop_server

from ascq.runtime.server import launcher

API_KEY = "hostile-key-3b9e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
STALL_TIMEOUT_S = 3
MAX_MODEL_LEN = 1100  # room for the amplification request's 1000-token prompts
DEFAULT_RETURNED_PROMPT_TOKENS = 16384  # the default --max-returned-prompt-tokens (max_model_len < 16384)


@dataclass
class Server:
    process: object
    base_url: str
    log_path: Path

    def engine_process(self) -> psutil.Process:
        children = psutil.Process(self.process.pid).children(recursive=True)
        return next(c for c in children if "ascq.runtime.engine.core_main" in " ".join(c.cmdline()))


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("hostile") / "server.log"
    process, base_url = launch_server(
        tiny_llama_dir,
        log_path,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--engine-stall-timeout",
        str(STALL_TIMEOUT_S),
        "--served-model-name",
        "tiny",
        api_key=API_KEY,
        startup_timeout_s=300,  # the shared test machine can be slow to start it
    )
    children = psutil.Process(process.pid).children(recursive=True)
    try:
        yield Server(process, base_url, log_path)
    finally:
        stop_server(process, log_path, API_KEY)  # exit code 0, no traceback in the log
        # uvicorn cancels the handlers still running when its graceful shutdown times out, and says so
        assert "running task" not in log_path.read_text()
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def run_concurrently(server: Server, requests: list[tuple[str, dict]], timeout_s: float = 180) -> list:
    """POSTs every (path, body) at once; returns (status, JSON or the list of SSE data events) in order."""

    async def one(client: httpx.AsyncClient, path: str, body: dict):
        if not body.get("stream"):
            response = await client.post(path, json=body)
            return response.status_code, response.json()
        async with client.stream("POST", path, json=body) as response:
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
            return response.status_code, [json.loads(e) for e in events if e != "[DONE]"]

    async def all_of_them():
        limits = httpx.Limits(max_connections=len(requests))
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=AUTH, timeout=timeout_s, limits=limits
        ) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, path, body) for path, body in requests)), timeout_s
            )

    return asyncio.run(all_of_them())


def assert_idle(server: Server) -> None:
    """No request left in the engine and every KV block free."""
    values = launcher.idle_metrics(server.base_url)
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["ascq:num_free_blocks"] == values["ascq:num_total_blocks"]


# ---- request ids: a client's id never reaches another request ------------------------------------------


def test_two_concurrent_requests_with_one_request_id_both_complete(server: Server) -> None:
    completion = {"prompt": "import os", "max_tokens": 12, "ignore_eos": True, "request_id": "same"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "ignore_eos": True}
    requests = [
        ("/v1/completions", completion),
        ("/v1/completions", completion),
        ("/v1/chat/completions", {**chat, "request_id": "same"}),
        ("/v1/chat/completions", {**chat, "request_id": "same", "stream": True}),
        # two prompts under "b" next to a request named as the first of them would be
        ("/v1/completions", {**completion, "prompt": ["a", "b"], "request_id": "b"}),
        ("/v1/completions", {**completion, "request_id": "b-0"}),
    ]
    results = run_concurrently(server, requests)
    assert [status for status, _ in results] == [200] * len(requests), results
    ids = [answer["id"] if isinstance(answer, dict) else answer[0]["id"] for _, answer in results]
    assert ids == ["cmpl-same", "cmpl-same", "chatcmpl-same", "chatcmpl-same", "cmpl-b", "cmpl-b-0"]
    for (_, body), (_, answer) in zip(requests, results, strict=True):
        if body.get("stream"):
            finishes = [c["choices"][0]["finish_reason"] for c in answer if c["choices"]]
            assert finishes[-1] == "length"
        else:
            assert [c["finish_reason"] for c in answer["choices"]] == ["length"] * len(answer["choices"])
            assert answer["usage"]["completion_tokens"] == 12 * len(answer["choices"])
    assert_idle(server)


def test_100_concurrent_requests_sharing_5_ids_all_complete(server: Server) -> None:
    requests = [
        (
            "/v1/completions",
            {
                "prompt": f"request {i}",
                "max_tokens": 6,
                "ignore_eos": True,
                "request_id": f"shared-{i % 5}",
                "stream": i % 2 == 1,
            },
        )
        for i in range(100)
    ]
    results = run_concurrently(server, requests)
    for i, (status, answer) in enumerate(results):
        assert status == 200, answer
        if i % 2:
            assert {chunk["id"] for chunk in answer} == {f"cmpl-shared-{i % 5}"}
            finishes = [c["choices"][0]["finish_reason"] for c in answer if c["choices"]]
            assert finishes.count("length") == 1 and finishes[-1] == "length"
            assert sum(len(c["choices"]) for c in answer) >= 1
        else:
            assert answer["id"] == f"cmpl-shared-{i % 5}"
            assert answer["usage"]["completion_tokens"] == 6
    assert_idle(server)


# ---- limits: what one request may cost ------------------------------------------------------------------


def test_prompt_logprobs_amplification_is_refused_naming_the_limit(http: httpx.Client) -> None:
    prompts = [[10 + (7 * i + j) % 4000 for j in range(1000)] for i in range(128)]
    amplifying = {"prompt": prompts, "echo": True, "prompt_logprobs": 20, "logprobs": 20, "max_tokens": 1}
    response = http.post("/v1/completions", json=amplifying)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "--max-returned-prompt-tokens" in error["message"] and "128000" in error["message"]
    # echo returns every prompt once per choice: 2 prompts x 1000 tokens x n 9 is over the limit too
    echoed = {"prompt": [prompts[0]] * 2, "echo": True, "n": 9, "max_tokens": 1}
    response = http.post("/v1/completions", json=echoed)
    assert response.status_code == 400 and "--max-returned-prompt-tokens" in response.text
    assert 2 * 1000 * 9 > DEFAULT_RETURNED_PROMPT_TOKENS
    # within the limit: served
    small = {"prompt": prompts[0][:50], "prompt_logprobs": 20, "max_tokens": 1}
    response = http.post("/v1/completions", json=small)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["prompt_logprobs"]) == 50


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"logprobs": 21}),
        ("/v1/completions", {"prompt_logprobs": 21}),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}),
    ],
)
def test_more_logprobs_than_max_logprobs_is_a_400(http: httpx.Client, path: str, fields: dict) -> None:
    base = (
        {"prompt": "import os"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    response = http.post(path, json={**base, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert "max allowed: 20" in response.text and "--max-logprobs" in response.text
    at_limit = {k: (20 if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in fields.items()}
    assert http.post(path, json={**base, "max_tokens": 2, **at_limit}).status_code == 200


HEALTH_PROBE = """
import json, sys, threading, time, httpx
done = threading.Event()  # stdin closed: stop and print the answers
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
answers = []
with httpx.Client(base_url=sys.argv[1], timeout=5) as client:
    while not done.is_set():
        sent = time.monotonic()
        status = client.get("/health").status_code
        answers.append((sent, status, time.monotonic() - sent))
        if len(answers) == 1:
            print("ready", flush=True)
        time.sleep(0.02)
print(json.dumps(answers))
"""


def time_json_parse(body: bytes) -> float:
    start = time.monotonic()
    json.loads(body.decode())
    return time.monotonic() - start


def test_a_10mb_prompt_is_refused_while_health_and_streams_stay_live(server: Server, http: httpx.Client):
    stream_times: list[float] = []
    stop = threading.Event()
    first_token = threading.Event()

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    stream_times.append(time.monotonic())
                    first_token.set()
                if stop.is_set():
                    return  # closing the connection aborts the request

    huge_bodies = [
        ("/v1/completions", json.dumps({"prompt": "ab " * 3_500_000, "max_tokens": 1}).encode()),
        ("/tokenize", json.dumps({"prompt": "ab " * 3_500_000}).encode()),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "a" * 10**7}]}).encode(),
        ),
    ]
    reader = threading.Thread(target=stream)
    reader.start()
    # /health is timed from a process of its own (this one's GIL would time itself), for 2 s before the
    # huge requests (the machine's own answer time, which a loaded test machine makes long) and during them
    probe = None
    try:
        assert first_token.wait(60)
        probe = subprocess.Popen(
            [sys.executable, "-c", HEALTH_PROBE, server.base_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert probe.stdout.readline() == "ready\n"
        time.sleep(2.0)
        parse_s = time_json_parse(huge_bodies[0][1])
        start = time.monotonic()
        refused = [http.post(path, content=body, headers=JSON) for path, body in huge_bodies]
        end = time.monotonic()
        time.sleep(0.5)
        health = json.loads(probe.communicate(timeout=60)[0])
    finally:
        stop.set()
        reader.join(30)
        if probe is not None:
            probe.kill()
            probe.wait()
    for response in refused:
        assert response.status_code == 400, response.text
        assert "--max-prompt-chars" in response.json()["error"]["message"]
    before = [latency for sent, _, latency in health if sent < start]
    during = [latency for sent, _, latency in health if start <= sent <= end]
    assert before and during and all(status == 200 for _, status, _ in health)
    # the refusals add less than 100 ms to any health check, plus what parsing one body's JSON costs this
    # machine now (a C call holding the GIL, in any Python server: ~20 ms unloaded; tokenizing the prompt
    # on the event loop, as before, costs seconds)
    allowed = max(before) + 0.1 + 2 * parse_s
    assert max(during) < allowed, (sorted(before)[-3:], sorted(during)[-3:], parse_s)
    assert any(start <= t <= end for t in stream_times), "the open stream received nothing meanwhile"
    assert not reader.is_alive()
    assert_idle(server)


# ---- liveness: a stopped engine fails /health -----------------------------------------------------------


def test_health_is_503_while_the_engine_is_stopped(server: Server) -> None:
    engine = server.engine_process()
    result: list = []
    first_token = threading.Event()

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
        finishes = []
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_token.set()
                    finishes += [c["finish_reason"] for c in json.loads(line[6:])["choices"]]
        result.append(finishes)

    reader = threading.Thread(target=stream)
    reader.start()
    statuses = []
    try:
        assert first_token.wait(60)
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + STALL_TIMEOUT_S + 15
            while time.monotonic() < deadline:
                statuses.append(httpx.get(f"{server.base_url}/health", timeout=5).status_code)
                if statuses[-1] == 503:
                    break
                time.sleep(0.2)
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.base_url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "/health stayed 503 after the engine resumed"
            time.sleep(0.2)
    finally:
        reader.join(120)
    assert statuses[0] == 200 and statuses[-1] == 503, statuses
    assert result and [f for f in result[0] if f] == ["length"]  # the request finished after SIGCONT
    assert_idle(server)


# ---- bugs vLLM's entrypoint tests found -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_each_stream_exactly_one_finish_reason(server: Server, path: str) -> None:
    prompt = (
        {"prompt": "The"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    body = {**prompt, "n": 3, "max_tokens": 40, "seed": 7, "temperature": 1.0, "stop": ["e"], "stream": True}
    ((status, chunks),) = run_concurrently(server, [(path, body)])
    assert status == 200
    finishes = Counter(c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"])
    assert finishes == {0: 1, 1: 1, 2: 1}


def test_chat_echo_prepends_the_last_message_of_the_replys_role(client: openai.OpenAI) -> None:
    continued = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    reply = client.chat.completions.create(
        model="tiny", messages=continued, max_tokens=5, temperature=0, n=2, extra_body=fields
    )
    assert [c.message.content.startswith("Once upon") for c in reply.choices] == [True, True]
    plain = client.chat.completions.create(
        model="tiny", messages=continued, max_tokens=5, temperature=0, extra_body={**fields, "echo": False}
    )
    assert reply.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=continued, max_tokens=5, temperature=0, stream=True, extra_body=fields
        )
    )
    assert chunks[1].choices[0].delta.content == "Once upon"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == reply.choices[0].message.content
    )
    # the last message is the user's, the reply the assistant's: nothing to echo
    asked = client.chat.completions.create(
        model="tiny", messages=continued[:1], max_tokens=5, temperature=0, extra_body={"echo": True}
    )
    assert not asked.choices[0].message.content.startswith("Tell a story")


def test_beam_search_and_stream_options_without_stream_are_400s(http: httpx.Client) -> None:
    for path, base in (
        ("/v1/completions", {"prompt": "a"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    ):
        response = http.post(path, json={**base, "max_tokens": 2, "use_beam_search": True})
        assert response.status_code == 400 and response.json()["error"]["param"] == "use_beam_search"
        assert "beam search is not implemented" in response.json()["error"]["message"]
        assert http.post(path, json={**base, "max_tokens": 2, "use_beam_search": False}).status_code == 200
        options = {"stream_options": {"include_usage": True}}
        response = http.post(path, json={**base, "max_tokens": 2, **options})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
        assert http.post(path, json={**base, "max_tokens": 2, "stream": True, **options}).status_code == 200


def test_required_tool_choice_with_defs_and_refs(client: openai.OpenAI) -> None:
    parameters = {
        "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/City"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": parameters}},
        {"type": "function", "function": {"name": "time", "parameters": parameters}},
    ]
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name in ("weather", "time")
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    clash = [
        tools[0],
        {
            "type": "function",
            "function": {
                "name": "time",
                "parameters": {**parameters, "$defs": {"City": {"type": "integer"}}},
            },
        },
    ]
    with pytest.raises(openai.BadRequestError, match="City"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "?"}], tools=clash, tool_choice="required"
        )


def test_iteration_tokens_count_prompt_and_every_generated_token(server: Server, http: httpx.Client) -> None:
    assert_idle(server)
    before = launcher.server_metrics(server.base_url)
    body = {"prompt": "import os\nimport sys", "max_tokens": 7, "ignore_eos": True}
    answer = http.post("/v1/completions", json=body).json()
    after = launcher.server_metrics(server.base_url)
    usage = answer["usage"]
    added = after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"]
    assert added == usage["prompt_tokens"] + usage["completion_tokens"]  # vLLM's: prompt + generated
    assert after["vllm:iteration_tokens_total_count"] - before["vllm:iteration_tokens_total_count"] == 7


def test_tokenize_always_has_token_strs(http: httpx.Client) -> None:
    plain = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert plain["token_strs"] is None and plain["count"] == len(plain["tokens"])
    spelled = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert spelled["tokens"] == plain["tokens"] and len(spelled["token_strs"]) == plain["count"]
    assert all(isinstance(s, str) for s in spelled["token_strs"])

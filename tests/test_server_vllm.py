"""What a vLLM / OpenAI user expects of `ascq serve`: every request field implemented or a 400 naming it,
vLLM's sampling extensions, structured outputs, tool calls, /tokenize, /ping, VLLM_API_KEY, startup checks.
One real server (tiny-llama) for the module, driven by the official openai client and httpx; references from
the offline LLM."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_server import free_port, openai_client, running_server

from ascq.runtime.server.protocol import (
    IGNORED_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

KEY = "vllm-key-7d1e"
PROMPT = "import os\nimport sys\n\n"
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["x", "y"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


STREAM_INTERVAL = 4


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("server"),
        "--served-model-name",
        "tiny-llama",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
        "0.5",
        "--enforce-eager",
        "--tensor-parallel-size",
        "1",
        "--stream-interval",
        str(STREAM_INTERVAL),
        env_vars={"VLLM_API_KEY": KEY},
        secret=KEY,
    ) as running:  # vLLM's variable
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server, KEY, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path):
    from ascq import LLM

    return LLM(str(tiny_llama_dir), max_model_len=512, kv_cache_memory=16 << 20)


def greedy_offline(llm, prompt: str, **kwargs):
    from ascq import SamplingParams

    return llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", 16), **kwargs)
    )[0]


# ---- every OpenAI request field ------------------------------------------------------------------------


def openai_request_fields() -> dict[str, list[str]]:
    """Request fields of the openai package's own typed params (the client's view of the API)."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    return {
        "/v1/completions": sorted(completion_create_params.CompletionCreateParamsBase.__annotations__),
        "/v1/chat/completions": sorted(chat_params.CompletionCreateParamsBase.__annotations__),
    }


SAMPLE_VALUES = {
    "suffix": "})",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "metadata": {"k": "v"},
    "store": True,
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "service_tier": "flex",
    "verbosity": "low",
    "web_search_options": {},
    "prompt_cache_key": "k",
    "safety_identifier": "u1",
    "prompt_cache_retention": "24h",
    "moderation": {"model": "x"},
    "prompt_cache_options": {"ttl": 1},
}


def test_every_openai_field_is_implemented_ignored_with_a_warning_or_a_400_naming_it(http, server) -> None:
    bodies = {
        "/v1/completions": {"prompt": "a", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    }
    implemented = {
        "/v1/completions": set(CompletionRequest.model_fields),
        "/v1/chat/completions": set(ChatCompletionRequest.model_fields),
    }
    failures, num_rejected, num_ignored = [], 0, 0
    for path, names in openai_request_fields().items():
        for name in names:
            if name in implemented[path]:
                continue
            if name in IGNORED_FIELDS:  # vLLM accepts these and ignores them: so do we, with a warning
                response = http.post(path, json={**bodies[path], name: SAMPLE_VALUES.get(name, "x")})
                if response.status_code != 200:
                    failures.append(f"{path} {name}: {response.status_code} {response.text[:200]}")
                num_ignored += 1
                continue
            assert name in UNSUPPORTED_FIELDS, (
                f"{path}: OpenAI field {name} is neither implemented, ignored nor rejected"
            )
            response = http.post(path, json={**bodies[path], name: SAMPLE_VALUES.get(name, "x")})
            error = response.json().get("error", {})
            if (
                response.status_code != 400
                or error.get("param") != name
                or name not in error.get("message", "")
            ):
                failures.append(f"{path} {name}: {response.status_code} {response.text[:200]}")
            num_rejected += 1
    assert not failures, "\n".join(failures)
    assert num_rejected >= 8 and num_ignored >= 6
    no_ops = http.post(
        "/v1/chat/completions",
        json={
            **bodies["/v1/chat/completions"],
            "store": False,
            "modalities": ["text"],
            "service_tier": "auto",
            "metadata": None,
        },
    )
    assert no_ops.status_code == 200, no_ops.text
    best_of = http.post("/v1/completions", json={"prompt": "a", "n": 1, "best_of": 3}).json()["error"]
    assert best_of["param"] == "best_of"
    # unknown fields: accepted and named in one warning, as vLLM does
    unknown = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "temprature": 0.5})
    assert unknown.status_code == 200, unknown.text
    nested = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a", "foo": 1}], "max_tokens": 2},
    )
    assert nested.status_code == 200, nested.text
    log = server[1].read_text()
    assert "present in the request but ignored: ['temprature']" in log and "['foo']" in log


# ---- sampling extensions against the offline engine ----------------------------------------------------


def test_logit_bias_minus_100_on_the_greedy_token_changes_the_output(client, llm) -> None:
    plain = greedy_offline(llm, PROMPT).outputs[0]
    served = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=16, temperature=0)
    assert served.choices[0].text == plain.text
    biased = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        logit_bias={str(plain.token_ids[0]): -100},
    )
    expected = greedy_offline(llm, PROMPT, logit_bias={plain.token_ids[0]: -100}).outputs[0]
    assert biased.choices[0].text == expected.text != plain.text


def test_penalties_min_tokens_and_stop_inclusion_match_offline(client, llm) -> None:
    cases = [
        (
            {"frequency_penalty": 1.0, "presence_penalty": 0.5},
            {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        ),
        ({"extra_body": {"repetition_penalty": 1.5}}, {"repetition_penalty": 1.5}),
        ({"stop": ["\n"], "extra_body": {"min_tokens": 10}}, {"stop": ["\n"], "min_tokens": 10}),
        (
            {"stop": ["os"], "extra_body": {"include_stop_str_in_output": True}},
            {"stop": ["os"], "include_stop_str_in_output": True},
        ),
        ({"extra_body": {"bad_words": ["import"]}}, {"bad_words": ["import"]}),
    ]
    for served_kwargs, offline_kwargs in cases:
        served = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=20, temperature=0, **served_kwargs
        ).choices[0]
        expected = greedy_offline(llm, PROMPT, max_tokens=20, **offline_kwargs).outputs[0]
        assert (served.text, served.finish_reason) == (expected.text, expected.finish_reason), served_kwargs


def test_n_greedy_copies_and_echo_with_logprobs(client, http) -> None:
    copies = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert len({c.text for c in copies.choices}) == 1 and len(copies.choices) == 3
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, n=2
    )
    assert chat.choices[0].message.content == chat.choices[1].message.content
    echoed = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    choice = echoed.choices[0]
    plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    num_prompt = echoed.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + echoed.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None and all(
        lp <= 0 for lp in choice.logprobs.token_logprobs[1:]
    )
    streamed = list(
        client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_stream_interval_sends_every_nth_token(client: openai.OpenAI) -> None:
    """--stream-interval 4: the first token at once, then a chunk per 4 tokens, then the rest with the
    finish."""
    kwargs = dict(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=11,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert [len(c.logprobs.tokens) for c in chunks] == [1, 4, 4, 2]
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.finish_reason for c in chunks] == [None, None, None, "length"]


def test_prompt_logprobs_match_offline(http, llm) -> None:
    expected = greedy_offline(llm, PROMPT, max_tokens=2, prompt_logprobs=1).prompt_logprobs
    choice = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    ).json()["choices"][0]
    served = choice["prompt_logprobs"]
    assert served[0] is None and len(served) == len(expected)
    for got, want in zip(served[1:], expected[1:], strict=True):
        assert {int(t): v["logprob"] for t, v in got.items()} == pytest.approx(want, abs=1e-4)
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    assert (
        chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    )
    streamed = http.post("/v1/completions", json={"prompt": "a", "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


# ---- structured outputs --------------------------------------------------------------------------------


def test_response_format_and_guided_outputs_validate(client, http) -> None:
    messages = [{"role": "user", "content": "Give an id and a tag as JSON."}]
    response = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}},
    )
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    sampled = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=60,
        temperature=1.0,
        seed=5,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}},
    )
    jsonschema.validate(
        json.loads("".join(c.choices[0].delta.content or "" for c in sampled if c.choices)), SCHEMA
    )
    # json_object leaves keys and numbers free: a tiny model's greedy output ends only on some prompts
    obj = http.post(
        "/v1/completions",
        json={
            "prompt": "config = ",
            "max_tokens": 100,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
    ).json()["choices"][0]
    assert obj["finish_reason"] == "stop" and isinstance(json.loads(obj["text"]), dict)
    bodies = [
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"guided_regex": r"[0-9]{2}-[a-z]{3}"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{3}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ]
    for extra, check in bodies:
        text = http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 60, "temperature": 0, **extra}
        ).json()["choices"][0]["text"]
        assert check(text), (extra, text)


# ---- tool calls ----------------------------------------------------------------------------------------


def test_tool_calls_named_required_auto_and_history(client) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        tools=[WEATHER],
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required_request = dict(
        model="tiny-llama",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
        parallel_tool_calls=False,
    )
    required = client.chat.completions.create(**required_request)
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    auto = client.chat.completions.create(
        model="tiny-llama", messages=messages, tools=[WEATHER], max_tokens=20, temperature=0
    )
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(
        model="tiny-llama", messages=history, tools=[WEATHER], max_tokens=8, temperature=0, tool_choice="none"
    )
    assert answer.choices[0].message.content is not None and not answer.choices[0].message.tool_calls
    streamed = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=messages,
            tools=[WEATHER],
            max_tokens=60,
            temperature=0,
            stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    deltas = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # vLLM streams a named call's arguments as they are decoded: id and name first, then JSON pieces
    assert len(deltas) > 1 and deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    json.loads(call.function.arguments)
    streamed = list(client.chat.completions.create(**required_request, stream=True))
    deltas = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # "required" streams too: the forced array's calls as they are decoded, not in one chunk at the end
    assert len([c for c in streamed if c.choices and c.choices[0].delta.tool_calls]) > 1
    assert [d.function.name for d in deltas if d.id] == [c.function.name for c in calls]
    arguments = "".join(d.function.arguments for d in deltas)
    assert json.loads(arguments) == json.loads(calls[0].function.arguments)
    assert streamed[-1].choices[0].finish_reason == required.choices[0].finish_reason


def test_hermes_parser() -> None:
    from ascq.runtime.server.tool_calls import parse_hermes

    text = (
        'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Rome"'
    )
    content, calls = parse_hermes(text, {"get_weather"})
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo", "unit": "c"}]
    assert content.startswith("Sure.") and "nope" in content
    assert parse_hermes("no calls", {"get_weather"}) == ("no calls", [])


# ---- routes, auth, startup -----------------------------------------------------------------------------


def test_tokenize_detokenize_models_ping(server, http, llm) -> None:
    base_url, _ = server
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == llm.get_tokenizer().encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    assert http.get("/v1/models/tiny-llama").json()["id"] == "tiny-llama"
    assert http.get("/v1/models/gpt-4").status_code == 404
    assert (
        httpx.get(f"{base_url}/ping").status_code == 200 and httpx.post(f"{base_url}/ping").status_code == 200
    )


def test_vllm_api_key_is_enforced(server) -> None:
    base_url, _ = server
    for path, body in (
        ("/v1/completions", {"prompt": "a"}),
        ("/tokenize", {"prompt": "a"}),
        ("/detokenize", {"tokens": [1]}),
    ):
        for headers in ({"Authorization": "Bearer wrong"}, {}):
            response = httpx.post(f"{base_url}{path}", json=body, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base_url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_startup_log_lines(server) -> None:
    log = server[1].read_text()
    for pattern in (
        r"model: \S*tiny-llama \(served as 'tiny-llama'\)",
        r"dtype: float32, scheme: dense, device: cpu",
        r"KV cache: \d+ blocks x 16 tokens = \d+ tokens \([\d.]+ MiB, float32\), prefix caching off",
        r"max_model_len: 512",
        r"auth: on",
        r"tool calling: hermes parser, auto tool choice on",
        r"URL: http://127\.0\.0\.1:\d+/v1",
    ):
        assert re.search(pattern, log), pattern


def serve_command(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ascq.cli", "serve", str(model_dir), "--port", str(port), *extra]


def test_busy_port_fails_before_torch_or_the_model_loads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A `torch` that cannot be imported proves the check runs before torch (and so the model) is touched; the
    time it takes is in docs/benchmarks.md "Serving" (about 1 s), not an assert here."""
    poison = tmp_path / "poison"
    (poison / "torch").mkdir(parents=True)
    (poison / "torch" / "__init__.py").write_text(
        "raise ImportError('torch imported before the port check')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(poison), *sys.path]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run(
            serve_command(tiny_llama_dir, taken.getsockname()[1]),
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert done.returncode == 1 and "cannot listen on 127.0.0.1" in done.stderr and "in use" in done.stderr
    assert done.stderr.count("\n") == 1 and "torch imported" not in done.stderr
    free = subprocess.run(
        serve_command(tiny_llama_dir, free_port()), capture_output=True, text=True, timeout=60, env=env
    )
    assert free.returncode != 0 and "torch imported before the port check" in free.stderr  # the poison works


def test_too_small_kv_cache_refuses_to_start_and_says_what_fits(tiny_llama_dir: Path) -> None:
    done = subprocess.run(
        serve_command(
            tiny_llama_dir, free_port(), "--kv-cache-memory", str(1 << 20), "--max-model-len", "2048"
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    # tiny-llama fp32 KV: 4 layers x 2 (k, v) x 2 heads x 32 dims x 4 bytes = 2048 bytes per token
    assert (
        "--max-model-len 512 (or less)" in done.stderr and f"--kv-cache-memory {2048 * 2048}" in done.stderr
    )
    assert "Traceback" not in done.stderr

"""What vLLM clients send, against a real `ascq serve` on loopback (tiny-llama): the served names, vLLM's
request fields (each implemented as vLLM does, checked against transformers' own chat-template rendering and
tokenizer), structured outputs, echo-only scoring and continuous usage stats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import jsonschema
import pytest
from test_server import running_server
from transformers import AutoTokenizer

from ascq.runtime.engine.llm import LLM
from ascq.runtime.sampling.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MODEL = "zoo/tiny-llama"  # relative, as a user types it
# a template that reads vLLM's chat-template variables, so each field visibly changes the prompt
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if documents %}{% for d in documents %}[doc] {{ d['text'] }}\n{% endfor %}{% endif %}"
    "{% if enable_thinking %}<think>\n{% endif %}"
    "{% if reasoning_effort %}effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
API_KEY = "conformance-key-7d1e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def template_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, template_path):
    cwd = os.getcwd()
    os.chdir(ROOT)  # the relative model path resolves from the checkout, as a user's shell would
    try:
        with running_server(
            Path(MODEL),
            tmp_path_factory.mktemp("server"),
            "--served-model-name",
            "tiny",
            "tiny-llama-alias",
            "--chat-template",
            str(template_path),
            api_key=API_KEY,
        ) as running:
            yield running
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ROOT / MODEL))


def chat(http, **fields) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def rendered_length(tokenizer, messages=MESSAGES, add_special_tokens=False, **template_fields) -> int:
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **template_fields)
    return len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def test_a_relative_model_path_is_served_under_the_name_typed(tmp_path):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with running_server(Path(MODEL), tmp_path, api_key=API_KEY) as (base_url, _):
            body = {"model": MODEL, "prompt": "import os", "max_tokens": 2}
            response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60, headers=AUTH)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == MODEL
            models = httpx.get(f"{base_url}/v1/models", timeout=10, headers=AUTH).json()["data"]
            assert [m["id"] for m in models] == [MODEL]
    finally:
        os.chdir(cwd)


def test_several_served_model_names(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "tiny-llama-alias"]
    for name in ("tiny", "tiny-llama-alias"):
        response = http.post("/v1/completions", json={"model": name, "prompt": "import os", "max_tokens": 2})
        assert response.status_code == 200, response.text
    missing = http.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 2})
    assert missing.status_code == 404 and "'tiny', 'tiny-llama-alias'" in missing.json()["error"]["message"]


def test_chat_template_fields_render_as_transformers_renders_them(http, tokenizer):
    plain = chat(http)["usage"]["prompt_tokens"]
    assert plain == rendered_length(tokenizer, add_generation_prompt=True)
    thinking = chat(http, chat_template_kwargs={"enable_thinking": True})["usage"]["prompt_tokens"]
    assert thinking == rendered_length(tokenizer, add_generation_prompt=True, enable_thinking=True) > plain
    effort = chat(http, reasoning_effort="low")["usage"]["prompt_tokens"]
    assert effort == rendered_length(tokenizer, add_generation_prompt=True, reasoning_effort="low") > plain
    docs = [{"title": "t", "text": "add returns a + b"}]
    with_docs = chat(http, documents=docs)["usage"]["prompt_tokens"]
    assert with_docs == rendered_length(tokenizer, add_generation_prompt=True, documents=docs) > plain
    no_prompt = chat(http, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert no_prompt == rendered_length(tokenizer, add_generation_prompt=False) < plain


def test_continue_final_message(http, tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "    return"}]
    body = chat(http, messages=messages, add_generation_prompt=False, continue_final_message=True)
    expected = rendered_length(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert body["usage"]["prompt_tokens"] == expected
    both = http.post(
        "/v1/chat/completions",
        json={"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_add_special_tokens(http, tokenizer):
    for add in (True, False):
        body = {"prompt": "import os", "max_tokens": 2, "add_special_tokens": add}
        usage = http.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens"] == len(tokenizer("import os", add_special_tokens=add)["input_ids"])
    chat_with = chat(http, add_special_tokens=True)["usage"]["prompt_tokens"]
    assert chat_with == rendered_length(tokenizer, add_generation_prompt=True, add_special_tokens=True)


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, tokenizer):
    prompt = "import os\nimport sys\nimport json\n"
    ids = tokenizer(prompt)["input_ids"]
    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 3, "echo": True, "temperature": 0}
    response = http.post("/v1/completions", json=body).json()
    assert response["usage"]["prompt_tokens"] == 3
    assert response["choices"][0]["text"].startswith(tokenizer.decode(ids[-3:]))


def test_request_id_priority_and_ignored_fields(http, server):
    body = {"prompt": "a", "max_tokens": 2, "request_id": "client-42"}
    assert http.post("/v1/completions", json=body).json()["id"] == "cmpl-client-42"
    assert chat(http, request_id="client-43")["id"] == "chatcmpl-client-43"
    assert (
        http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "priority": 0}).status_code == 200
    )
    refused = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    openai_fields = {
        "metadata": {"k": "v"},
        "store": True,
        "prompt_cache_key": "k",
        "safety_identifier": "u",
        "verbosity": "low",
        "service_tier": "flex",
    }
    assert chat(http, **openai_fields)["choices"]
    log = server[1].read_text()
    assert (
        "ignored: ['metadata', 'prompt_cache_key', 'safety_identifier', 'service_tier', 'store', 'verbosity']"
        in log
    )


def test_structured_outputs_json_schema(http):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
        "additionalProperties": False,
    }
    body = {"prompt": "data = ", "max_tokens": 64, "temperature": 0, "structured_outputs": {"json": schema}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), schema)


def test_echo_with_max_tokens_zero_scores_the_prompt(http, tokenizer):
    prompt = "import os\nimport sys\n"
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    assert choice["text"] == prompt and data["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(tokenizer(prompt)["input_ids"])
    assert choice["logprobs"]["token_logprobs"][0] is None  # the first token has no context
    assert all(lp is not None and lp <= 0 for lp in choice["logprobs"]["token_logprobs"][1:])
    no_echo = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"


def test_continuous_usage_stats_in_every_chunk(http):
    body = {
        "prompt": "import os",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    content = [e for e in events if e["choices"]]
    assert content and all(e["usage"] is not None for e in content)
    assert [e["usage"]["completion_tokens"] for e in content] == sorted(
        e["usage"]["completion_tokens"] for e in content
    )
    assert events[-1]["usage"]["completion_tokens"] == 5


def test_cache_salt_isolates_the_prefix_cache(tiny_llama_dir):
    """vLLM's cache_salt: only requests with the same salt share cached prefix blocks."""
    llm = LLM(str(tiny_llama_dir), max_num_seqs=2)
    ids = list(range(10, 10 + 64))
    params = SamplingParams(temperature=0, max_tokens=1)

    def cached(prompt) -> int:
        return llm.generate([prompt], params)[0].num_cached_tokens

    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) > 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "bob"}) == 0
    assert cached({"prompt_token_ids": ids}) == 0


VLLM_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:iteration_tokens_total",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:cache_config_info",
)


def test_vllm_metrics_after_one_request(http):
    from prometheus_client.parser import text_string_to_metric_families

    body = {"prompt": "import os", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in VLLM_METRICS:
        family = families.get(name) or families.get(name.removesuffix("_total"))
        assert family is not None, f"{name} missing"
        labels = family.samples[0].labels
        assert labels.get("model_name") == "tiny" and labels.get("engine") == "0", (name, labels)
    counts = {s.name: s.value for f in families.values() for s in f.samples if not s.labels.get("le")}
    assert counts["vllm:request_queue_time_seconds_count"] >= 1
    assert counts["vllm:request_decode_time_seconds_count"] >= 1
    assert counts["vllm:prefix_cache_queries_total"] >= 2  # every prompt token is a query
    config = families["vllm:cache_config_info"].samples[0].labels
    assert config["block_size"] == "16" and config["enable_prefix_caching"] == "True"


def test_version_tokenizer_info_and_invocations(http, tokenizer):
    version = http.get("/version").json()
    assert version["version"] == version["vllm_api_version"] and version["ascq_version"]
    info = http.get("/tokenizer_info").json()
    assert info["vocab_size"] == len(tokenizer) and info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == TEMPLATE and info["model_max_length"] == 512
    chat_body = {"messages": MESSAGES, "max_tokens": 2}
    assert http.post("/invocations", json=chat_body).json()["object"] == "chat.completion"
    assert (
        http.post("/invocations", json={"prompt": "a", "max_tokens": 2}).json()["object"] == "text_completion"
    )
    assert http.post("/invocations", json={"input": "a"}).status_code == 400
    unauthorized = httpx.post(
        str(http.base_url).rstrip("/") + "/invocations", json={"prompt": "a"}, timeout=10
    )
    assert unauthorized.status_code == 401


def test_completion_top_logprobs_include_the_sampled_token(http):
    """vLLM's completions: each top_logprobs dict holds the top-n and the sampled token."""
    body = {"prompt": "import os\n", "max_tokens": 8, "temperature": 1.5, "seed": 3, "logprobs": 1}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert token in top and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in logprobs["top_logprobs"])  # sampled below the top-1 at least once


def test_openai_sdk_responses_plain_and_streamed(server):
    import openai

    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    response = client.responses.create(
        model="tiny", input="def add(a, b):", max_output_tokens=8, instructions="Write Python.", temperature=0
    )
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens >= 1 and response.usage.input_tokens > 0
    chat_text = (
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": "Write Python."}, *MESSAGES],
            max_tokens=8,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    assert response.output_text == chat_text  # the same request through the chat route
    deltas, final = [], None
    with client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "def add(a, b):"}],
        max_output_tokens=8,
        temperature=0,
        stream=True,
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert len(deltas) > 1 and final is not None and final.output_text == "".join(deltas)
    # a Responses field with no chat counterpart is named in the warning, not dropped silently
    client.responses.create(model="tiny", input="a", max_output_tokens=2, truncation="disabled")
    assert "ignored: ['truncation']" in server[1].read_text()


def test_a_prompt_longer_than_max_model_len_is_a_400_naming_both_lengths(http):
    max_model_len = http.post("/tokenize", json={"prompt": "a"}).json()["max_model_len"]
    for num_tokens, max_tokens in ((max_model_len + 5, None), (max_model_len - 2, 4)):
        body = {"model": "tiny", "prompt": [7] * num_tokens}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert f"maximum context length is {max_model_len} tokens" in message
        assert f"the prompt has {num_tokens} tokens" in message
    long_chat = [{"role": "user", "content": "x " * (2 * max_model_len)}]
    response = http.post("/v1/chat/completions", json={"model": "tiny", "messages": long_chat})
    assert response.status_code == 400 and str(max_model_len) in response.json()["error"]["message"]


def test_embeddings_with_the_openai_sdk(server, http, tokenizer):
    import openai

    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    texts = ["def add(a, b):", "import os"]
    result = client.embeddings.create(model="tiny", input=texts)  # the SDK asks for base64 and decodes it
    as_floats = http.post("/v1/embeddings", json={"model": "tiny", "input": texts}).json()
    assert [d.index for d in result.data] == [0, 1] and as_floats["object"] == "list"
    for decoded, plain in zip(result.data, as_floats["data"], strict=True):
        assert decoded.embedding == pytest.approx(plain["embedding"], abs=1e-6)  # float32 on the wire
        assert sum(x * x for x in plain["embedding"]) == pytest.approx(1.0, abs=1e-3)
    ids = tokenizer(texts[0])["input_ids"]
    assert result.usage.prompt_tokens == len(ids) + len(tokenizer(texts[1])["input_ids"])
    by_ids = http.post("/v1/embeddings", json={"model": "tiny", "input": ids}).json()
    assert by_ids["data"][0]["embedding"] == as_floats["data"][0]["embedding"]
    refused = http.post("/v1/embeddings", json={"model": "tiny", "input": "a", "dimensions": 8})
    assert refused.status_code == 400 and "matryoshka" in refused.json()["error"]["message"]
    unauthorized = httpx.post(f"{server[0]}/v1/embeddings", json={"input": "a"}, timeout=30)
    assert unauthorized.status_code == 401

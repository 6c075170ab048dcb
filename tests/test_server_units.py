"""Server pieces that need no server process: chat templates, request validation, benchmark statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ascq.core.errors import AscqError
from ascq.runtime.bench.serve import RequestResult, summarize
from ascq.runtime.server.chat_template import ChatPrompter, load_chat_template
from ascq.runtime.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if "
    "add_generation_prompt %}[assistant] {% endif %}"
)


def test_chat_template_from_file_inline_and_missing(tmp_path: Path, tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    template_file = tmp_path / "plain.jinja"
    template_file.write_text(PLAIN_TEMPLATE)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for source in (str(template_file), PLAIN_TEMPLATE):
        ids = ChatPrompter(tokenizer, load_chat_template(source)).render(messages)
        assert tokenizer.decode(ids) == "[system] be brief\n[user] hi\n[assistant] "
    chatml = ChatPrompter(tokenizer, None).render(messages)  # the tokenizer's own (ChatML) template
    assert tokenizer.decode(chatml).startswith("<|im_start|>system")
    tokenizer.chat_template = None
    with pytest.raises(APIError) as missing:
        ChatPrompter(tokenizer, None).render(messages)
    assert missing.value.status == 400 and "--chat-template" in missing.value.message
    with pytest.raises(AscqError):
        load_chat_template(tmp_path / "absent.jinja")
    rejecting = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(APIError, match="roles must alternate"):
        ChatPrompter(tokenizer, rejecting).render(messages)


def test_request_models_are_strict() -> None:
    ok = CompletionRequest.model_validate(
        {"prompt": ["a", "b"], "temperature": 1, "suffix": None, "store": False}
    )
    assert ok.prompts() == ["a", "b"] and ok.temperature == 1.0
    # an unknown field is accepted and dropped with a warning naming it, as vLLM does
    assert not hasattr(CompletionRequest.model_validate({"prompt": "a", "unknown_field": 1}), "unknown_field")
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompts() == [[5, 6]]
    for bad in (
        {"prompt": "a", "temperature": "0.5"},
        {"prompt": "a", "stream": "yes"},
        {"prompt": []},
        {"prompt": "a", "frequency_penalty": 2.5},
        {"prompt": "a", "n": 0},
        {"prompt": "a", "suffix": "x"},
        {"prompt": "a", "best_of": 2},
    ):
        with pytest.raises(ValueError):
            CompletionRequest.model_validate(bad)
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                }
            ]
        }
    )
    assert chat.messages[0].as_template_dict() == {"role": "system", "content": "xy"}


def test_bench_summary_percentiles() -> None:
    results = [
        RequestResult(
            ok=True,
            ttft=t / 1000,
            latency=t / 1000 + 0.09,
            output_tokens=10,
            prompt_tokens=5,
            itls=[0.01] * 9,
        )
        for t in range(1, 101)
    ]
    results.append(RequestResult(ok=False, error="HTTP 500"))
    metrics = summarize(results, duration=2.0)
    assert metrics["completed"] == 100 and metrics["failed"] == 1
    assert metrics["request_throughput"] == 50.0 and metrics["output_throughput"] == 500.0
    assert metrics["p50_ttft_ms"] == pytest.approx(50.5) and metrics["p99_ttft_ms"] == pytest.approx(99.01)
    assert metrics["p50_tpot_ms"] == pytest.approx(10.0) and metrics["p99_itl_ms"] == pytest.approx(10.0)
    with pytest.raises(AscqError, match="all 1 requests failed"):
        summarize([RequestResult(ok=False, error="boom")], duration=1.0)

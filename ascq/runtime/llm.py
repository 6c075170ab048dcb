"""`LLM`: the synchronous offline API (vLLM's `LLM.generate` / `LLM.chat`)."""

from __future__ import annotations

from typing import Any

from ascq.runtime.engine import LLMEngine
from ascq.runtime.engine_args import EngineArgs
from ascq.runtime.outputs import RequestOutput
from ascq.runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, tokenizer: Any = None, **engine_args: Any) -> None:
        """`tokenizer`: a path (like vLLM) or a tokenizer object (the custom-tokenizer plug-in point)."""
        tokenizer_obj = None
        if tokenizer is not None and not isinstance(tokenizer, str):
            tokenizer_obj = tokenizer
        elif tokenizer is not None:
            engine_args["tokenizer"] = tokenizer
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args), tokenizer=tokenizer_obj)
        self.num_requests = 0

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-rank engine (tensor / pipeline parallel); no-op otherwise."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: Any) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            request_id = str(self.num_requests)
            self.num_requests += 1
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the assistant turn opened) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

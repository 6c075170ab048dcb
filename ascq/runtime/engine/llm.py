"""`LLM`: the synchronous offline API (vLLM's `LLM.generate` / `LLM.chat`), taking vLLM's prompts and
kwargs."""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

from ascq.runtime.distributed.rendezvous import torchrun_rank
from ascq.runtime.engine.core_client import EngineCoreClient
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from ascq.runtime.sampling.sampling_params import SamplingParams

# vLLM's prompt shapes: a string, a token id list, TextPrompt {"prompt": str}, TokensPrompt
# {"prompt_token_ids": [...]}
PromptType = str | list[int] | dict[str, Any]
PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def engine_args_from_kwargs(model: str, kwargs: dict[str, Any]) -> EngineArgs:
    """EngineArgs from LLM(...) kwargs; an unknown name is a one-line TypeError naming the closest valid
    one."""
    valid = [f.name for f in fields(EngineArgs)]
    for name in kwargs:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(valid))}"
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")
    return EngineArgs(model=model, **kwargs)


def parse_prompt(prompt: PromptType) -> str | list[int] | dict[str, Any]:
    """The text or token ids of one vLLM-style prompt (a dict with its `cache_salt` when it has one)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise ValueError(
                f"prompt dict keys {sorted(unknown)} are not supported; supported: "
                f"{', '.join(sorted(PROMPT_KEYS))}"
            )
        if prompt.get("cache_salt") is not None:
            if not isinstance(prompt["cache_salt"], str) or not prompt["cache_salt"]:
                raise ValueError("cache_salt must be a non-empty string")
            inner = parse_prompt({k: v for k, v in prompt.items() if k != "cache_salt"})
            key = "prompt" if isinstance(inner, str) else "prompt_token_ids"
            return {key: inner, "cache_salt": prompt["cache_salt"]}
        if "prompt_token_ids" in prompt:
            return parse_prompt(list(prompt["prompt_token_ids"]))
        if "prompt" in prompt:
            return parse_prompt(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt)")
    if isinstance(prompt, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise ValueError(
        f"unsupported prompt type {type(prompt).__name__}: give a str, a list of token ids, or a "
        "TextPrompt / TokensPrompt dict"
    )


def as_prompt_list(prompts: PromptType | list[PromptType]) -> list[str | list[int] | dict[str, Any]]:
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    return [parse_prompt(p) for p in prompts]


class LLM:
    def __init__(self, model: str, tokenizer: Any = None, **engine_args: Any) -> None:
        """`tokenizer`: a path (like vLLM) or a tokenizer object (the custom-tokenizer plug-in point).
        `engine_args`: EngineArgs fields, which use vLLM's names (tensor_parallel_size,
        gpu_memory_utilization, enforce_eager, quantization, trust_remote_code, max_model_len, seed, dtype,
        kv_cache_dtype, ...)."""
        tokenizer_obj = None
        if tokenizer is not None and not isinstance(tokenizer, str):
            tokenizer_obj = tokenizer
        elif tokenizer is not None:
            engine_args["tokenizer"] = tokenizer
        args = engine_args_from_kwargs(model, engine_args)
        if args.world_size > 1 and torchrun_rank() is None:  # rank 0 in its own process: see core_client.py
            if tokenizer_obj is not None:
                raise ValueError(
                    "a tokenizer object cannot be used with tensor / pipeline parallel (the engine runs in "
                    "its own process); pass the tokenizer's path"
                )
            self.engine: LLMEngine | EngineCoreClient = EngineCoreClient(args)
        else:
            self.engine = LLMEngine(args, tokenizer=tokenizer_obj)
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
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. `use_tqdm` is accepted for vLLM
        compatibility; a progress bar is drawn only when it is true."""
        prompt_list = as_prompt_list(prompts)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompt_list)
        )
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompt_list, params, strict=True):
            request_id = str(self.num_requests)
            self.num_requests += 1
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="Processed prompts")
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[i] for i in ids]

    def embed(
        self, prompts: PromptType | list[PromptType], use_tqdm: bool = False
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed` with LAST pooling: each prompt's last-token final hidden state, normalized."""
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling="last")
        return [
            EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.prompt_embedding), o.prompt_token_ids)
            for o in self.generate(prompts, params, use_tqdm=use_tqdm)
        ]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

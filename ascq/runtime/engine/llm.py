"""`LLM`: the synchronous offline API (vLLM's `LLM.generate` / `LLM.chat`), taking vLLM's prompts and
kwargs."""

from __future__ import annotations

from typing import Any

from ascq.runtime.engine.core_client import EngineCoreClient, offline_engine
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.inputs import PromptType, as_prompt_list
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from ascq.runtime.engine.pooling_params import PoolingParams
from ascq.runtime.sampling.sampling_params import SamplingParams


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
        self.engine: LLMEngine | EngineCoreClient = offline_engine(
            EngineArgs(model=model, **engine_args), tokenizer_obj
        )
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
        self,
        prompts: PromptType | list[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed` with LAST pooling: each prompt's last-token final hidden state, normalized."""
        params = (pooling_params or PoolingParams()).to_sampling_params()
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

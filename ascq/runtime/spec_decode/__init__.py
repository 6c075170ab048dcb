"""Speculative decoding (vLLM's `speculative_config`): proposers, the rejection sampler and the proposer
factory.

A proposer suggests up to k next tokens per running sequence after each step; the scheduler runs them as extra
query rows of that sequence in the target's next step, and `rejection_sampler` keeps the longest prefix the
target distribution accepts plus one token of its own, so outputs follow the target's distribution exactly.
"""

from __future__ import annotations

from typing import Any

from ascq.runtime.spec_decode.config import SpeculativeConfig


def make_proposer(config: SpeculativeConfig, engine: Any) -> Any:
    """The proposer for `config`, built for `engine` (a draft model shares its device, dtype, KV layout)."""
    if config.method == "ngram":
        from ascq.runtime.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    from ascq.runtime.spec_decode.draft_model_proposer import DraftModelProposer

    return DraftModelProposer(
        config.model,
        config.num_speculative_tokens,
        target_config=engine.config,
        target_tokenizer=engine.tokenizer,
        device=engine.args.device,
        dtype=engine.dtype,
        cache_dtype=engine.kv_cache_dtype,
        num_blocks=engine.block_manager.num_blocks,
        block_size=engine.args.block_size,
        generator=engine.sampler.generator,
    )


__all__ = ["SpeculativeConfig", "make_proposer"]

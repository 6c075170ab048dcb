"""Gemma 3's tokenizer from a GGUF header, for `ascq zoo import-gguf`.

A Gemma 3 GGUF stores its SentencePiece BPE vocabulary as pieces with scores (higher merges first) and token
types, without merges. transformers' GGUF conversion reads it as a Unigram model, which splits words into
single characters ("Hello world" became 11 ids). Here it becomes what transformers' own Gemma tokenizer is: a
BPE model with byte fallback whose merges come from the pieces and their scores (transformers'
`generate_merges`, the rule its SentencePiece converter uses), control pieces special, user-defined pieces
added tokens, `<bos>` prepended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (SentencePiece's piece types)

# Gemma 3's chat template (google/gemma-3-270m's tokenizer_config.json); a GGUF made by llama.cpp's
# GGUF-my-repo from the base checkpoint carries none
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
END_OF_TURN = "<end_of_turn>"  # where a chat turn of the model ends: a stop token besides <eos>


def gemma3_tokenizer(path: Path) -> Any:
    """transformers' GemmaTokenizer for a Gemma 3 GGUF file."""
    from gguf import GGUFReader
    from tokenizers import AddedToken
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    fields = {k: v.contents() for k, v in GGUFReader(path).fields.items() if k.startswith("tokenizer.")}
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"]]
    scores = [float(s) for s in fields["tokenizer.ggml.scores"]]
    types = [int(t) for t in fields["tokenizer.ggml.token_type"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    # control / user-defined pieces are never merged into (nor out of) other pieces
    skip = {t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, USER_DEFINED)}
    merges = generate_merges(vocab, list(zip(tokens, scores, strict=True)), skip_tokens=skip)

    def token(role: str) -> str:
        return tokens[int(fields[f"tokenizer.ggml.{role}_token_id"])]

    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=token("unknown"),
        bos_token=token("bos"),
        eos_token=token("eos"),
        pad_token=token("padding"),
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", True)),
        add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False, special=kind == CONTROL)
            for t, kind in zip(tokens, types, strict=True)
            if kind in (CONTROL, USER_DEFINED)
        ]
    )
    tokenizer.chat_template = fields.get("tokenizer.chat_template") or GEMMA3_CHAT_TEMPLATE
    return tokenizer

"""A byte-level BPE tokenizer with no merges, for checkpoints without a real one (synthetic sources, dummy
weights): ids 0-255 are the bytes (in the sorted order of the byte-level alphabet), then optional filler
tokens up to a vocabulary size, then the special tokens."""

from __future__ import annotations

from typing import Any

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer(specials: list[str], eos: str, bos: str, vocab_size: int | None = None) -> Any:
    """A `PreTrainedTokenizerFast`; `vocab_size`: pad with `<dummy_i>` tokens so that every id of a model's
    vocabulary decodes (None: no padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    num_filler = 0 if vocab_size is None else vocab_size - len(alphabet) - len(specials)
    vocab = {token: i for i, token in enumerate([*alphabet, *(f"<dummy_{i}>" for i in range(num_filler))])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=bos)


def dummy_tokenizer(vocab_size: int) -> Any:
    """A byte-level tokenizer padded to `vocab_size` ids (every id the model can sample decodes), with
    ChatML chat markers and template: text in, noise out."""
    tokenizer = byte_level_tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        eos="<|im_end|>",
        bos="<|endoftext|>",
        vocab_size=vocab_size,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer

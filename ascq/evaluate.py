"""Held-out perplexity protocol shared by fixture training, converters, tests and benchmarks.

Tokens: `ascq/data/eval.txt` (documents joined by `<|endoftext|>`, which encodes as the special token) encoded
as one stream with no added bos/eos. Windows: the stream is cut into `len // seq_len` non-overlapping windows
of exactly `seq_len` tokens starting at token 0; the trailing partial window is dropped. Each window is scored
on its own (fresh context, no bos prepended): position i predicts token i + 1, so a window contributes
`seq_len - 1` predicted tokens. Perplexity = exp(sum of token NLLs / number of predicted tokens), log-softmax
computed in float32.

Unigram baseline: add-one smoothed unigram over the full vocabulary, p(t) = (count_train(t) + 1) / (N_train +
V), fitted on training/calibration tokens and evaluated on every eval token: exp(-mean log p(t)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ascq.core.errors import AscqError
from ascq.paths import EVAL_TEXT

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def encode_text(tokenizer_or_dir: Any, text: str) -> torch.Tensor:
    """Token ids of `text` without added special tokens; accepts a model/tokenizer folder or a tokenizer
    object."""
    if isinstance(tokenizer_or_dir, (str, Path)):
        from tokenizers import Tokenizer

        path = Path(tokenizer_or_dir) / "tokenizer.json"
        if not path.is_file():
            raise AscqError(f"{tokenizer_or_dir}: tokenizer.json is missing")
        ids = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids
    elif hasattr(tokenizer_or_dir, "backend_tokenizer"):  # transformers fast tokenizer
        ids = tokenizer_or_dir.backend_tokenizer.encode(text, add_special_tokens=False).ids
    else:  # a `tokenizers.Tokenizer`
        ids = tokenizer_or_dir.encode(text, add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.long)


def load_eval_token_ids(tokenizer_or_dir: Any, path: str | Path = EVAL_TEXT) -> torch.Tensor:
    """The held-out text as one LongTensor stream of token ids (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise AscqError(f"eval text {path} does not exist")
    return encode_text(tokenizer_or_dir, path.read_text(encoding="utf-8"))


def eval_windows(token_ids: torch.Tensor, seq_len: int = 256) -> torch.Tensor:
    """[num_windows, seq_len] non-overlapping windows from token 0; the trailing partial window is dropped."""
    num_windows = token_ids.numel() // seq_len
    if num_windows == 0:
        raise AscqError(f"eval text has {token_ids.numel()} tokens, fewer than one window of {seq_len}")
    return token_ids[: num_windows * seq_len].view(num_windows, seq_len)


@torch.no_grad()
def perplexity(
    logits_fn: LogitsFn, token_ids: torch.Tensor, seq_len: int = 256, batch_size: int = 8
) -> float:
    """Held-out perplexity of `logits_fn` (input ids [batch, seq_len] -> logits [batch, seq_len, vocab])."""
    windows = eval_windows(token_ids, seq_len)
    total_nll, num_predicted = 0.0, 0
    for batch in windows.split(batch_size):
        logits = logits_fn(batch)
        log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
        targets = batch[:, 1:].to(log_probs.device)
        total_nll -= log_probs.gather(-1, targets[..., None]).sum().item()
        num_predicted += targets.numel()
    return math.exp(total_nll / num_predicted)


def unigram_perplexity(token_ids_train: torch.Tensor, token_ids_eval: torch.Tensor, vocab_size: int) -> float:
    """Perplexity on the eval tokens of an add-one smoothed unigram fitted on the training tokens."""
    counts = torch.bincount(token_ids_train.flatten(), minlength=vocab_size).double() + 1.0
    log_probs = counts.log() - counts.sum().log()
    return math.exp(-log_probs[token_ids_eval.flatten()].mean().item())

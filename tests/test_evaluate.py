"""The held-out perplexity protocol: windows, NLL bookkeeping and the unigram baseline, against plain math."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ascq.core.errors import AscqError
from ascq.evaluate import eval_windows, load_eval_token_ids, perplexity, unigram_perplexity


def test_uniform_model_has_perplexity_vocab_size():
    ids = torch.randint(0, 50, (1000,))
    assert perplexity(lambda x: torch.zeros(*x.shape, 50), ids, seq_len=64, batch_size=3) == pytest.approx(
        50.0
    )


def test_perplexity_matches_explicit_loop_over_windows():
    torch.manual_seed(0)
    table = torch.randn(30, 30)  # a bigram "model": logits depend on the current token only
    ids = torch.randint(0, 30, (203,))
    got = perplexity(lambda x: table[x], ids, seq_len=20, batch_size=4)
    nll, count = 0.0, 0
    for start in range(0, 200, 20):  # 10 full windows; the last 3 tokens are dropped
        for i in range(start, start + 19):
            nll -= torch.log_softmax(table[ids[i]].double(), dim=0)[ids[i + 1]].item()
            count += 1
    assert count == 190
    assert got == pytest.approx(math.exp(nll / count), rel=1e-6)


def test_eval_windows_drop_the_tail_and_reject_short_text():
    windows = eval_windows(torch.arange(10), seq_len=4)
    assert windows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(AscqError, match="fewer than one window"):
        eval_windows(torch.arange(3), seq_len=4)


def test_unigram_perplexity_is_add_one_smoothed():
    train, evaluation, vocab = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 2, 3]), 5
    counts = Counter(train.tolist())
    log_p = [math.log((counts[t] + 1) / (len(train) + vocab)) for t in evaluation.tolist()]
    assert unigram_perplexity(train, evaluation, vocab) == pytest.approx(math.exp(-sum(log_p) / 3))


def test_eval_tokens_round_trip_through_the_fixture_tokenizer(tiny_llama_dir, eval_text_path):
    from transformers import AutoTokenizer

    ids = load_eval_token_ids(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert torch.equal(ids, load_eval_token_ids(tokenizer))
    assert tokenizer.decode(ids.tolist()) == eval_text_path.read_text(encoding="utf-8")
    assert (ids == tokenizer.eos_token_id).sum() >= 5  # documents are separated by <|endoftext|>
    with pytest.raises(AscqError, match="does not exist"):
        load_eval_token_ids(tiny_llama_dir, path=tiny_llama_dir / "missing.txt")

"""Sampler: greedy, temperature, top-k / top-p / min-p truncation, seeds, logprobs, logits processors."""

from __future__ import annotations

import pytest
import torch

from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sched.request import Request
from ascq.runtime.worker.sampler import Sampler, apply_min_p, apply_top_k_top_p


def request(**params) -> Request:
    p = SamplingParams(**params)
    generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return Request("r", None, [1, 2, 3], p, generator)


def test_greedy_takes_argmax():
    logits = torch.randn(3, 50)
    results = Sampler()(logits, [request(temperature=0.0) for _ in range(3)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_k_tokens_per_row():
    logits = torch.randn(2, 100)
    masked = apply_top_k_top_p(logits, torch.tensor([5, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(masked[0]).sum() == 5 and torch.isfinite(masked[1]).sum() == 100
    assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == set(
        logits[0].topk(5).indices.tolist()
    )


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p(probs.log(), torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    masked = apply_top_k_top_p(probs.log(), torch.tensor([0]), torch.tensor([0.1]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]]


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([[0.6, 0.3, 0.08, 0.02]])
    masked = apply_min_p(probs.log(), torch.tensor([0.1]))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0])
    logits = probs.log().expand(4000, -1).clone()
    results = Sampler(seed=0)(logits, [request(temperature=1.0) for _ in range(4000)])
    counts = torch.bincount(torch.tensor([r.token_id for r in results]), minlength=4).float() / 4000
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_temperature_sharpens():
    logits = torch.tensor([2.0, 1.0, 0.0]).expand(3000, -1).clone()
    cold = Sampler(seed=1)(logits, [request(temperature=0.2) for _ in range(3000)])
    hot = Sampler(seed=1)(logits, [request(temperature=2.0) for _ in range(3000)])
    assert sum(r.token_id == 0 for r in cold) > sum(r.token_id == 0 for r in hot) + 500


def test_per_request_seed_is_reproducible_regardless_of_batch():
    logits = torch.randn(1, 1000)
    alone = [Sampler()(logits, [request(seed=42, temperature=1.0)])[0].token_id for _ in range(3)]
    batch = torch.cat([torch.randn(2, 1000), logits])
    mixed = Sampler(seed=9)(
        batch, [request(temperature=1.0), request(temperature=1.0), request(seed=42, temperature=1.0)]
    )
    assert alone == [alone[0]] * 3 and mixed[2].token_id == alone[0]


def test_logprobs_are_log_softmax_with_top_n_and_sampled_token():
    logits = torch.randn(1, 64)
    result = Sampler()(logits, [request(temperature=1.0, top_k=3, logprobs=4, seed=0)])[0]
    expected = logits[0].log_softmax(-1)
    assert set(expected.topk(4).indices.tolist()) <= set(result.logprobs)
    assert result.token_id in result.logprobs
    for token, value in result.logprobs.items():
        assert value == pytest.approx(float(expected[token]), abs=1e-6)


def test_logits_processor_runs_before_sampling():
    seen = []

    def ban_argmax(token_ids, logits):
        seen.append(list(token_ids))
        logits[logits.argmax()] = float("-inf")
        return logits

    logits = torch.randn(1, 20)
    result = Sampler()(logits.clone(), [request(temperature=0.0, logits_processors=[ban_argmax])])[0]
    assert result.token_id == logits[0].topk(2).indices[1] and seen == [[]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [3]}, "stop"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"bad_words": [""]}, "bad_words"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_invalid_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_normalize_stop_and_top_k():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == []

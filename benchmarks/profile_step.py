"""Where each millisecond of a decode step goes: batch-B decode through the real engine (`LLMEngine.step`).

B requests are admitted and prefilled, then N decode steps are timed. Each step is split by wall clock into
the engine's phases (scheduler, metadata building in `ModelRunner.prepare`, the model forward, the LM head,
the sampler, the engine's own bookkeeping), and the forward further into its leaf layers (linears, attention
kernel, KV cache write, norms, rotary, embedding) by timing those calls; "python / other" is the forward's
time outside them (module dispatch, splits/views, residual adds). With decode graphs (`--no-enforce-eager`)
the forward is one number: its parts run inside compiled layers; with fused decode (the eager default for bf16
/ W4A16 / W8A16 Llama and DeepSeek-MoE layers, runtime/worker/fused_decode.py; ASCQ_FUSED_DECODE=0 turns it
off) a decode step's layers are one native call, "fused decode layers (native)" (a step it does not take
counts its check there and its eager layers in their rows). Prints a markdown table of ms per step (median
over steps), and beside it the step's bandwidth bound: the bytes one decode step must move (every linear's
weights and qparams as its kernel keeps them for small batches (`cpu.streamed_bytes`), the MoE experts the
batch is expected to route to, the LM head, the KV cache read at the step's context) divided by this host's
read bandwidth measured with the same threads (the best of several passes of `torch.sum` over a buffer far
larger than the caches), and the measured step's share of it (1.00: at the memory bound; a model whose
weights fit the caches can pass 1).

    OMP_NUM_THREADS=2 python benchmarks/profile_step.py --model zoo/smollm2-135m-instruct --dtype float32 \\
        --batch 1 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import torch

from ascq import LLM, SamplingParams
from ascq.core.rotary import RotaryEmbedding
from ascq.kernels import cpu
from ascq.runtime.layers.attention import Attention
from ascq.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ascq.runtime.layers.linear import LinearBase
from ascq.runtime.layers.moe import FusedMoE
from ascq.runtime.layers.rmsnorm import RMSNorm

LEAF_LAYERS = {
    LinearBase: "linears",
    FusedMoE: "moe experts (routing, grouped expert linears)",
    RMSNorm: "norms (+residual add)",
    RotaryEmbedding: "rotary",
    VocabParallelEmbedding: "embedding",
}


class StepClock:
    """Accumulates wall time per label within one step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.depth = 0

    @contextmanager
    def timed(self, label: str, leaf: bool = True):
        if leaf and self.depth:  # a leaf inside a leaf (e.g. a norm's linear): count once, at the outer one
            yield
            return
        self.depth += leaf
        start = time.perf_counter()
        try:
            yield
        finally:
            self.step[label] += time.perf_counter() - start
            self.depth -= leaf

    def wrap(self, label: str, fn: Callable, leaf: bool = True) -> Callable:
        def timed_fn(*args, **kwargs):
            with self.timed(label, leaf):
                return fn(*args, **kwargs)

        return timed_fn

    def end_step(self) -> None:
        self.steps.append(dict(self.step))
        self.step = defaultdict(float)


def instrument(llm: LLM, clock: StepClock) -> None:
    engine = llm.engine
    engine.scheduler.schedule = clock.wrap("scheduler", engine.scheduler.schedule, leaf=False)
    engine.scheduler.update_after_step = clock.wrap(
        "scheduler", engine.scheduler.update_after_step, leaf=False
    )
    engine.runner.prepare = clock.wrap("metadata (prepare)", engine.runner.prepare, leaf=False)
    engine.sampler = clock.wrap("sampler", engine.sampler, leaf=False)
    model = engine.model
    model.forward = clock.wrap("forward (total)", model.forward, leaf=False)
    model.compute_logits = clock.wrap("lm head", model.compute_logits, leaf=False)
    if engine.runner.decode_graphs is not None:  # timers inside a compiled layer would break its graph
        return
    decoder = getattr(model, "model", None)
    if getattr(decoder, "fused_decode", None) is not None:  # a decode step's layers in one native call
        decoder.fused_decode = clock.wrap("fused decode layers (native)", decoder.fused_decode)
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            continue
        for cls, label in LEAF_LAYERS.items():
            if isinstance(module, cls):
                module.forward = clock.wrap(label, module.forward)
        if isinstance(module, Attention):
            backend = module.backend

            class TimedBackend:  # per-layer proxy so the shared backend module stays untouched
                write_kv_cache = staticmethod(clock.wrap("kv cache write", backend.write_kv_cache))
                paged_attention = staticmethod(clock.wrap("attention kernel", backend.paged_attention))

            module.backend = TimedBackend


FORWARD_PARTS = (
    "fused decode layers (native)",
    "linears",
    "moe experts (routing, grouped expert linears)",
    "attention kernel",
    "kv cache write",
    "norms (+residual add)",
    "rotary",
    "embedding",
)
ENGINE_PARTS = ("scheduler", "metadata (prepare)", "lm head", "sampler")


STREAM_BYTES = 512 << 20  # far past any L3 cache


def stream_bandwidth(rounds: int = 5) -> float:
    """Bytes per second a full read of a large buffer reaches on torch's threads (the best of `rounds`)."""
    buf = torch.ones(STREAM_BYTES // 4)
    buf.sum()  # pages touched
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return STREAM_BYTES / best


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch routes to, on average, with each token's top_k drawn uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_bytes(llm: LLM, batch: int, context: int) -> dict[str, float]:
    """Bytes a batch-`batch` decode step at `context` tokens of KV per sequence reads: linears, MoE experts,
    LM head, KV cache."""
    parts = defaultdict(float)
    for module in llm.engine.model.modules():
        if isinstance(module, LinearBase) and isinstance(module.prepared, cpu.CpuLinear):
            parts["linears"] += cpu.streamed_bytes(module.prepared)
        elif isinstance(module, FusedMoE) and module.prepared is not None:
            experts = module.prepared
            every = sum(cpu.streamed_bytes(p) for p in (*experts.gate_up, *experts.down))
            share = expected_experts(module.num_experts, module.top_k, batch) / module.num_experts
            parts["moe experts"] += every * share
        elif isinstance(module, ParallelLMHead):
            head = module.weight if module.int8 is None else module.int8.data
            parts["lm head"] += head.numel() * head.element_size()
        elif isinstance(module, Attention):
            k_cache = module.k_cache
            per_token = 2 * k_cache.shape[-2] * k_cache.shape[-1] * k_cache.element_size()
            parts["kv cache"] += batch * context * per_token
    return parts


def profile(
    model: str, dtype: str, batch: int, num_steps: int, context: int, eager: bool
) -> tuple[dict[str, float], dict[str, float]]:
    kwargs = {"enforce_eager": eager} if eager is not None else {}
    llm = LLM(model, dtype=dtype, max_num_seqs=batch, kv_cache_memory=512 << 20, **kwargs)
    prompts = [[100 + (i * 7 + j) % 3000 for j in range(context)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=num_steps + 8, ignore_eos=True)
    # warm-up (compiles, native kernels)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    clock = StepClock()
    instrument(llm, clock)
    for _ in range(num_steps):
        with clock.timed("step (total)", leaf=False):
            engine.step()
        clock.end_step()
    med = {k: statistics.median(s.get(k, 0.0) for s in clock.steps) * 1e3 for k in clock.steps[0]}
    med["python / other (in forward)"] = med["forward (total)"] - sum(med.get(k, 0.0) for k in FORWARD_PARTS)
    med["engine bookkeeping"] = (
        med["step (total)"] - med["forward (total)"] - sum(med.get(k, 0.0) for k in ENGINE_PARTS)
    )
    # the KV read at the timed steps' middle context (prompt, warm-up steps, half the timed ones)
    return med, step_bytes(llm, batch, context + 3 + num_steps // 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="zoo/smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="eager steps, or (--no-enforce-eager) decode graphs; default: the engine's default",
    )
    args = parser.parse_args()
    profiles = {
        b: profile(args.model, args.dtype, b, args.steps, args.context, args.enforce_eager)
        for b in args.batch
    }
    results = {b: med for b, (med, _) in profiles.items()}
    bandwidth = stream_bandwidth()
    rows = [
        "step (total)",
        "forward (total)",
        *FORWARD_PARTS,
        "python / other (in forward)",
        *ENGINE_PARTS,
        "engine bookkeeping",
    ]
    print(
        f"# decode step, {args.model} {args.dtype}, context {args.context}, {torch.get_num_threads()} "
        f"threads, "
        f"median of {args.steps} steps (ms)"
    )
    print()
    print("| part | " + " | ".join(f"batch {b}" for b in args.batch) + " |")
    print("|---|" + "---:|" * len(args.batch))
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{results[b].get(row, 0.0):.2f}" for b in args.batch) + " |")
    print()
    print(
        f"Bandwidth bound: bytes a step moves / {bandwidth / 1e9:.1f} GB/s (read bandwidth measured now on "
        f"{torch.get_num_threads()} threads, best of 5 passes over {STREAM_BYTES >> 20} MiB)"
    )
    print()
    print("| bound | " + " | ".join(f"batch {b}" for b in args.batch) + " |")
    print("|---|" + "---:|" * len(args.batch))
    parts = sorted({part for _, moved in profiles.values() for part in moved})
    for part in parts:
        print(
            f"| {part} (MB) | "
            + " | ".join(f"{profiles[b][1].get(part, 0) / 1e6:.1f}" for b in args.batch)
            + " |"
        )
    totals = {b: sum(moved.values()) for b, (_, moved) in profiles.items()}
    bounds = {b: totals[b] / bandwidth * 1e3 for b in args.batch}
    print("| total (MB) | " + " | ".join(f"{totals[b] / 1e6:.1f}" for b in args.batch) + " |")
    print("| bound (ms per step) | " + " | ".join(f"{bounds[b]:.2f}" for b in args.batch) + " |")
    print(
        "| bound / measured step | "
        + " | ".join(f"{bounds[b] / results[b]['step (total)']:.2f}" for b in args.batch)
        + " |"
    )
    print(
        "| bound tok/s, measured tok/s | "
        + " | ".join(
            f"{b / bounds[b] * 1e3:.0f}, {b / results[b]['step (total)'] * 1e3:.0f}" for b in args.batch
        )
        + " |"
    )


if __name__ == "__main__":
    main()

"""Device graphs (`enforce_eager=False` on cuda / npu, ascq/runtime/worker/device_graphs.py) on the CPU
torch_npu EMULATOR with its emulated ACL graph API (tests/npu_emulation/graphs.py) installed as `torch.npu`:
greedy tokens equal eager's for tiny-llama and tiny-deepseek-moe over batch sizes that replay exactly, replay
padded and run eagerly past the largest capture size, and the graphs were really replayed; plus the emulated
graph API itself (host reads refused during capture, replay reads the static buffers' current values).

The cuda path is the same code with torch.cuda's graph API; it has not run here (no GPU):
`benchmarks/cuda_check.py` compares graphs-on and eager greedy tokens of tiny-llama on a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import npu_emulation
import pytest
import torch
import torch.nn.functional as F
from npu_emulation import graphs as emulated_graphs

from ascq import LLM, SamplingParams
from ascq.runtime.layers.attention import Attention
from ascq.runtime.worker import device_graphs

PROMPTS = [[5 + (7 * i + j) % 200 for j in range(3 + 5 * i)] for i in range(6)]
MAX_TOKENS = [12, 10, 8, 6, 4, 2]  # the decode batch shrinks 6, 5, 4, 3, 2, 1 as requests finish


@pytest.fixture
def npu_graphs(npu_backend, monkeypatch):
    """The npu backend on the emulator, with the emulated graph API as `torch.npu`."""
    monkeypatch.setattr(torch, "npu", emulated_graphs, raising=False)
    return emulated_graphs


# ---- the emulated graph API
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: int(x[0]),
        lambda x: bool(x[0] > 0),
        lambda x: x.tolist(),
        lambda x: x.cpu(),
        lambda x: x.nonzero(),
        lambda x: torch.bincount(x.long()),
        lambda x: x.numpy(),
        lambda x: x.repeat_interleave(x.long()),
    ],
)
def test_emulated_capture_refuses_host_reads(read) -> None:
    x = torch.arange(1.0, 5.0)
    with pytest.raises(npu_emulation.EmulatedContractError, match="graph capture"):
        with emulated_graphs.graph(emulated_graphs.NPUGraph()):
            read(x * 2)
    assert x.tolist() == [1.0, 2.0, 3.0, 4.0]  # the refusal ends with the capture


def test_emulated_replay_reads_new_inputs_and_runs_no_python() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 8), torch.randn(16, 8)
    calls = []

    def step() -> torch.Tensor:  # a view (chunk), in-place ops, a functional op
        calls.append(1)
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up) + x.sum(-1, keepdim=True)

    def expected() -> torch.Tensor:
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up + x.sum(-1, keepdim=True)

    g = emulated_graphs.NPUGraph()
    with emulated_graphs.graph(g, pool=emulated_graphs.graph_pool_handle()):
        out = step()
    assert out.isnan().all()  # a capture does not execute: the results are undefined until a replay
    for _ in range(2):
        x.copy_(torch.randn(3, 8))  # new values in the static input
        g.replay()
        torch.testing.assert_close(out, expected(), rtol=0, atol=0)
    assert g.replay_count == 2 and len(calls) == 1  # the captured Python ran once, at capture


# ---- the engine on the emulator
# -------------------------------------------------------------------------------


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def engine(model: Path, enforce_eager: bool) -> LLM:
    return LLM(
        str(model),
        device="npu",
        dtype="bfloat16",
        block_size=128,
        kv_cache_memory=16 << 20,
        max_num_seqs=len(PROMPTS),
        enforce_eager=enforce_eager,
    )


def compare(model: Path, monkeypatch) -> device_graphs.DeviceGraphs:
    """Capture sizes 1, 2, 4 (MAX_CAPTURE_SIZE 4) with max_num_seqs 6: batches 1, 2, 4 replay exactly, 3
    replays the size-4 graphs padded, 5 and 6 run eagerly."""
    monkeypatch.setattr(device_graphs, "MAX_CAPTURE_SIZE", 4)
    llm = engine(model, enforce_eager=False)
    graphs = llm.engine.runner.device_graphs
    assert graphs is not None and sorted({s.size for s in graphs.steps.values()}) == [1, 2, 4]
    caches = [m.k_cache for m in llm.engine.model.modules() if isinstance(m, Attention)]
    # the capture's attention saw replayed q/k/v, not NaN
    assert all(cache.isfinite().all() for cache in caches)
    run, batches = graphs.run, []

    def counted(input_ids: torch.Tensor, *args) -> torch.Tensor | None:
        hidden = run(input_ids, *args)
        batches.append((input_ids.shape[0], hidden))
        return hidden

    monkeypatch.setattr(graphs, "run", counted)
    got = greedy_tokens(llm)
    assert got == greedy_tokens(engine(model, enforce_eager=True))
    replayed = sorted({n for n, hidden in batches if hidden is not None})
    assert replayed == [1, 2, 3, 4] and sorted({n for n, hidden in batches if hidden is None}) == [5, 6]
    for size in (1, 2, 4):
        pieces = graphs.steps[size].pieces
        # capture's one + the steps'
        assert all(p.graph.replay_count > 1 for p in pieces if p.graph is not None)
    return graphs


def test_tiny_llama_npu_graphs_match_eager(npu_graphs, tiny_llama_dir: Path, monkeypatch) -> None:
    graphs = compare(tiny_llama_dir, monkeypatch)
    num_layers = len(graphs.decoder.layers)
    pieces = graphs.steps[4].pieces
    assert sum(p.graph is not None for p in pieces) == num_layers + 1  # split at each attention only
    assert sum(p.graph is None for p in pieces) == num_layers


def test_tiny_deepseek_moe_npu_graphs_match_eager(
    npu_graphs, tiny_deepseek_moe_dir: Path, monkeypatch
) -> None:
    graphs = compare(tiny_deepseek_moe_dir, monkeypatch)
    moe_layers = sum(device_graphs.is_moe(layer) for layer in graphs.decoder.layers)
    assert moe_layers
    eager = [p for p in graphs.steps[4].pieces if p.graph is None]
    assert len(eager) == len(graphs.decoder.layers) + moe_layers  # attention everywhere, the MoE blocks


def test_enforce_eager_captures_nothing(npu_graphs, tiny_llama_dir: Path) -> None:
    runner = engine(tiny_llama_dir, enforce_eager=True).engine.runner
    assert runner.device_graphs is None and runner.decode_graphs is None and runner.enforce_eager


@pytest.mark.parametrize(
    "recipe",
    [  # npu_dynamic_quant + npu_quant_matmul; int4 npu_weight_quant_batchmatmul
        "w8a8",
        pytest.param("w4a16-rtn", marks=pytest.mark.slow),
    ],
)
def test_quantized_npu_graphs_match_eager(
    npu_graphs, npu_converted, tiny_llama_dir: Path, monkeypatch, recipe: str
) -> None:
    compare(npu_converted(tiny_llama_dir, recipe), monkeypatch)

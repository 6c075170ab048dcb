"""Device graphs (`enforce_eager=False` on the cuda and npu backends): pure decode steps replayed from graphs
captured at startup per batch-size bucket, piecewise as vLLM's CUDA graphs and vllm-ascend's ACL graphs.

Pieces: attention (KV-cache write + paged attention) runs eagerly between captured pieces: the npu op takes
host lists of sequence lengths and the cuda decode path reads seq_lens.max() on the host, so neither can be
captured. Everything between two attentions is one graph: [embedding, rotary factors, layer 0's input norm,
q/k/v projection, rotary], [layer i's o_proj, post-attention norm, MLP, layer i+1's input norm, q/k/v,
rotary], ..., [the last layer's o_proj, norm, MLP, final norm]. MoE blocks run eagerly too (logged at
startup): routed experts group tokens by expert with host-side counts (kernels/moe.py's
bincount(...).tolist(); the npu kernel's bincount sizes its output from the data), so the graph boundary moves
around them and the dense layers stay captured.

Batch sizes: capture sizes 1, 2, 4, ... up to min(max_num_seqs, MAX_CAPTURE_SIZE) (and that size); a step of n
sequences replays the smallest size >= n, its inputs padded (padded rows keep earlier steps' token ids and
positions, so they stay in range; their rows are sliced away before attention and from the result). Larger
decode steps, prefill and mixed steps run eagerly.

Memory: per size, static input buffers (token ids, positions), each eager piece's output buffer and every
captured piece's outputs stay alive; temporaries share one pool (`graph_pool_handle()`), largest size captured
first. Capture: a piece runs once eagerly (warm-up), is captured, then replayed once: a capture does not
execute on the device, and the eager attention after it must see real q/k/v (the dummy step writes slot 0 of
block 0 of each layer's cache, which has to stay finite).

Graph API by kernel backend: torch.cuda.{CUDAGraph, graph, graph_pool_handle, synchronize} or torch_npu's
torch.npu.{NPUGraph, graph, graph_pool_handle, synchronize} (ACL graphs, which mirror CUDA's).

Executed in the test suite: the npu path on the CPU torch_npu emulator, whose graph API records a capture's
aten ops, refuses host reads and replays the recorded ops on the static buffers
(tests/npu_emulation/graphs.py). Not executed here: CUDA graphs on a GPU (`benchmarks/cuda_check.py` compares
greedy tokens when one is lent) and ACL graphs on Ascend hardware.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ascq.platforms import platform_for
from ascq.runtime.layers.attention import Attention, AttentionMetadata
from ascq.runtime.layers.moe import FusedMoE
from ascq.runtime.models.llama import DecoderLayer, DecoderModel
from ascq.runtime.worker.decode_graphs import capture_sizes, dummy_decode_inputs

logger = logging.getLogger("ascq.runtime")

MAX_CAPTURE_SIZE = 32
"""Largest captured batch; vLLM captures up to 512, but each size costs startup time and pool memory."""
MOE_EAGER_REASON = "routed experts count tokens per expert on the host, which a graph cannot capture"

State = dict[str, Any]  # a step's named values: input_ids, positions, x, cos_sin, residual, q, k, v


@dataclass(frozen=True)
class GraphApi:
    new_graph: Callable[[], Any]
    graph: Callable[..., AbstractContextManager]  # graph(g, pool=...): capture what runs inside into g
    pool_handle: Callable[[], Any]
    synchronize: Callable[[], None]


def graph_api(backend: str) -> GraphApi:
    """The platform's graph API: torch.cuda's or torch.npu's (torch.npu exists once torch_npu is imported: the
    npu kernels do)."""
    platform = platform_for(backend)
    module = platform.torch_module()
    return GraphApi(
        getattr(module, platform.graph_class), module.graph, module.graph_pool_handle, module.synchronize
    )


def captures_graphs(backend: str | None) -> bool:
    """Whether the kernel backend's platform captures device graphs (cuda, npu)."""
    return backend is not None and platform_for(backend).graph_class is not None


def kernel_backend(model: nn.Module) -> str | None:
    """The kernel backend the model was finalized with (`ascq.kernels.<name>`), read from its attention
    layers."""
    backend = next((m.backend for m in model.modules() if isinstance(m, Attention)), None)
    return None if backend is None else backend.__name__.rsplit(".", 1)[-1]


def unsupported_reason(model: nn.Module, backend: str | None) -> str | None:
    """Why device graphs cannot be used for this model, or None."""
    if not captures_graphs(backend):
        return f"device graphs are for the backends of devices with a graph API, not {backend}"
    if not isinstance(getattr(model, "model", None), DecoderModel) or not len(model.model.layers):
        return f"{type(model).__name__} has no decoder layers to capture"
    if not all(isinstance(layer, DecoderLayer) for layer in model.model.layers):
        return "a decoder layer is not a DecoderLayer (no pre_attention / post_attention split)"
    graph_class = platform_for(backend).graph_class
    if not hasattr(getattr(torch, backend, None), graph_class):
        return f"torch.{backend}.{graph_class} is not available"
    return None


@dataclass
class Stage:
    """A part of a decode step: `run(state, meta)` returns the entries it sets. Eager stages run between
    graphs on the step's real rows: `reads` names the entries they take."""

    run: Callable[[State, AttentionMetadata], State]
    eager: bool = False
    reads: tuple[str, ...] = ()


def is_moe(layer: DecoderLayer) -> bool:
    return any(isinstance(m, FusedMoE) for m in layer.mlp.modules())


def layer_stages(layer: DecoderLayer, moe_eager: bool) -> list[Stage]:
    def pre(s: State, meta: AttentionMetadata) -> State:
        q, k, v, residual = layer.pre_attention(s["positions"], s["x"], s["residual"], s["cos_sin"])
        return {"q": q, "k": k, "v": v, "residual": residual}

    def attention(s: State, meta: AttentionMetadata) -> State:
        return {"x": layer.self_attn.attn(s["q"], s["k"], s["v"], meta)}

    def post(s: State, meta: AttentionMetadata) -> State:
        x, residual = layer.post_attention(s["x"], s["residual"])
        return {"x": x, "residual": residual}

    def mlp(s: State, meta: AttentionMetadata) -> State:
        return {"x": layer.mlp(s["x"])}

    return [
        Stage(pre),
        Stage(attention, eager=True, reads=("q", "k", "v")),
        Stage(post),
        Stage(mlp, eager=moe_eager, reads=("x",)),
    ]


def decode_stages(decoder: DecoderModel) -> list[Stage]:
    """A pure decode step of `DecoderModel.forward`, as stages."""

    def embed(s: State, meta: AttentionMetadata) -> State:
        x, cos_sin = decoder.embed(s["input_ids"], s["positions"])
        return {"x": x, "cos_sin": cos_sin, "residual": None}

    def final_norm(s: State, meta: AttentionMetadata) -> State:
        return {"x": decoder.norm(s["x"], s["residual"])[0]}

    stages = [Stage(embed)]
    for layer in decoder.layers:
        stages += layer_stages(layer, moe_eager=is_moe(layer))
    return [*stages, Stage(final_norm)]


def run_stages(stages: list[Stage], state: State, meta: AttentionMetadata) -> State:
    state = dict(state)
    for stage in stages:
        state.update(stage.run(state, meta))
    return state


@dataclass
class Piece:
    """A captured graph, or an eager stage with the static tensors it reads and the buffers its outputs go
    to."""

    graph: Any = None
    stage: Stage | None = None
    inputs: State = field(default_factory=dict)
    outputs: State = field(default_factory=dict)  # a graph's: everything it produced, kept alive

    def replay(self, num_rows: int, meta: AttentionMetadata) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        outputs = self.stage.run({name: t[:num_rows] for name, t in self.inputs.items()}, meta)
        for name, value in outputs.items():
            self.outputs[name][:num_rows].copy_(value)


@dataclass
class CapturedStep:
    """One batch size's decode step: static inputs, pieces in order, the final hidden states."""

    size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    pieces: list[Piece]
    hidden: torch.Tensor


class DeviceGraphs:
    """The decoder's pure decode steps as captured pieces per batch size (`capture` at startup, `run` per
    step)."""

    def __init__(self, model: nn.Module, backend: str) -> None:
        self.decoder: DecoderModel = model.model
        self.backend = backend
        self.api = graph_api(backend)
        self.stages = decode_stages(self.decoder)
        self.steps: dict[int, CapturedStep] = {}  # batch size n -> the captured step it replays (padded)
        self.pool = None

    @torch.inference_mode()
    def capture(self, max_num_seqs: int, device: torch.device) -> None:
        """Capture every size's pieces with a dummy decode step (block 0, slot 0 of each cache), largest
        first."""
        sizes = capture_sizes(max_num_seqs, MAX_CAPTURE_SIZE)
        logger.info(
            "capturing decode graphs (%s) for batch sizes %s; --enforce-eager skips it",
            platform_for(self.backend).graph_class,
            sizes,
        )
        moe_layers = [i for i, layer in enumerate(self.decoder.layers) if is_moe(layer)]
        if moe_layers:
            logger.info(
                "decode graphs: the MoE blocks of layers %s run eagerly between graphs (%s)",
                moe_layers,
                MOE_EAGER_REASON,
            )
        start = time.perf_counter()
        self.pool = self.api.pool_handle()
        captured = {}
        for size in reversed(sizes):  # largest first: smaller sizes reuse its pool memory
            captured[size] = self._capture_step(size, device)
            logger.info("decode graphs: batch %d captured (%.1f s)", size, time.perf_counter() - start)
        self.api.synchronize()
        self.steps = {n: captured[next(s for s in sizes if s >= n)] for n in range(1, sizes[-1] + 1)}

    def _capture_step(self, size: int, device: torch.device) -> CapturedStep:
        input_ids, positions, meta = dummy_decode_inputs(size, num_blocks=1)
        input_ids, positions, meta = input_ids.to(device), positions.to(device), meta.to(device)
        state: State = {"input_ids": input_ids, "positions": positions}
        pieces: list[Piece] = []
        for eager, stages in self._groups():
            if eager:
                stage = stages[0]
                inputs = {name: state[name] for name in stage.reads}
                pieces.append(Piece(stage=stage, inputs=inputs, outputs=stage.run(inputs, meta)))
                state = {**state, **pieces[-1].outputs}
                continue
            run_stages(stages, state, meta)  # warm-up
            graph = self.api.new_graph()
            with self.api.graph(graph, pool=self.pool):
                state = run_stages(stages, state, meta)
            graph.replay()
            pieces.append(Piece(graph=graph, outputs=state))
        return CapturedStep(size, input_ids, positions, pieces, state["x"])

    def _groups(self) -> list[tuple[bool, list[Stage]]]:
        """Eager stages alone, runs of captured stages together (one graph each)."""
        groups: list[tuple[bool, list[Stage]]] = []
        for stage in self.stages:
            if stage.eager or not groups or groups[-1][0]:
                groups.append((stage.eager, [stage]))
            else:
                groups[-1][1].append(stage)
        return groups

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Final hidden states [n, hidden] of a pure decode step of n sequences (a view of a static buffer,
        valid until the next step), or None when n is past the largest capture size."""
        num_rows = input_ids.shape[0]
        step = self.steps.get(num_rows)
        if step is None:
            return None
        step.input_ids[:num_rows].copy_(input_ids)
        step.positions[:num_rows].copy_(positions)
        for piece in step.pieces:
            piece.replay(num_rows, meta)
        return step.hidden[:num_rows]

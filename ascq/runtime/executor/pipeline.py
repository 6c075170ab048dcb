"""Pipeline parallelism: decoder layers split into stages, micro-batches streamed through them.

Stage s holds layers `stage_layers(...)`; stage 0 also the embedding, the last stage the final norm and LM
head (and, with tied embeddings, the embedding matrix it reuses). A step's requests are cut into
micro-batches; each stage runs micro-batch m, sends its hidden states and residual to the next stage with a
non-blocking send and goes on with m + 1 while the next stage works on m, so with M micro-batches the stages
overlap. The last stage's TP rank 0 sends each micro-batch's logits to global rank 0, which samples.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ascq.core.architecture import stage_layers
from ascq.runtime.distributed.parallel import ParallelState
from ascq.runtime.layers.attention import AttentionMetadata


def prune_for_stage(model: nn.Module, ps: ParallelState) -> Callable[[str], bool]:
    """Drop the meta model's modules other stages own; returns which checkpoint tensors this stage loads."""
    first, last = ps.pp_rank == 0, ps.pp_rank == ps.pp_size - 1
    layers = model.model.layers
    mine = stage_layers(len(layers), ps.pp_size, ps.pp_rank)
    for i in range(len(layers)):
        if i not in mine:
            layers[i] = nn.Identity()
    keep_embedding = first or (last and model.tie_word_embeddings)
    if not keep_embedding:
        model.model.embed_tokens = nn.Identity()
    if not last:
        model.model.norm = nn.Identity()
        model.lm_head = nn.Identity()

    def keep(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in mine
        if name.startswith("model.embed_tokens."):
            return keep_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return last
        return True

    return keep


def split_requests(num_tokens: list[int], num_micro_batches: int) -> list[tuple[int, int]]:
    """Request ranges [start, end) of about equal token counts, at most num_micro_batches of them."""
    total, bounds, start, acc = sum(num_tokens), [], 0, 0
    count = min(num_micro_batches, len(num_tokens))
    for i, n in enumerate(num_tokens):
        acc += n
        if len(bounds) < count - 1 and acc >= total * (len(bounds) + 1) / count and i + 1 < len(num_tokens):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(num_tokens)))
    return bounds


def micro_batch(meta: AttentionMetadata, start: int, end: int) -> tuple[int, int, AttentionMetadata]:
    """Token range and attention metadata of requests [start, end) of a step."""
    qsl = meta.query_start_loc
    t0, t1 = int(qsl[start]), int(qsl[end])
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[t0:t1],
        block_tables=meta.block_tables[start:end],
        query_start_loc=qsl[start : end + 1] - qsl[start],
        seq_lens=meta.seq_lens[start:end],
    )
    return t0, t1, sub


def run_pipeline(
    model: nn.Module,
    ps: ParallelState,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    sample_rows: list[int],
    micro_batches: list[tuple[int, int]],
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """This stage's part of one step; on global rank 0 returns the fp32 logits of `sample_rows`."""
    first, last = ps.pp_rank == 0, ps.pp_rank == ps.pp_size - 1
    prev_rank, next_rank = ps.rank - ps.tp_size, ps.rank + ps.tp_size
    last_stage_sender = (ps.pp_size - 1) * ps.tp_size
    inner = model.model
    layers = [layer for layer in inner.layers if not isinstance(layer, nn.Identity)]
    sends: list = []
    receives: list[tuple[object, torch.Tensor]] = []
    for start, end in micro_batches:
        t0, t1, sub = micro_batch(meta, start, end)
        rows = [r - t0 for r in sample_rows if t0 <= r < t1]
        if first:
            x, residual = inner.embed_tokens(input_ids[t0:t1]), None
        else:
            x = torch.empty(t1 - t0, hidden_size, dtype=dtype, device=input_ids.device)
            residual = torch.empty_like(x)
            dist.irecv(x, prev_rank).wait()
            dist.irecv(residual, prev_rank).wait()
        for layer in layers:
            x, residual = layer(positions[t0:t1], x, residual, sub)
        if not last:
            sends += [dist.isend(x.contiguous(), next_rank), dist.isend(residual.contiguous(), next_rank)]
        elif rows:
            hidden, _ = inner.norm(x, residual)
            logits = model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
            if ps.tp_rank == 0 and ps.rank != 0:
                sends.append(dist.isend(logits.contiguous(), 0))
            elif ps.rank == 0:
                receives.append((None, logits))
        if ps.rank == 0 and not last and rows:
            buffer = torch.empty(len(rows), vocab_size, dtype=torch.float32, device=input_ids.device)
            receives.append((dist.irecv(buffer, last_stage_sender), buffer))
    for handle in sends:
        handle.wait()
    if ps.rank != 0:
        return None
    for handle, _ in receives:
        if handle is not None:
            handle.wait()
    if not receives:
        return torch.empty(0, vocab_size)
    return torch.cat([buffer for _, buffer in receives])

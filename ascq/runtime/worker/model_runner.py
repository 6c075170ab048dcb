"""Builds one step's flat batch (tokens, positions, slot mapping, block tables) and runs the model on it."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ascq import envs
from ascq.core.errors import UnsupportedError
from ascq.platforms import platform_for
from ascq.runtime.layers.attention import AttentionMetadata
from ascq.runtime.layers.embedding import ParallelLMHead
from ascq.runtime.sched.request import Request
from ascq.runtime.sched.scheduler import SchedulerOutput
from ascq.runtime.worker import decode_graphs, device_graphs, fused_decode
from ascq.runtime.worker.decode_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from ascq.runtime.worker.device_graphs import DeviceGraphs

logger = logging.getLogger(__name__)


class ModelRunner:
    keeps_hidden_states = True  # `hidden_states` holds the last step's (prompt_logprobs, pooling)

    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        device: torch.device,
        enforce_eager: bool = True,
        max_num_seqs: int = 1,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.decode_graphs: DecodeGraphs | None = None  # cpu: pure decode steps through compiled layers
        self.device_graphs: DeviceGraphs | None = None  # cuda / npu: pure decode steps replayed from graphs
        if not enforce_eager:
            self._start_graphs(max_num_seqs)
        self.enforce_eager = self.decode_graphs is None and self.device_graphs is None
        self.fused_decode_reason = "decode graphs run instead" if not self.enforce_eager else "turned off"
        if self.enforce_eager and fused_decode.enabled() and platform_for(device).is_cpu:
            self.fused_decode_reason = fused_decode.attach(model)
            if self.fused_decode_reason:
                logger.debug("fused decode off: %s", self.fused_decode_reason)
        if envs.ASCQ_LM_HEAD_QUANT == "int8":  # opt-in, other logits
            head = getattr(model, "lm_head", None)
            if not platform_for(device).is_cpu or not isinstance(head, ParallelLMHead):
                raise UnsupportedError("ASCQ_LM_HEAD_QUANT=int8 needs the cpu backend and a ParallelLMHead")
            head.quantize_int8()
            logger.info(
                "ASCQ_LM_HEAD_QUANT=int8: the LM head runs as int8 (per-row scales); logits differ from bf16"
            )

    def _start_graphs(self, max_num_seqs: int) -> None:
        """Device graphs on the cuda / npu kernel backends, compiled decode graphs on the CPU ones."""
        backend = device_graphs.kernel_backend(self.model)
        if device_graphs.captures_graphs(backend):
            reason = device_graphs.unsupported_reason(self.model, backend)
            if not reason:
                self.device_graphs = DeviceGraphs(self.model, backend)
                self.device_graphs.capture(max_num_seqs, self.device)
        else:
            reason = decode_graphs.unsupported_reason(self.model, self.device)
            if not reason:
                self.decode_graphs = DecodeGraphs(self.model)
                self.decode_graphs.capture(max_num_seqs, self.device)
        if reason:
            logger.info("enforce_eager=False: %s; the model runs eagerly", reason)

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Inputs for the scheduled chunks, plus the flat row of each request's last scheduled token."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        bs = self.block_size
        spec_token_ids = out.spec_token_ids or [[]] * len(out.requests)
        for request, num_new, spec in zip(
            out.requests, out.num_scheduled_tokens, spec_token_ids, strict=True
        ):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            input_ids.extend(request.token_ids[start:end] + spec if spec else request.token_ids[start:end])
            span = range(start, end)
            positions.extend(span)
            table = request.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
        max_blocks = max(len(r.block_table) for r in out.requests)
        block_tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in out.requests]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(block_tables, torch.int32),
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            max_query_len=max(out.num_scheduled_tokens),  # proposed tokens included
        )
        meta.use_decode_graph = (
            self.decode_graphs is not None
            and meta.max_query_len == 1
            and len(out.requests) <= MAX_GRAPH_BATCH
        )
        return (
            tensor(input_ids, torch.int64),
            tensor(positions, torch.int64),
            meta,
            [q - 1 for q in query_start_loc[1:]],
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """fp32 logits for the requests whose scheduled chunk reaches their last token: one row each, or with
        k proposed tokens 1 + k rows (the last own token's and each proposed token's), in request order."""
        input_ids, positions, meta, last_rows = self.prepare(out)
        hidden = None
        if self.device_graphs is not None and meta.max_query_len == 1:
            hidden = self.device_graphs.run(input_ids, positions, meta)  # None past the largest capture size
        if hidden is None:
            hidden = self.model(input_ids, positions, meta)
        self.hidden_states = (
            hidden  # every scheduled token's final hidden state (the engine's prompt_logprobs)
        )
        spec_token_ids = out.spec_token_ids or [[]] * len(out.requests)
        rows, sampling = [], []
        for row, request, num_new, spec in zip(
            last_rows, out.requests, out.num_scheduled_tokens, spec_token_ids, strict=True
        ):
            if request.num_computed_tokens + num_new == request.num_tokens + len(spec):
                rows.extend(range(row - len(spec), row + 1))
                sampling.append(request)
        if not sampling:
            return hidden.new_empty((0, 0), dtype=torch.float32), []
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]), sampling

"""Multi-process executor: rank 0 schedules and samples, ranks 1..N-1 run the same model step on their shard.

One process per rank (`python -m ascq.runtime.executor.worker`, see worker.py), joined in one
torch.distributed process group (gloo on CPU, nccl on CUDA, hccl on Ascend through torch_npu) by tcp://
rendezvous at `master_addr:master_port`, or env:// under torchrun. Every step rank 0 broadcasts the step's
inputs (token ids, positions, slot mapping, block tables, which rows to sample, the micro-batch split) as one
pickled object over a gloo group (`broadcast_object_list`; on CPU this is the only metadata path that needs no
shared memory across nodes), then every rank runs the model. Rank 0 broadcasts None to stop the workers.
Workers watch their parent and exit when it dies (process_watch.py).

Initialisation is the same sequence of collectives on every rank (`init_rank`): join, load the shard, agree on
the largest per-rank KV block size, take rank 0's block count, allocate the cache.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ascq.core.errors import AscqError
from ascq.platforms import platform_for
from ascq.runtime.distributed.module_process import ModuleProcess
from ascq.runtime.distributed.parallel import ParallelState, destroy_parallel, init_parallel
from ascq.runtime.distributed.process_watch import exit_with_parent
from ascq.runtime.distributed.rendezvous import torchrun_rank
from ascq.runtime.executor.pipeline import prune_for_stage, run_pipeline, split_requests
from ascq.runtime.layers.attention import AttentionMetadata
from ascq.runtime.sched.scheduler import SchedulerOutput
from ascq.runtime.worker.kv_cache import allocate_kv_cache, bytes_per_block, kv_cache_torch_dtype
from ascq.runtime.worker.loader import load_model
from ascq.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger("ascq.distributed")
WORKER_JOIN_S = 5.0
WATCH_INTERVAL_S = 0.2  # how often rank 0 checks its workers while the ranks start


@dataclass
class StepInputs:
    """What every rank needs to run one step (CPU tensors; each rank moves them to its device)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    micro_batches: list[tuple[int, int]]  # request ranges, pipeline parallel only

    def to(self, device: torch.device) -> StepInputs:
        return StepInputs(
            self.input_ids.to(device),
            self.positions.to(device),
            self.meta.to(device),
            self.sample_rows,
            self.micro_batches,
        )


@dataclass
class RankInfo:
    rank: int
    local_rank: int
    init_method: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, local_rank: int) -> str:
    """One accelerator per rank on its node: cuda:<local rank> / npu:<local rank>; CPU ranks share the CPU."""
    return platform_for(device).set_device(local_rank)


def set_cpu_threads(args: Any) -> None:
    """CPU ranks of one node split its cores, unless OMP_NUM_THREADS says otherwise."""
    platform_for(args.device).set_cpu_threads(args.world_size // args.nnodes)


@dataclass
class RankModel:
    model: torch.nn.Module
    quant_config: Any
    state: ParallelState
    device: torch.device
    block_bytes: int  # the largest over ranks
    num_blocks: int


def init_rank(
    args: Any, config: dict[str, Any], dtype: torch.dtype, info: RankInfo, num_blocks_for_bytes: Any = None
) -> RankModel:
    """Join the group, load this rank's shard, size and allocate the KV cache (collective on every rank).

    `num_blocks_for_bytes(block_bytes, model) -> num_blocks` is rank 0's sizing; other ranks take its
    answer."""
    set_cpu_threads(args)
    device = rank_device(args.device, info.local_rank)
    ps = init_parallel(
        info.rank,
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        args.device,
        info.init_method,
        args.enable_expert_parallel,
    )
    prepare = (lambda model: prune_for_stage(model, ps)) if ps.pp_size > 1 else None
    model, quant = load_model(
        args.model, device, dtype, config, prepare=prepare, load_format=args.load_format, seed=args.seed
    )
    cache_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
    block_bytes = torch.tensor([bytes_per_block(model, args.block_size, cache_dtype)], dtype=torch.int64)
    dist.all_reduce(block_bytes, op=dist.ReduceOp.MAX, group=ps.cpu_group)
    answer = [num_blocks_for_bytes(int(block_bytes), model) if info.rank == 0 else None]
    dist.broadcast_object_list(answer, src=0, group=ps.cpu_group)
    if isinstance(answer[0], str):  # rank 0 could not size the cache: every rank stops with its message
        raise AscqError(answer[0])
    from ascq.kernels import torch_device

    allocate_kv_cache(model, answer[0], args.block_size, cache_dtype, torch_device(device))
    return RankModel(model, quant, ps, torch_device(device), int(block_bytes), answer[0])


@torch.inference_mode()
def run_step(
    model: torch.nn.Module, ps: ParallelState, step: StepInputs, config: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor | None:
    if ps.pp_size == 1:
        hidden = model(step.input_ids, step.positions, step.meta)
        if not step.sample_rows:
            return None
        return model.compute_logits(hidden[torch.tensor(step.sample_rows, device=hidden.device)])
    return run_pipeline(
        model,
        ps,
        step.input_ids,
        step.positions,
        step.meta,
        step.sample_rows,
        step.micro_batches,
        config["hidden_size"],
        config["vocab_size"],
        dtype,
    )


# ---- worker process --------------------------------------------------------------------------------------


def run_worker(
    args: Any, config: dict[str, Any], dtype: torch.dtype, info: RankInfo, parent_pid: int | None
) -> None:
    """Process entry point of ranks 1..N-1: initialise, then run every step rank 0 broadcasts until None."""
    import signal

    if parent_pid is not None:
        exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    try:
        rank = init_rank(args, config, dtype, info)
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=rank.state.cpu_group)
            if message[0] is None:
                break
            run_step(rank.model, rank.state, message[0].to(rank.device), config, dtype)
    except AscqError as exc:
        logger.error("rank %d: %s", info.rank, exc)
        code = 1
    else:
        code = 0
    destroy_parallel()
    # interpreter teardown with gloo's threads alive can take seconds; nothing is left to flush but the
    # streams
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_node(args: Any) -> None:
    """A node other than node 0 (`--node-rank R`) or a torchrun rank other than 0: run this node's ranks until
    rank 0 stops them."""
    config = args.model_config()
    dtype = args.resolve_dtype(config)
    if torchrun_rank() is not None:  # torchrun started this very rank
        info = RankInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), "env://")
        run_worker(args, config, dtype, info, parent_pid=None)
    local_world = args.world_size // args.nnodes
    init_method = f"tcp://{args.master_addr}:{args.master_port}"
    processes = spawn_workers(
        args,
        config,
        dtype,
        init_method,
        range(args.node_rank * local_world, (args.node_rank + 1) * local_world),
        local_world,
    )
    codes = [join_or_kill(p, None) for p in processes]
    if any(codes):
        raise AscqError(f"node {args.node_rank}: worker exit codes {codes}")


def spawn_workers(
    args: Any, config: dict[str, Any], dtype: torch.dtype, init_method: str, ranks: range, local_world: int
) -> list[ModuleProcess]:
    return [
        ModuleProcess(
            f"ascq-rank-{rank}",
            "ascq.runtime.executor.worker",
            (args, config, dtype, RankInfo(rank, rank % local_world, init_method), os.getpid()),
        )
        for rank in ranks
    ]


def join_or_kill(process: ModuleProcess, timeout_s: float | None) -> int:
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(WORKER_JOIN_S)
    return process.exitcode or 0


def watched(processes: list[ModuleProcess], work: Any, what: str) -> Any:
    """`work()` in a thread while this one watches the workers: a worker that exits first is a one-line
    AscqError here within WATCH_INTERVAL_S (rank 0 would otherwise wait for it until the group's timeout)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="ascq-rank0-init", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(WATCH_INTERVAL_S)
        dead = [p for p in processes if not p.is_alive()]
        if dead and thread.is_alive():
            codes = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
            raise AscqError(f"{what}: worker {codes} exited; see its output above")
    if "error" in result:
        raise result["error"]
    return result["value"]


# ---- rank 0 ----------------------------------------------------------------------------------------------


class MultiprocExecutor:
    """Rank 0's side: starts this node's workers, loads rank 0's shard, runs steps on every rank."""

    def __init__(
        self, args: Any, config: dict[str, Any], dtype: torch.dtype, num_blocks_for_bytes: Any
    ) -> None:
        if args.node_rank != 0:
            raise AscqError("only node 0 runs the engine; other nodes run `ascq serve ... --node-rank R`")
        self.config = config
        self.dtype = dtype
        self.processes: list = []
        self.num_threads = torch.get_num_threads()  # restored at shutdown: rank 0 may be the user's process
        # torchrun started every rank; this is rank 0, the others run `run_worker` themselves
        if torchrun_rank() is not None:
            if int(os.environ["WORLD_SIZE"]) != args.world_size or int(os.environ["RANK"]) != 0:
                raise AscqError(f"under torchrun the engine runs on RANK 0 with WORLD_SIZE {args.world_size}")
            init_method, local_world = "env://", int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
        else:
            port = args.master_port or free_port()
            init_method = f"tcp://{args.master_addr}:{port}"
            local_world = args.world_size // args.nnodes
            self.processes = spawn_workers(
                args, config, dtype, init_method, range(1, local_world), local_world
            )
        try:
            self.rank = watched(
                self.processes,
                lambda: init_rank(args, config, dtype, RankInfo(0, 0, init_method), num_blocks_for_bytes),
                "the ranks did not start",
            )
        except BaseException:
            self.shutdown()
            raise
        self.model, self.state, self.device = self.rank.model, self.rank.state, self.rank.device
        logger.info(
            "ranks: tensor parallel %d x pipeline parallel %d%s over %d node(s)",
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            " (expert parallel)" if args.enable_expert_parallel else "",
            args.nnodes,
        )

    def broadcast(self, step: StepInputs | None) -> None:
        dist.broadcast_object_list([step], src=0, group=self.state.cpu_group)

    def dead_ranks(self) -> str | None:
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]
        return f"worker process {', '.join(dead)} exited; the engine cannot continue" if dead else None

    def check_workers(self) -> None:
        dead = self.dead_ranks()
        if dead:
            raise AscqError(dead)

    def shutdown(self) -> None:
        started = getattr(self, "state", None) is not None
        intact = all(p.is_alive() for p in self.processes)
        if started and dist.is_initialized() and intact:
            try:
                self.broadcast(None)
            except RuntimeError:  # a worker is gone: the group is broken; kill the rest below
                intact = False
        for process in self.processes:
            # in a broken group the survivors wait in a collective that never completes: no grace period
            join_or_kill(process, WORKER_JOIN_S if intact else 0)
        self.processes = []
        destroy_parallel()
        torch.set_num_threads(self.num_threads)


class DistributedModelRunner(ModelRunner):
    """`ModelRunner` whose steps run on every rank: prepare here, broadcast, run this rank's part."""

    keeps_hidden_states = False

    def __init__(self, executor: MultiprocExecutor, block_size: int) -> None:
        super().__init__(executor.model, block_size, executor.device)
        self.executor = executor

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list]:
        self.executor.check_workers()
        input_ids, positions, meta, last_rows = self.prepare(out)
        sampling = [
            (row, request)
            for row, request, num_new in zip(last_rows, out.requests, out.num_scheduled_tokens, strict=True)
            if request.num_computed_tokens + num_new == request.num_tokens
        ]
        ps = self.executor.state
        micro_batches = split_requests(out.num_scheduled_tokens, ps.pp_size) if ps.pp_size > 1 else []
        step = StepInputs(input_ids, positions, meta, [row for row, _ in sampling], micro_batches)
        self.executor.broadcast(step.to(torch.device("cpu")))
        logits = run_step(self.model, ps, step, self.executor.config, self.executor.dtype)
        if not sampling:
            return input_ids.new_empty((0, 0), dtype=torch.float32), []
        return logits, [request for _, request in sampling]

    def dead_ranks(self) -> str | None:
        return self.executor.dead_ranks()

    def shutdown(self) -> None:
        self.executor.shutdown()

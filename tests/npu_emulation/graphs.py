"""An EMULATED ACL graph API: the part of torch_npu's `torch.npu` that graph capture uses (`NPUGraph`,
`graph`, `graph_pool_handle`, `synchronize`), on the CPU -- test code, not torch_npu. Tests install this
module as `torch.npu`.

What it does. `graph(g)` runs the code inside under a TorchDispatchMode that records every aten op (function,
arguments, result). A host read during the capture raises `EmulatedContractError`: `.item()`, `int()`,
`float()`, `bool()` of a tensor (aten.item / _local_scalar_dense / is_nonzero), `aten.equal`, ops whose output
size depends on the data (nonzero, bincount, masked_select, unique, repeat_interleave by a tensor without
output_size), `.tolist()` / `.numpy()`, and `.cpu()` / `.to("cpu")` (every emulated tensor lives on the CPU,
so a device move cannot be told from a host copy; neither belongs in a graph). After the capture, the
floating-point results of the recorded ops are filled with NaN: hardware does not execute a capture, so they
are undefined until a replay. `replay()` re-executes the recorded ops in order on the SAME tensor objects: a
functional op's result is copied into the tensor recorded as its output, an in-place / out= op runs again on
its recorded arguments, an op whose result aliases an input (a view) needs nothing. So a replay reads whatever
the static input buffers hold now, the Python code of the captured region does not run again, and Python
values computed during the capture stay baked in, as on hardware.

What it does not show: that torch_npu's capture accepts the real ops (the emulated torch_npu ops are recorded
as the aten ops of their plain-torch implementations, not as aclnn kernels); that in-place writes to tensors
made before the capture are deferred to the replay (here they happen during the capture too); streams, memory
pools (`pool` is accepted and ignored; every recorded tensor stays alive) and speed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .contract import EmulatedContractError

aten = torch.ops.aten
HOST_READS = {  # overload packet -> why it reads the device on the host
    aten.item: "reads a tensor value on the host (.item() / int() / float())",
    aten._local_scalar_dense: "reads a tensor value on the host (.item() / int() / float())",
    aten.is_nonzero: "reads a tensor value on the host (bool())",
    aten.equal: "returns a host bool",
    aten.nonzero: "sizes its output from the data",
    aten.bincount: "sizes its output from the data",
    aten.masked_select: "sizes its output from the data",
    aten._unique2: "sizes its output from the data",
    aten.unique_dim: "sizes its output from the data",
    aten.unique_consecutive: "sizes its output from the data",
}
TENSOR_HOST_METHODS = ("tolist", "numpy", "__array__", "cpu")
_pool_ids = itertools.count(1)
_capturing: list[NPUGraph] = []


def host_read(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why `func` reads device data on the host (not capturable), or None."""
    packet = func.overloadpacket
    if packet in HOST_READS:
        return HOST_READS[packet]
    if (
        func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
        and kwargs.get("output_size") is None
    ):
        return "sizes its output from the repeats tensor (no output_size)"
    devices = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.device)]
    if packet in (aten.to, aten._to_copy) and any(d.type == "cpu" for d in devices):
        return "copies to the host (.cpu() / .to('cpu'))"
    return None


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)}


@dataclass
class RecordedOp:
    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    out: Any
    fresh: list[torch.Tensor]  # result tensors that alias no input: a replay copies into these

    def replay(self) -> None:
        if self.func._schema.is_mutable:
            self.func(*self.args, **self.kwargs)
        elif self.fresh:
            inputs = _storages((self.args, self.kwargs))
            new = [
                t
                for t in pytree.tree_leaves(self.func(*self.args, **self.kwargs))
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
            ]
            for old, value in zip(self.fresh, new, strict=True):
                old.copy_(value)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[RecordedOp]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = host_read(func, args, kwargs)
        if reason:
            raise EmulatedContractError(f"graph capture: {func} {reason}; a captured graph cannot do that")
        out = func(*args, **kwargs)
        inputs = _storages((args, kwargs))
        fresh = [
            t
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
        ]
        self.ops.append(RecordedOp(func, args, kwargs, out, [] if func._schema.is_mutable else fresh))
        return out


@contextmanager
def _refuse_tensor_host_methods() -> Iterator[None]:
    """.tolist() / .numpy() read the data without an aten op the recorder sees, and .cpu() of a CPU tensor may
    dispatch none: refuse them while capturing."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in TENSOR_HOST_METHODS}

    def refusing(name: str):
        def refuse(self, *args, **kwargs):
            raise EmulatedContractError(f"graph capture: Tensor.{name}() reads the tensor on the host")

        return refuse

    for name in TENSOR_HOST_METHODS:
        setattr(torch.Tensor, name, refusing(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


class NPUGraph:
    """torch.npu.NPUGraph: capture_begin / capture_end (or the `graph` context manager), replay, reset."""

    def __init__(self) -> None:
        self.ops: list[RecordedOp] = []
        self.captured = False
        self.replay_count = 0
        self._capture: list = []

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self.captured or _capturing:
            raise EmulatedContractError(
                "NPUGraph.capture_begin: already captured, or another capture is running"
            )
        _capturing.append(self)
        refusal, recorder = _refuse_tensor_host_methods(), _Recorder(self.ops)
        refusal.__enter__()
        recorder.__enter__()
        self._capture = [recorder, refusal]

    def capture_end(self) -> None:
        for context in self._capture:
            context.__exit__(None, None, None)
        self._capture = []
        _capturing.remove(self)
        self.captured = True
        for op in self.ops:  # undefined until replayed, as on hardware
            for t in op.fresh:
                if t.is_floating_point():
                    t.fill_(float("nan"))

    def replay(self) -> None:
        if not self.captured:
            raise EmulatedContractError("NPUGraph.replay: nothing captured")
        for op in self.ops:
            op.replay()
        self.replay_count += 1

    def reset(self) -> None:
        self.ops, self.captured = [], False


@contextmanager
def graph(
    npu_graph: NPUGraph,
    pool: Any = None,
    stream: Any = None,
    capture_error_mode: str = "global",
    auto_dispatch_capture: bool = False,
) -> Iterator[NPUGraph]:
    """torch.npu.graph: capture the code inside into `npu_graph` (stream and pool are not modelled)."""
    npu_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
    try:
        yield npu_graph
    finally:
        npu_graph.capture_end()


def graph_pool_handle() -> tuple[int, int]:
    return (0, next(_pool_ids))


def synchronize(device: Any = None) -> None:
    """Emulated ops run synchronously on the CPU."""

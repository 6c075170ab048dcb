"""`LayerContext`: everything a modifier sees while one decoder layer is being converted."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ascq.core.qmath import keeps_source_grid
from ascq.quantize.architectures import Architecture, BalanceGroup, KVHook, LayerBlock
from ascq.quantize.input_capture import InputCapture
from ascq.quantize.modifier import QuantizedLinear
from ascq.quantize.schemes import LinearTarget

# hook(module, args, output), registered as a forward hook for one `run`
Hook = Callable[[nn.Module, tuple, Any], None]


@dataclasses.dataclass
class LayerContext:
    index: int
    prefix: str
    arch: Architecture
    layer: nn.Module
    inputs: list[torch.Tensor]  # calibration hidden states, fp32 [batch, seq, hidden] chunks
    targets: dict[str, LinearTarget]
    scale_dtype: torch.dtype
    source_block_size: int | None = (
        None  # the source checkpoint's quantization block (`qmath.source_block_size`)
    )
    source_float_min: bool = False  # its blocks have float minima (`qmath.source_has_float_min`)
    block: LayerBlock | None = None  # the residual half being converted (None: the whole layer)
    results: dict[str, QuantizedLinear] = dataclasses.field(default_factory=dict)
    extra_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    # set by the pipeline when the recipe's only modifier may propagate the calibration inputs itself: a
    # modifier that ran the whole layer with its quantized weights (GPTQ's sequential pass) leaves the outputs
    # in `propagated` (batched as `inputs`), and the pipeline does not run the layer again
    propagate_in_place: bool = False
    propagated: list[torch.Tensor] | None = None

    def module(self, name: str) -> nn.Module:
        return self.layer.get_submodule(name)

    def keeps_source_grid(self, name: str) -> bool:
        """Whether the target linear `name` is re-quantized onto its source's own grid
        (`qmath.keeps_source_grid`)."""
        return keeps_source_grid(self.targets[name].weights, self.source_block_size, self.source_float_min)

    def in_block(self, name: str) -> bool:
        """Whether module `name` runs in the block being converted."""
        return self.block is None or self.block.contains(name)

    def balance_groups(self) -> list[BalanceGroup]:
        """The architecture's balance groups whose smoothing layer runs in this block (each lies in one
        block)."""
        return [g for g in self.arch.balance_groups(self.index, self.layer) if self.in_block(g.smooth_layer)]

    def expert_names(self) -> list[str]:
        return [e for e in self.arch.expert_names(self.layer) if self.in_block(e)]

    def position_ids(self, seq_len: int) -> torch.Tensor:
        return torch.arange(seq_len, device=self.inputs[0].device)[None]

    def forward(self, x: torch.Tensor, kv_hook: KVHook | None = None) -> torch.Tensor:
        """One calibration sample through the block (the whole layer when `block` is None)."""
        return self.arch.forward_block(self.layer, self.block, x, self.position_ids(x.shape[1]), kv_hook)

    @torch.no_grad()
    def run(self, hooks: dict[str, Hook] | None = None, kv_hook: KVHook | None = None) -> list[torch.Tensor]:
        """Forward every calibration sample through the block; `hooks` are active for this call only."""
        with registered_hooks(self.layer, hooks or {}):
            return [self.forward(x, kv_hook) for x in self.inputs]

    @torch.no_grad()
    def capture_inputs(
        self, names: list[str], on_input: dict[str, Callable[[torch.Tensor], None]] | None = None
    ) -> InputCapture:
        """`InputCapture` of the named modules over every calibration sample. A sample's forward stops once
        each named module has received its input (their outputs are not needed: e.g. down_proj is not
        computed)."""
        stopper = _Stopper(names)
        with InputCapture(self.layer, names, on_input) as capture:
            handles = [
                self.layer.get_submodule(n).register_forward_pre_hook(lambda *_, n=n: stopper.mark(n))
                for n in names
            ]
            try:
                stopper.run(self)
            finally:
                for handle in handles:
                    handle.remove()
        return capture

    @torch.no_grad()
    def observe(self, hooks: dict[str, Hook]) -> None:
        """Run every calibration sample only as far as the hooked modules (each called once per forward): a
        sample's forward stops once every hooked module has produced its output, so e.g. SmoothQuant's norm
        statistics skip the MLP. What the hooks see is what `run` would show them."""
        stopper = _Stopper(list(hooks))

        def stopping(name: str, hook: Hook) -> Hook:
            def wrapper(module: nn.Module, args: tuple, output: Any) -> None:
                hook(module, args, output)
                stopper.mark(name)

            return wrapper

        with registered_hooks(self.layer, {name: stopping(name, hook) for name, hook in hooks.items()}):
            stopper.run(self)

    def input_absmax(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Per-input-channel max |x| over all calibration tokens at each named module's input."""
        maxima: dict[str, torch.Tensor] = {}

        def observe(name: str) -> Hook:
            def hook(module: nn.Module, args: tuple, output: Any) -> None:
                channel_max = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
                maxima[name] = torch.maximum(maxima[name], channel_max) if name in maxima else channel_max

            return hook

        self.observe({name: observe(name) for name in names})
        return maxima


class _StopForward(Exception):
    """Raised by `_Stopper.mark` to end a sample's forward early."""


class _Stopper:
    """Runs each calibration sample until every one of `names` has been marked (by hooks), then stops it."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.pending: set[str] = set()

    def mark(self, name: str) -> None:
        self.pending.discard(name)
        if not self.pending:
            raise _StopForward

    def run(self, ctx: LayerContext) -> None:
        for x in ctx.inputs:
            self.pending = set(self.names)
            try:
                ctx.forward(x)
            except _StopForward:
                pass


@contextlib.contextmanager
def registered_hooks(layer: nn.Module, hooks: dict[str, Hook]) -> Iterator[None]:
    handles = [layer.get_submodule(name).register_forward_hook(hook) for name, hook in hooks.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

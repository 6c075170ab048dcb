"""Record what named submodules of a decoder layer receive while it runs, and replay them with a new input.

Used by the calibration-driven modifiers (AWQ, GPTQ): attention blocks are called with keyword arguments
(`hidden_states=`, position embeddings, masks) that plain forward hooks do not see, so these are pre-hooks
`with_kwargs`. The "main input" of a call is its first positional argument, else its `hidden_states` keyword.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

Call = tuple[tuple[Any, ...], dict[str, Any]]


def main_input(call: Call) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def with_main_input(call: Call, x: torch.Tensor) -> Call:
    args, kwargs = call
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def first_output(output: Any) -> torch.Tensor:
    """Attention modules return (output, weights); MLPs and linears return the tensor."""
    return output[0] if isinstance(output, tuple) else output


class InputCapture:
    """Context manager: while active, `calls[name]` collects every call's (args, kwargs) of each named module.

    `on_input[name]` (optional) is called with each main input instead of storing the call (e.g. to accumulate
    a Hessian without keeping the tensors).
    """

    def __init__(
        self,
        root: nn.Module,
        names: Iterable[str],
        on_input: dict[str, Callable[[torch.Tensor], None]] | None = None,
    ) -> None:
        self.root = root
        self.names = list(names)
        self.on_input = on_input or {}
        self.calls: dict[str, list[Call]] = {name: [] for name in self.names}
        self._handles: list[Any] = []

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            call = (tuple(_detach(a) for a in args), {k: _detach(v) for k, v in kwargs.items()})
            if name in self.on_input:
                self.on_input[name](main_input(call))
            else:
                self.calls[name].append(call)

        return hook

    def __enter__(self) -> InputCapture:
        modules = dict(self.root.named_modules())
        for name in self.names:
            self._handles.append(modules[name].register_forward_pre_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def inputs(self, name: str) -> list[torch.Tensor]:
        return [main_input(call) for call in self.calls[name]]


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def replay(module: nn.Module, calls: list[Call], inputs: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated (flattened to [tokens, features]) outputs of `module` re-run on each call with a new
    input. Calls that passed the module its input alone (an MLP or MoE block: nothing tells it where a
    sequence starts, so it works token by token) run as one call on all inputs side by side, which reads the
    block's weights once instead of once per call."""
    if len(calls) > 1 and all(len(args) == 1 and not kwargs for args, kwargs in calls):
        out = first_output(module(torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs])[None]))
        return out.reshape(-1, out.shape[-1])
    outputs = []
    for call, x in zip(calls, inputs, strict=True):
        args, kwargs = with_main_input(call, x)
        out = first_output(module(*args, **kwargs))
        outputs.append(out.reshape(-1, out.shape[-1]))
    return torch.cat(outputs)
